"""The artifact store through real processes: a 100 MiB upload streams through a real web
process without growing it, and the result streams back (whichever backend the profile uses;
the S3 profile runs it against a real S3 server)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import socket
import threading
import time
import urllib.request
import uuid
import zipfile
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import requests
from PIL import Image

from conversion_jobs import storage
from conversion_jobs.models import ConversionJob, PageCheckpoint
from tests import testdocs
from tests.conftest import token
from tests.e2e import harness
from tests.e2e.conftest import role_env

pytestmark = [pytest.mark.e2e, pytest.mark.postgres]

MIB = 1024 * 1024
BUDGET_MIB = 64
#: what one download may grow the web by (a streamed batch, buffers; never the whole body)
DOWNLOAD_BUDGET_MIB = 6


def _rss_kib(pid: int, field: str = "VmRSS") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise AssertionError(f"{field} missing for {pid}")


def _multipart(path: Path, source: Path, *, size: int, output: str = "text") -> str:
    """A multipart body on disk (so the client streams it too): ``source`` padded to ``size``."""
    boundary = uuid.uuid4().hex
    head = source.read_bytes()
    with open(path, "wb") as out:
        out.write(
            f'--{boundary}\r\nContent-Disposition: form-data; name="output"\r\n\r\n{output}\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; '
            f'filename="big.pdf"\r\nContent-Type: application/pdf\r\n\r\n'.encode()
        )
        out.write(head)
        padding = size - len(head)
        block = b"%" * MIB
        while padding > 0:
            out.write(block[: min(padding, MIB)])
            padding -= MIB
        out.write(f"\r\n--{boundary}--\r\n".encode())
    return boundary


def _web(cluster: harness.Cluster) -> tuple[harness.Proc, str]:
    port = harness_free_port()
    proc = cluster.start(
        "web",
        QUIRE_BIND=f"127.0.0.1:{port}",
        WEB_CONCURRENCY="1",
        WEB_THREADS="2",
        # the web publishes as the publisher user, as the Procfile's web does in production
        **role_env("web"),
    )
    base = f"http://127.0.0.1:{port}"
    harness.wait_until(
        lambda: urllib.request.urlopen(f"{base}/health/live", timeout=2).status == 200,  # noqa: S310
        timeout=60,
        what="web ready",
    )
    return proc, base


def harness_free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _post(base: str, body: Path, boundary: str) -> dict:
    request = urllib.request.Request(  # noqa: S310
        f"{base}/api/v1/jobs",
        data=open(body, "rb"),
        method="POST",
        headers={
            "Authorization": f"Bearer {token()}",
            "Content-Type": f"multipart/form-data; boundary={boundary}",
            "Content-Length": str(body.stat().st_size),
        },
    )
    with urllib.request.urlopen(request, timeout=300) as response:  # noqa: S310
        assert response.status == 202
        return json.loads(response.read())


def test_upload__100_mib_streams_through_the_web_without_growing_it(
    cluster, start, tmp_path, settings
):
    web, base = _web(cluster)
    worker_pid = harness.process_tree(web.pid)[-1]
    small = testdocs.make_pdf(tmp_path / "small.pdf", pages=1, text_of=lambda n: uuid.uuid4().hex)
    warm = tmp_path / "warm.body"
    _post(base, warm, _multipart(warm, small, size=MIB))  # imports, connections: warm
    idle = _rss_kib(worker_pid)

    big = tmp_path / "big.body"
    boundary = _multipart(big, small, size=100 * MIB - 64 * 1024)
    peak, stop = [idle], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak.append(_rss_kib(worker_pid))
            time.sleep(0.01)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        job = _post(base, big, boundary)
    finally:
        stop.set()
        sampler.join()
    grown_mib = (max(peak) - idle) / 1024
    kind = storage.store().kind
    print(f"web worker RSS idle {idle / 1024:.1f} MiB, peak +{grown_mib:.1f} MiB ({kind})")
    assert grown_mib <= BUDGET_MIB, f"web grew {grown_mib:.1f} MiB during a 100 MiB upload"
    assert job["source"]["size"] == 100 * MIB - 64 * 1024
    sources = [o for o in storage.list_objects("sources") if o.size == job["source"]["size"]]
    assert len(sources) == 1
    assert sources[0].key.endswith(job["source"]["sha256"])


def test_result__streams_back_through_the_web(cluster, start, tmp_path):
    _web_proc, base = _web(cluster)
    start("worker")
    start("sweeper")
    start("beat")
    texts = [uuid.uuid4().hex for _ in range(3)]
    pdf = testdocs.make_pdf(tmp_path / "doc.pdf", pages=3, text_of=lambda n: texts[n - 1])
    body = tmp_path / "doc.body"
    job = _post(base, body, _multipart(body, pdf, size=pdf.stat().st_size))
    data, _headers = _result_when_succeeded(base, job["id"])
    assert [t.strip() for t in data.decode().split("\f")] == texts
    # Small text pages: the result is their checkpoint rows (no object), served the same way.
    published = ConversionJob.objects.get(id=job["id"])
    assert published.result_key == f"inline:results/{job['id']}/result.g1.txt"
    assert (published.result_sha256, published.result_size) == (
        hashlib.sha256(data).hexdigest(),
        len(data),
    )
    assert list(storage.list_objects(f"results/{job['id']}")) == []


def _result_when_succeeded(base: str, job_id: str) -> tuple[bytes, Any]:
    """Wait (polling the API) until the job succeeded, then download its result through the
    web; the ETag is the body's sha256 and Content-Length its size."""
    auth = {"Authorization": f"Bearer {token()}"}

    def done() -> dict | None:
        request = urllib.request.Request(f"{base}/api/v1/jobs/{job_id}", headers=auth)  # noqa: S310
        with urllib.request.urlopen(request, timeout=10) as response:  # noqa: S310
            state = json.loads(response.read())
        return state if state["state"] == "succeeded" else None

    harness.wait_until(done, timeout=60, what="job succeeded")
    request = urllib.request.Request(f"{base}/api/v1/jobs/{job_id}/result", headers=auth)  # noqa: S310
    with urllib.request.urlopen(request, timeout=30) as response:  # noqa: S310
        data = response.read()
        assert response.headers["ETag"] == f'"{hashlib.sha256(data).hexdigest()}"'
        assert response.headers["Content-Length"] == str(len(data))
        return data, response.headers


def test_png_result__the_zip_of_the_pages_streams_through_the_web(cluster, start, tmp_path):
    """A PNG result has no object of its own: the web streams the ZIP of the page objects."""
    _web_proc, base = _web(cluster)
    start("worker")
    start("sweeper")
    start("beat")
    pdf = testdocs.make_pdf(tmp_path / "doc.pdf", pages=3, text_of=lambda n: f"page {n}")
    body = tmp_path / "doc.body"
    job = _post(base, body, _multipart(body, pdf, size=pdf.stat().st_size, output="png"))
    data, headers = _result_when_succeeded(base, job["id"])
    assert headers["Content-Type"] == "application/zip"
    archive = zipfile.ZipFile(io.BytesIO(data))
    assert archive.namelist() == ["page-0001.png", "page-0002.png", "page-0003.png"]
    for n, name in enumerate(archive.namelist(), start=1):
        page = urllib.request.Request(  # noqa: S310
            f"{base}/api/v1/jobs/{job['id']}/pages/{n}",
            headers={"Authorization": f"Bearer {token()}"},
        )
        with urllib.request.urlopen(page, timeout=30) as response:  # noqa: S310
            assert archive.read(name) == response.read()
    assert not list(storage.list_objects(f"results/{job['id']}"))


def _noise_tiff(path: Path, *, frames: int, side: int) -> Path:
    """A multi-page TIFF of random RGB pixels: each PNG page is about ``3 * side**2`` bytes
    (noise does not compress), so the result ZIP is far larger than any socket buffer."""
    images = [
        Image.frombytes("RGB", (side, side), os.urandom(3 * side * side)) for _ in range(frames)
    ]
    images[0].save(path, format="TIFF", save_all=True, append_images=images[1:])
    return path


def _read_slowly(base: str, path: str, *, first: int, then: Any) -> tuple[int, int | None, bytes]:
    """GET ``path`` over a socket whose receive buffer is 4 KiB, reading ``first`` body bytes
    slowly (the server can only run a little ahead of what the client took), then ``then()``,
    then the rest as fast as it comes until the server closes. (status, Content-Length, body)."""
    url = urlsplit(base)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(30)
    sock.connect((url.hostname, url.port))
    with sock:
        sock.sendall(
            f"GET {path} HTTP/1.1\r\nHost: {url.netloc}\r\n"
            f"Authorization: Bearer {token()}\r\nConnection: close\r\n\r\n".encode()
        )
        received = b""
        while b"\r\n\r\n" not in received:
            chunk = sock.recv(4096)
            assert chunk, f"closed before the response head: {received!r}"
            received += chunk
        head, body = received.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        fields = dict(line.split(": ", 1) for line in lines[1:])
        length = {k.lower(): v for k, v in fields.items()}.get("content-length")
        while len(body) < first:
            chunk = sock.recv(4096)
            if not chunk:
                break
            body += chunk
            time.sleep(0.005)
        then()
        while chunk := sock.recv(65536):
            body += chunk
    return status, int(length) if length is not None else None, body


def test_png_result__a_page_deleted_while_a_client_reads_cuts_the_connection(
    cluster, start, tmp_path
):
    """The web checks every page object before it answers (a missing one: 500
    result_incomplete); one deleted while a slow client reads the ZIP is found only when the
    stream reaches it, and the server closes the connection short of the Content-Length it
    announced, which every HTTP client reports as an incomplete body. What the client got is
    the archive's true prefix: never a complete-looking 200 with other bytes. Before that, a
    whole download grows the web by far less than the archive (it holds a batch, not the
    result: conversion_jobs.web.handler.QuireASGIHandler.send_response)."""
    web, base = _web(cluster)
    web_worker = harness.process_tree(web.pid)[-1]
    start("worker")
    start("sweeper")
    start("beat")
    frames = 8
    tiff = _noise_tiff(tmp_path / "noise.tiff", frames=frames, side=800)
    response = requests.post(
        f"{base}/api/v1/jobs",
        headers={"Authorization": f"Bearer {token()}"},
        files={"file": ("noise.tiff", tiff.read_bytes(), "image/tiff")},
        data={"output": "png"},
        timeout=60,
    )
    assert response.status_code == 202, response.content
    job_id = response.json()["id"]
    harness.wait_until(
        lambda: ConversionJob.objects.get(id=job_id).state == "succeeded",
        timeout=120,
        what="the PNG job succeeded",
    )
    peak_before = _rss_kib(web_worker, "VmHWM")
    full, _headers = _result_when_succeeded(base, job_id)
    grown_mib = (_rss_kib(web_worker, "VmHWM") - peak_before) / 1024
    print(f"web worker peak RSS +{grown_mib:.1f} MiB serving a {len(full) / MIB:.1f} MiB ZIP")
    assert grown_mib < DOWNLOAD_BUDGET_MIB < len(full) / MIB / 2, grown_mib
    assert zipfile.ZipFile(io.BytesIO(full)).namelist() == [
        f"page-{n:04d}.png" for n in range(1, frames + 1)
    ]
    last = PageCheckpoint.objects.get(job_id=job_id, page_number=frames)
    assert last.artifact_size > 1_500_000  # noise: the PNG is as large as its pixels
    first = 64 * 1024

    status, length, body = _read_slowly(
        base,
        f"/api/v1/jobs/{job_id}/result",
        first=first,
        then=lambda: storage.delete(last.artifact_key or ""),
    )

    assert (status, length) == (200, len(full))
    assert first <= len(body) < len(full) - last.artifact_size, (len(body), len(full))
    assert body == full[: len(body)]
    # The next download is refused before it starts, and the web serves on.
    again = requests.get(
        f"{base}/api/v1/jobs/{job_id}/result",
        headers={"Authorization": f"Bearer {token()}"},
        timeout=30,
    )
    assert (again.status_code, again.json()["code"]) == (500, "result_incomplete")
    assert requests.get(f"{base}/health/live", timeout=5).status_code == 200
    # The cut is logged by its error's class; the vanished object's path or key (the store's
    # own error message names it) reaches no log line. (The access log has the request path.)
    log = web.log.read_text(errors="replace")
    assert "download cut short" in log and "DownloadCut" in log
    key = last.artifact_key or ""
    assert key and key not in log and "No such file" not in log
