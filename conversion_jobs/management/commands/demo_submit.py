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
from conversion_jobs.converters.base import RESULT_EXT

DEFAULT_OUTPUTS = {".pdf": "text", ".png": "pdf", ".jpg": "pdf", ".tif": "png", ".tiff": "png"}
TERMINAL = ("succeeded", "partial", "failed", "cancelled")


class Api:
    """A tiny HTTP client for Quire's API (standard library only)."""

    def __init__(self, base: str, token: str) -> None:
        if not base.startswith(("http://", "https://")):
            raise CommandError("--url must be http(s)://")
        self.base, self.token = base.rstrip("/"), token

    def call(
        self,
        method: str,
        path: str,
        *,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, dict[str, str], bytes]:
        req = urllib.request.Request(self.base + path, data=body, method=method)  # noqa: S310
        req.add_header("Authorization", f"Bearer {self.token}")
        for name, value in (headers or {}).items():
            req.add_header(name, value)
        try:
            with urllib.request.urlopen(req, timeout=40) as resp:  # noqa: S310  (checked above)
                return resp.status, _lowered(resp.headers.items()), resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, _lowered(exc.headers.items()), exc.read()


def _lowered(items: Any) -> dict[str, str]:
    """Response headers by lower-case name (HTTP names are case-insensitive; the server may
    send them in lower case)."""
    return {name.lower(): value for name, value in items}


def multipart(path: Path, output: str) -> tuple[bytes, str]:
    boundary = uuid.uuid4().hex
    head = f"--{boundary}\r\nContent-Disposition: form-data; "
    body = b"".join(
        [
            f'{head}name="output"\r\n\r\n{output}\r\n'.encode(),
            f'{head}name="file"; filename="upload"\r\n'.encode(),
            b"Content-Type: application/octet-stream\r\n\r\n",
            path.read_bytes(),
            f"\r\n--{boundary}--\r\n".encode(),
        ]
    )
    return body, f"multipart/form-data; boundary={boundary}"


class Command(BaseCommand):
    help = "Submit files to Quire's API, wait for them, save results under --out."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("files", nargs="+", type=Path)
        parser.add_argument("--url", default="http://127.0.0.1:8000")
        parser.add_argument("--tenant", default="demo")
        parser.add_argument("--out", type=Path, default=Path("var/demo-results"))
        parser.add_argument("--timeout", type=float, default=300)

    def handle(self, *args: Any, **opts: Any) -> None:
        scopes = ["jobs:submit", "jobs:read"]
        token = token_mint(tenant=opts["tenant"], subject="demo", scopes=scopes, ttl_s=3600)
        api = Api(opts["url"], token)
        out: Path = opts["out"]
        out.mkdir(parents=True, exist_ok=True)
        pending: dict[str, Path] = {}
        for path in opts["files"]:
            output = DEFAULT_OUTPUTS.get(path.suffix.lower(), "pdf")
            body, ctype = multipart(path, output)
            status, _, raw = api.call(
                "POST", "/api/v1/jobs", body=body, headers={"Content-Type": ctype}
            )
            if status not in (200, 202):
                raise CommandError(f"{path.name}: HTTP {status} {raw.decode(errors='replace')}")
            job = json.loads(raw)
            pending[job["id"]] = path
            self.stdout.write(f"submitted {path.name} -> {output}: HTTP {status}, job {job['id']}")
        self._follow(api, pending, out, deadline=time.monotonic() + opts["timeout"])

    def _follow(self, api: Api, pending: dict[str, Path], out: Path, *, deadline: float) -> None:
        etags: dict[str, str] = {}  # the ETag of the last representation seen, per job
        while pending and time.monotonic() < deadline:
            for job_id in list(pending):
                headers = {"If-None-Match": etags[job_id]} if job_id in etags else {}
                status, got, raw = api.call("GET", f"/api/v1/jobs/{job_id}?wait=2", headers=headers)
                if status == 304:
                    continue
                job = json.loads(raw)
                etags[job_id] = got.get("etag", "")
                pages = job["pages"]
                self.stdout.write(
                    f"  {pending[job_id].name}: {job['state']} "
                    f"(pages {pages['done']}/{pages['total'] or '?'})"
                )
                if job["state"] in TERMINAL:
                    self._save(api, job, pending.pop(job_id), out)
        if pending:
            raise CommandError(f"{len(pending)} job(s) did not finish in time")

    def _save(self, api: Api, job: dict[str, Any], source: Path, out: Path) -> None:
        if job["state"] not in ("succeeded", "partial"):
            self.stdout.write(f"{source.name}: {job['state']} {job['error']}")
            return
        _, headers, raw = api.call("GET", f"/api/v1/jobs/{job['id']}/result")
        dest = out / f"{source.stem}.{RESULT_EXT[job['output']]}"
        dest.write_bytes(raw)
        self.stdout.write(
            f"{source.name}: {job['state']} -> {dest} ({len(raw)} bytes, "
            f"{headers.get('content-type')}, ETag {headers.get('etag', '')[:14]}…)"
        )
        if dest.suffix == ".txt":
            preview = raw.decode("utf-8", errors="replace").replace("\f", " | ")[:200]
            self.stdout.write(f"    text: {preview}")
