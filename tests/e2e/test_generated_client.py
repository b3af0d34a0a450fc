"""A client generated from the served OpenAPI document works (issue 27 point 3): the schema of a
live web process, turned into a Python package by openapi-python-client (offline, no post hooks),
imported from a temporary directory and driven against real web / worker / sweeper / beat
processes. Every operation is called through the generated functions and every answer is read
through the generated models: a schema the generator maps wrongly (``/result`` decoded as text
was a TypeError) fails here. docs/API_CONTRACT.md, "Generated clients"."""

from __future__ import annotations

import hashlib
import importlib
import io
import json
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import requests

from conversion_jobs.api.auth import token_mint
from tests import testdocs
from tests.e2e import harness

pytestmark = [pytest.mark.e2e, pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

SCOPES = ["jobs:read", "jobs:submit", "jobs:cancel", "jobs:admin"]
#: Each page sleeps this long in the converter (a test fault): the job is still running when
#: it is cancelled.
SLOW = {"kind": "slow", "seconds": 0.6}
PACKAGE = "quire_generated_client"
#: Any network access of the generator fails (it must only read the schema file).
OFFLINE = {"HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9", "NO_PROXY": ""}


@pytest.fixture
def web(start: Callable[..., harness.Proc]) -> str:
    """The Procfile's web, worker, sweeper and beat on this test's database and vhost."""
    proc = start("web")
    start("worker")
    start("sweeper")
    start("beat")
    return f"http://127.0.0.1:{proc.port}"


@pytest.fixture
def generated(web: str, tmp_path: Path) -> Iterator[ModuleType]:
    """The package generated from the live ``/api/v1/schema``, imported."""
    schema = requests.get(f"{web}/api/v1/schema?format=json", timeout=30)
    assert schema.status_code == 200, schema.text
    (tmp_path / "schema.json").write_bytes(schema.content)
    (tmp_path / "generator.yaml").write_text("post_hooks: []\n")
    out = tmp_path / "generated"
    out.mkdir()
    command = [
        str(Path(sys.executable).with_name("openapi-python-client")),
        "generate",
        "--path",
        str(tmp_path / "schema.json"),
        "--output-path",
        str(out / PACKAGE),
        "--meta",
        "none",
        "--config",
        str(tmp_path / "generator.yaml"),
    ]
    env = {**harness.process_env(), **OFFLINE}
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    # A skipped endpoint or response is only a warning to the generator: none is allowed.
    assert "Warning" not in output, output
    sys.path.insert(0, str(out))
    try:
        yield importlib.import_module(PACKAGE)
    finally:
        sys.path.remove(str(out))
        for name in [n for n in sys.modules if n == PACKAGE or n.startswith(PACKAGE + ".")]:
            del sys.modules[name]


def _api(package: ModuleType, name: str) -> Any:
    return importlib.import_module(f"{package.__name__}.{name}")


def _client(package: ModuleType, web: str, tenant: str) -> Any:
    bearer = token_mint(tenant=tenant, subject="e2e", scopes=SCOPES, ttl_s=600)
    return package.AuthenticatedClient(
        base_url=web, token=bearer, timeout=30.0, raise_on_unexpected_status=True
    )


def _submit(
    package: ModuleType,
    client: Any,
    *,
    content: bytes,
    name: str,
    media_type: str,
    output: str,
    options: dict[str, Any] | None = None,
    key: str | None = None,
) -> Any:
    models, types = _api(package, "models"), _api(package, "types")
    body = models.Submit(
        file=types.File(payload=io.BytesIO(content), file_name=name, mime_type=media_type),
        output=models.OutputEnum(output),
        options=json.dumps(options) if options is not None else types.UNSET,
    )
    submit = _api(package, "api.jobs.jobs_submit")
    return submit.sync_detailed(client=client, body=body, idempotency_key=key or types.UNSET)


def _until(package: ModuleType, client: Any, job_id: Any, *states: str, timeout: float = 40) -> Any:
    """The job read with ``?wait`` long-polls until it is in one of ``states``."""
    get = _api(package, "api.jobs.jobs_get")
    deadline = time.monotonic() + timeout
    while True:
        job = get.sync(client=client, job_id=job_id, wait=2)
        assert isinstance(job, _api(package, "models").Job), job
        if job.state in states:
            return job
        assert time.monotonic() < deadline, f"{job_id} still {job.state}"


def _download(response: Any, *, sha256: str) -> bytes:
    """A generated download's bytes, checked against the ETag and the recorded digest."""
    assert response.status_code == 200, response.content[:500]
    body = response.parsed.payload.read()
    assert isinstance(body, bytes)
    assert hashlib.sha256(body).hexdigest() == sha256
    assert response.headers["ETag"] == f'"{sha256}"'
    return body


def test_generated_client__submits_polls_lists_downloads_and_reads_problems(generated, web):
    package, models = generated, _api(generated, "models")
    client = _client(package, web, tenant=f"gen-{uuid.uuid4().hex[:8]}")
    salt = uuid.uuid4().hex
    pdf = testdocs.pdf_bytes(pages=2, text_of=lambda n: f"Page {n} {salt}")
    png = io.BytesIO()
    testdocs.image(width=400, height=300, text="quire").save(png, format="PNG")

    # Submit (multipart, Idempotency-Key): 202, then the same key and body replays it (200).
    first = _submit(
        package, client, content=pdf, name="a.pdf", media_type="application/pdf",
        output="text", key=f"k-{salt}",
    )  # fmt: skip
    assert first.status_code == 202, first.content
    text_job = first.parsed
    assert isinstance(text_job, models.Job) and text_job.state == models.StateEnum.QUEUED
    again = _submit(
        package, client, content=pdf, name="a.pdf", media_type="application/pdf",
        output="text", key=f"k-{salt}",
    )  # fmt: skip
    assert again.status_code == 200 and again.headers["Idempotent-Replayed"] == "true"
    assert again.parsed.id == text_job.id
    second = _submit(
        package, client, content=png.getvalue(), name="b.png", media_type="image/png",
        output="pdf",
    )  # fmt: skip
    assert second.status_code == 202, second.content
    pdf_job = second.parsed

    text_job = _until(package, client, text_job.id, "succeeded")
    pdf_job = _until(package, client, pdf_job.id, "succeeded")

    # List: one job a page, following next_cursor, newest first.
    jobs_list = _api(package, "api.jobs.jobs_list")
    page = jobs_list.sync(client=client, limit=1)
    assert isinstance(page, models.JobPage) and len(page.jobs) == 1
    assert isinstance(page.next_cursor, str)
    listed = [page.jobs[0].id]
    while page.next_cursor is not None:
        page = jobs_list.sync(client=client, limit=1, cursor=page.next_cursor)
        listed += [job.id for job in page.jobs]
    assert listed == [pdf_job.id, text_job.id]
    queued = jobs_list.sync(client=client, state=models.JobsListState.QUEUED)
    assert queued.jobs == [] and queued.next_cursor is None

    # The results: bytes, whatever their media type (text/plain first made this a TypeError).
    result = _api(package, "api.jobs.jobs_result")
    text = _download(
        result.sync_detailed(client=client, job_id=text_job.id), sha256=text_job.result.sha256
    )
    assert len(text) == text_job.result.size and f"Page 2 {salt}".encode() in text
    answer = result.sync_detailed(client=client, job_id=pdf_job.id)
    assert answer.headers["Content-Type"] == "application/pdf"
    assert _download(answer, sha256=pdf_job.result.sha256).startswith(b"%PDF-")
    unchanged = result.sync_detailed(
        client=client.with_headers({"If-None-Match": f'"{pdf_job.result.sha256}"'}),
        job_id=pdf_job.id,
    )
    assert unchanged.status_code == 304 and unchanged.parsed is None

    # Pages: the list, then one page's bytes.
    pages = _api(package, "api.jobs.jobs_pages").sync(client=client, job_id=text_job.id)
    assert isinstance(pages, models.PageList)
    assert [(p.page, p.state) for p in pages.pages] == [(1, "done"), (2, "done")]
    one_page = _api(package, "api.jobs.jobs_page").sync_detailed(
        client=client, job_id=text_job.id, page=2
    )
    assert one_page.headers["Content-Type"] == "text/plain; charset=utf-8"
    assert f"Page 2 {salt}" in _download(one_page, sha256=pages.pages[1].sha256).decode()

    # Events and capabilities parse into their models.
    events = _api(package, "api.jobs.jobs_events").sync(client=client, job_id=text_job.id)
    assert isinstance(events, models.EventList) and events.events
    capabilities = _api(package, "api.capabilities.capabilities").sync(
        client=package.Client(base_url=web)
    )
    assert isinstance(capabilities, models.CapabilitiesResponse200)
    assert "pdf" in capabilities["outputs"]

    # Errors are problems: a 404 and a 409 parse into the Problem model with their code.
    missing = _api(package, "api.jobs.jobs_get").sync_detailed(client=client, job_id=uuid.uuid4())
    assert missing.status_code == 404 and isinstance(missing.parsed, models.Problem)
    assert (missing.parsed.code, missing.parsed.status) == ("not_found", 404)
    no_page = _api(package, "api.jobs.jobs_page").sync_detailed(
        client=client, job_id=text_job.id, page=9
    )
    assert no_page.status_code == 404 and no_page.parsed.code == "not_found"


def test_generated_client__cancels_a_running_job_and_retries_it(generated, web):
    package, models = generated, _api(generated, "models")
    client = _client(package, web, tenant=f"gen-{uuid.uuid4().hex[:8]}")
    submitted = _submit(
        package, client, content=testdocs.pdf_bytes(pages=8), name="slow.pdf",
        media_type="application/pdf", output="text", options={"_test_fault": SLOW},
    )  # fmt: skip
    assert submitted.status_code == 202, submitted.content
    job = _until(package, client, submitted.parsed.id, "running")

    cancel = _api(package, "api.jobs.jobs_cancel").sync_detailed(client=client, job_id=job.id)
    # Running: accepted (202, cancelling) unless the worker already stopped it (200, cancelled).
    assert (cancel.status_code, cancel.parsed.state) in {(202, "cancelling"), (200, "cancelled")}
    job = _until(package, client, job.id, "cancelled")
    assert job.result is None

    no_result = _api(package, "api.jobs.jobs_result").sync_detailed(client=client, job_id=job.id)
    assert no_result.status_code == 409 and isinstance(no_result.parsed, models.Problem)
    assert no_result.parsed.code == "no_result"
    again = _api(package, "api.jobs.jobs_cancel").sync_detailed(client=client, job_id=job.id)
    assert again.status_code == 200 and again.parsed.state == "cancelled"

    retried = _api(package, "api.jobs.jobs_retry").sync_detailed(client=client, job_id=job.id)
    assert retried.status_code == 202 and isinstance(retried.parsed, models.Job)
    assert retried.parsed.generation == job.generation + 1
