"""Submit documents to a running Quire over its real HTTP API, follow them to a terminal state
and save the results: the README's main job (``deploy/demo.sh``) uses it."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from conversion_jobs.api.auth import token_mint

DEFAULT_OUTPUTS = {".pdf": "text", ".png": "pdf", ".jpg": "pdf", ".tif": "png", ".tiff": "png"}


def _request(method: str, url: str, token: str, body: bytes | None = None, content_type: str | None = None) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(url, data=body, method=method)  # noqa: S310  (operator-given URL)
    req.add_header("Authorization", f"Bearer {token}")
    if content_type:
        req.add_header("Content-Type", content_type)
    try:
        with urllib.request.urlopen(req, timeout=40) as resp:  # noqa: S310
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def _multipart(path: Path, output: str, options: dict[str, Any]) -> tuple[bytes, str]:
    boundary = uuid.uuid4().hex
    parts = [
        f'--{boundary}\r\nContent-Disposition: form-data; name="output"\r\n\r\n{output}\r\n'.encode(),
        f'--{boundary}\r\nContent-Disposition: form-data; name="options"\r\n\r\n{json.dumps(options)}\r\n'.encode(),
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="upload"\r\n'
        "Content-Type: application/octet-stream\r\n\r\n".encode()
        + path.read_bytes()
        + b"\r\n",
        f"--{boundary}--\r\n".encode(),
    ]
    return b"".join(parts), f"multipart/form-data; boundary={boundary}"


class Command(BaseCommand):
    help = "Submit files to Quire's API, wait for them, save results under --out."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("files", nargs="+", type=Path)
        parser.add_argument("--url", default="http://127.0.0.1:8000")
        parser.add_argument("--tenant", default="demo")
        parser.add_argument("--out", type=Path, default=Path("var/demo-results"))
        parser.add_argument("--timeout", type=float, default=300)

    def handle(self, *args: Any, **opts: Any) -> None:
        token = token_mint(tenant=opts["tenant"], subject="demo", scopes=["jobs:submit", "jobs:read"], ttl_s=3600)
        base = opts["url"].rstrip("/")
        out: Path = opts["out"]
        out.mkdir(parents=True, exist_ok=True)
        jobs: dict[str, Path] = {}
        for path in opts["files"]:
            output = DEFAULT_OUTPUTS.get(path.suffix.lower(), "pdf")
            body, ctype = _multipart(path, output, {})
            status, headers, raw = _request("POST", f"{base}/api/v1/jobs", token, body, ctype)
            if status not in (200, 202):
                raise CommandError(f"{path.name}: HTTP {status} {raw.decode(errors='replace')}")
            job = json.loads(raw)
            jobs[job["id"]] = path
            self.stdout.write(f"submitted {path.name} -> {output}: HTTP {status}, job {job['id']} {job['state']}")
        deadline = time.monotonic() + opts["timeout"]
        pending = dict(jobs)
        versions: dict[str, int] = {}
        while pending and time.monotonic() < deadline:
            for job_id in list(pending):
                etag = f'"v{versions[job_id]}"' if job_id in versions else None
                url = f"{base}/api/v1/jobs/{job_id}?wait=2"
                req_headers = {"If-None-Match": etag} if etag else {}
                req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}", **req_headers})  # noqa: S310
                try:
                    with urllib.request.urlopen(req, timeout=40) as resp:  # noqa: S310
                        job = json.loads(resp.read())
                except urllib.error.HTTPError as exc:
                    if exc.code == 304:
                        continue
                    raise
                versions[job_id] = job["state_version"]
                self.stdout.write(f"  {pending[job_id].name}: {job['state']} (pages {job['pages']['done']}/{job['pages']['total']})")
                if job["state"] in ("succeeded", "partial", "failed", "cancelled"):
                    self._save(base, token, job, pending.pop(job_id), out)
        if pending:
            raise CommandError(f"{len(pending)} job(s) not finished within {opts['timeout']} s")

    def _save(self, base: str, token: str, job: dict[str, Any], source: Path, out: Path) -> None:
        if job["state"] not in ("succeeded", "partial"):
            self.stdout.write(f"{source.name}: {job['state']} {job['error']}")
            return
        status, headers, raw = _request("GET", f"{base}/api/v1/jobs/{job['id']}/result", token)
        ext = {"text": "txt", "png": "zip", "pdf": "pdf"}[job["output"]]
        dest = out / f"{source.stem}.{ext}"
        dest.write_bytes(raw)
        self.stdout.write(
            f"{source.name}: {job['state']} -> {dest} ({len(raw)} bytes, {headers.get('Content-Type')}, ETag {headers.get('ETag', '')[:14]}…)"
        )
        if ext == "txt":
            preview = raw.decode("utf-8", errors="replace").replace("\f", " | ")[:200]
            self.stdout.write(f"    text: {preview}")
