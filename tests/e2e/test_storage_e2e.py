"""The artifact store through real processes: a 100 MiB upload streams through a real web
process without growing it, and the result streams back (whichever backend the profile uses;
the S3 profile runs it against a real S3 server)."""

from __future__ import annotations

import hashlib
import io
import json
import threading
import time
import urllib.request
import uuid
import zipfile
from pathlib import Path
from typing import Any

import pytest

from conversion_jobs import storage
from conversion_jobs.models import ConversionJob
from tests import testdocs
from tests.conftest import token
from tests.e2e import harness
from tests.e2e.conftest import role_env

pytestmark = [pytest.mark.e2e, pytest.mark.postgres]

MIB = 1024 * 1024
BUDGET_MIB = 64


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
