"""Issue 10: a document sees only itself. Real jobs, real engines (LibreOffice, pdfium), a real
artifact store and a real HTTP listener: documents that link to another tenant's stored page,
to a host file or to a URL get nothing, and a converter child cannot open the store, read
/etc/shadow or reach Postgres (docs/adr/0013-converter-sandbox.md)."""

from __future__ import annotations

import http.server
import io
import os
import threading
import uuid
from pathlib import Path

import pypdfium2 as pdfium
import pytest
from django.conf import settings
from PIL import Image

from conversion_jobs import storage
from conversion_jobs.converters import Limits, run_isolated, sandbox, sessions
from conversion_jobs.models import PageCheckpoint
from tests import testdocs
from tests.integration.execution.jobkit import execute, submit

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("fast_quire"),
    pytest.mark.engine,
]

#: The colour of every secret image: found in an output page, the secret leaked.
SECRET = (13, 201, 77)


def secret_png(path: Path) -> Path:
    """A PNG of the secret colour, unique (a new document identity for every call)."""
    image = Image.new("RGB", (240, 240), SECRET)
    image.putpixel((0, 0), tuple(uuid.uuid4().bytes[:3]))
    image.save(path)
    return path


def shows_secret(pdf: bytes) -> bool:
    """Whether any page of ``pdf`` shows a patch of the secret colour."""
    document = pdfium.PdfDocument(pdf)
    for page in document:
        image = page.render(scale=1).to_pil().convert("RGB")
        for count, colour in image.getcolors(1 << 22) or []:
            if count > 50 and all(abs(a - b) < 6 for a, b in zip(colour, SECRET, strict=True)):
                return True
    return False


class Listener:
    """An HTTP server on 127.0.0.1 that answers every GET with the secret image and records
    every request it sees."""

    def __init__(self, image: bytes) -> None:
        self.requests: list[str] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.requests.append(self.path)
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(image)))
                self.end_headers()
                self.wfile.write(image)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/secret.png"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(autouse=True)
def _filesystem_store(settings):
    """These attacks aim at the artifact store on the worker's disk, so they run against the
    filesystem backend in every profile (with S3 there is no local store to reach; the
    network attacks, the HTTP listener, stand for a bucket endpoint)."""
    settings.QUIRE = {**settings.QUIRE, "STORAGE": "filesystem"}


@pytest.fixture
def listener(tmp_path):
    server = Listener(secret_png(tmp_path / "served.png").read_bytes())
    yield server
    server.close()


@pytest.fixture
def alpha_page(tmp_path, no_broker_publish) -> Path:
    """Tenant alpha's stored page image: a real job's page artifact in the store."""
    job = submit(secret_png(tmp_path / "alpha.png"), output="png", tenant="alpha")
    assert execute(job) == "succeeded"
    checkpoint = PageCheckpoint.objects.get(job_id=job.id, page_number=1)
    path = storage.store().path_of(checkpoint.artifact_key)  # type: ignore[attr-defined]
    assert path.is_file() and path.resolve().is_relative_to(Path(settings.QUIRE["STORAGE_DIR"]))
    return path


@pytest.fixture
def sandbox_mode(request, monkeypatch):
    """The test's ``mode`` parameter: the sandbox on, or (to test LibreOffice's profile alone)
    explicitly off."""
    sessions.release_all()  # the next fork server starts in this mode
    monkeypatch.setenv(sandbox.MODE_ENV, request.node.callspec.params["mode"])
    yield request.node.callspec.params["mode"]
    sessions.release_all()


#: LibreOffice 7.4's RTF import reads INCLUDEPICTURE targets itself: only the sandbox stops
#: that, so RTF is tested sandboxed only.
LINKING_CASES = [
    (kind, mode) for mode in ("on", "off") for kind in ("rtf", "docx", "odt")
    if not (kind == "rtf" and mode == "off")
]  # fmt: skip


def _linking_document(kind: str, target: str, tmp_path: Path) -> Path:
    path = tmp_path / f"beta-{uuid.uuid4().hex[:8]}.{kind}"
    text = f"beta document {uuid.uuid4().hex}"
    if kind == "rtf":
        return testdocs.make_rtf_includepicture(path, target=target, text=text)
    if kind == "docx":
        return testdocs.make_docx_linked_image(path, target=target, text=text)
    return testdocs.make_odt_linked_image(path, target=target, text=text)


def _target(where: str, *, alpha_page: Path, host_file: Path, listener: Listener, kind: str):
    path = {"store": alpha_page, "host": host_file}.get(where)
    if path is None:
        return listener.url
    return str(path) if kind == "rtf" else path.as_uri()


@pytest.mark.parametrize(("kind", "mode"), LINKING_CASES)
@pytest.mark.parametrize("where", ["store", "host", "http"])
def test_linked_content__the_output_holds_none_of_it_and_nothing_is_fetched(
    kind, mode, where, sandbox_mode, tmp_path, alpha_page, listener, api
):
    """Tenant beta's document links to alpha's stored page, a host file or a URL. Sandboxed:
    nothing is read and no request leaves. Sandbox off: LibreOffice's profile alone still
    refuses DOCX and ODT links (LibreOffice 7.4's RTF import reads INCLUDEPICTURE targets
    itself: only the sandbox stops that, so RTF is tested sandboxed only)."""
    host_file = secret_png(tmp_path / "host-secret.png")
    target = _target(
        where, alpha_page=alpha_page, host_file=host_file, listener=listener, kind=kind
    )
    job = submit(_linking_document(kind, target, tmp_path), output="pdf", tenant="beta")

    assert execute(job) == "succeeded"

    response = api(tenant="beta").get(f"/api/v1/jobs/{job.id}/result")
    assert response.status_code == 200, response.content
    result = b"".join(response.streaming_content)
    assert not shows_secret(result)
    assert listener.requests == []


def test_linked_content__the_check_sees_a_leak(tmp_path):
    """The detector above can fail: the secret image itself, in a PDF, is found."""
    page = secret_png(tmp_path / "leak.png")
    buffer = io.BytesIO()
    Image.open(page).save(buffer, format="PDF")
    assert shows_secret(buffer.getvalue())


def test_pdf_actions__launch_and_uri_have_no_effect(tmp_path, listener, no_broker_publish, api):
    """A PDF whose OpenAction launches a program and whose link points at a URL converts to
    text and to images; the program never runs and no request is made."""
    marker = tmp_path / "launched"
    script = tmp_path / "launch.sh"
    script.write_text(f"#!/bin/sh\ntouch {marker}\n")
    script.chmod(0o755)
    source = testdocs.make_pdf_with_actions(
        tmp_path / f"actions-{uuid.uuid4().hex[:8]}.pdf", launch=str(script), uri=listener.url
    )
    for document, output in ((source, "text"), (_unique_copy(source, tmp_path), "png")):
        job = submit(document, output=output, tenant="beta")
        assert execute(job) == "succeeded"
        job.refresh_from_db()
        assert job.pages_done == 1
    assert not marker.exists()
    assert listener.requests == []


def _unique_copy(source: Path, tmp_path: Path) -> Path:
    """The same PDF with a trailing comment: a new document identity."""
    copy = tmp_path / f"copy-{uuid.uuid4().hex[:8]}.pdf"
    copy.write_bytes(source.read_bytes() + f"\n% {uuid.uuid4().hex}\n".encode())
    return copy


POSTGRES_SOCKET = "/var/run/postgresql/.s.PGSQL.5432"


def _attempt_access(tmp_path: Path, alpha_page: Path) -> dict:
    return run_isolated(
        op="attempt_access",
        args={
            "files": [str(alpha_page), str(settings.QUIRE["STORAGE_DIR"]), "/etc/shadow"],
            "unix_sockets": [POSTGRES_SOCKET],
            "tcp": [["127.0.0.1", 5432], ["127.0.0.1", 5672]],
        },
        limits=Limits(),
        timeout_s=20,
        scratch_dir=tmp_path,
    )


def test_child__cannot_open_the_store_shadow_or_postgres(tmp_path, alpha_page):
    """From inside a converter child: the store (another tenant's page), /etc/shadow, the
    Postgres socket and 127.0.0.1:5432 (and RabbitMQ) are all out of reach."""
    assert sandbox.enabled()
    seen = _attempt_access(tmp_path, alpha_page)
    outcomes = {**seen["files"], **seen["unix_sockets"], **seen["tcp"]}
    assert len(outcomes) == 6
    assert all(outcome != "ok" for outcome in outcomes.values()), outcomes
    assert "FileNotFoundError" in seen["files"][str(alpha_page)]  # not even visible


def test_child__the_probe_reaches_them_with_the_sandbox_off(tmp_path, alpha_page, monkeypatch):
    """The escape attempts above can succeed: without the sandbox (the worker runs as root
    here) the same child reads the store and connects to Postgres."""
    sessions.release_all()
    monkeypatch.setenv(sandbox.MODE_ENV, "off")
    try:
        seen = _attempt_access(tmp_path, alpha_page)
    finally:
        sessions.release_all()
    assert seen["files"][str(alpha_page)] == "ok"
    assert seen["tcp"]["127.0.0.1:5432"] == "ok"
    if os.path.exists(POSTGRES_SOCKET):
        assert seen["unix_sockets"][POSTGRES_SOCKET] == "ok"


def test_attempt_access__is_a_test_operation_only(tmp_path, alpha_page, monkeypatch):
    from conversion_jobs.converters import TEST_FAULTS_ENV

    monkeypatch.delenv(TEST_FAULTS_ENV)
    with pytest.raises(RuntimeError, match="test operation"):
        _attempt_access(tmp_path, alpha_page)


def _status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return dict(line.split(":\t", 1) for line in lines if ":\t" in line)


def test_child__seen_from_outside_own_network_unprivileged_no_new_privileges(tmp_path):
    from conversion_jobs.converters.isolation import ChildSession

    with ChildSession() as session:
        session.setup(limits=Limits(), scratch_dir=tmp_path)
        pid = session.proc.pid
        status = _status(pid)
        assert os.readlink(f"/proc/{pid}/ns/net") != os.readlink("/proc/self/ns/net")
        assert os.readlink(f"/proc/{pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt")
        assert os.readlink(f"/proc/{pid}/ns/pid") != os.readlink("/proc/self/ns/pid")
        assert all(int(uid) != 0 for uid in status["Uid"].split())
        assert all(int(gid) != 0 for gid in status["Gid"].split())
        assert status["NoNewPrivs"].strip() == "1"
        assert int(status["CapEff"], 16) == 0
        assert status["NSpid"].split()[0] == str(pid)  # kill and reap use our pid


def test_sandbox_unavailable__the_attempt_is_retried_later_no_document_opened(
    tmp_path, monkeypatch, no_broker_publish
):
    """A worker whose sandbox broke after start-up (here: a uid of 0 configured) converts
    nothing: the attempt ends retryable with ``sandbox_unavailable`` and no child starts."""
    sessions.release_all()
    sandbox._probe_cache = None
    monkeypatch.setenv(sandbox.UID_ENV, "0")
    try:
        job = submit(
            testdocs.make_pdf(tmp_path / f"{uuid.uuid4().hex}.pdf", pages=1), output="text"
        )
        assert execute(job) == "retry_wait"
    finally:
        sandbox._probe_cache = None
    job.refresh_from_db()
    assert (job.state, job.error_code) == ("retry_wait", "sandbox_unavailable")
    assert not PageCheckpoint.objects.filter(job_id=job.id).exists()


def test_worker_start__an_unavailable_sandbox_stops_consuming_conversions(monkeypatch):
    """The worker's start-up hook: with a sandbox that cannot be set up the conversion queue
    is deselected (the worker consumes no conversion; jobs wait for a worker that can
    sandbox them); with the off switch, or a working sandbox, it stays."""
    from project.celery import _check_converter_sandbox, app

    class Instance:
        pass

    instance = Instance()
    instance.app = app  # type: ignore[attr-defined]
    queues = app.amqp.queues
    try:
        for env, consumed in ((None, True), ("off", True), ("broken", False)):
            queues.select([settings.CONVERSION_QUEUE])
            sandbox._probe_cache = None
            monkeypatch.delenv(sandbox.MODE_ENV, raising=False)
            monkeypatch.delenv(sandbox.UID_ENV, raising=False)
            if env == "off":
                monkeypatch.setenv(sandbox.MODE_ENV, "off")
            elif env == "broken":
                monkeypatch.setenv(sandbox.UID_ENV, "0")
            _check_converter_sandbox(sender="worker@test", instance=instance)
            assert (settings.CONVERSION_QUEUE in queues.consume_from) is consumed, env
    finally:
        queues._consume_from = None
        sandbox._probe_cache = None
