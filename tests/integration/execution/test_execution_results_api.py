"""Issue 4: the results API over jobs the real worker path converted."""

from __future__ import annotations

import hashlib
import uuid

import pytest

from conversion_jobs.services import execution
from tests import testdocs
from tests.integration.execution.jobkit import execute, submit, unique_text

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("fast_quire")]


def _body(response) -> bytes:
    return b"".join(response.streaming_content)


def test_result__headers_match_the_artifact(tmp_path, api, no_broker_publish):
    source = testdocs.make_pdf(tmp_path / "doc.pdf", pages=2, text_of=unique_text())
    text_job, png_job = (
        submit(source, output="text"),
        submit(source, output="png", options={"dpi": 72}),
    )
    assert execute(text_job) == execute(png_job) == "succeeded"
    client = api()

    for job, media_type, ext in (
        (text_job, "text/plain; charset=utf-8", "txt"),
        (png_job, "application/zip", "zip"),
    ):
        response = client.get(f"/api/v1/jobs/{job.id}/result")
        body = _body(response)
        job.refresh_from_db()
        assert response.status_code == 200
        assert response["Content-Type"] == media_type
        assert response["Content-Disposition"] == f'attachment; filename="{job.id}.{ext}"'
        assert (
            response["ETag"] == f'"{hashlib.sha256(body).hexdigest()}"' == f'"{job.result_sha256}"'
        )
        assert len(body) == job.result_size
        cached = client.get(f"/api/v1/jobs/{job.id}/result", HTTP_IF_NONE_MATCH=response["ETag"])
        assert (cached.status_code, cached["ETag"]) == (304, response["ETag"])

    listing = client.get(f"/api/v1/jobs/{png_job.id}/pages").json()["pages"]
    assert [(p["page"], p["state"]) for p in listing] == [(1, "done"), (2, "done")]
    page = client.get(f"/api/v1/jobs/{png_job.id}/pages/2")
    body = _body(page)
    assert page.status_code == 200
    assert page["Content-Type"] == "image/png"
    assert page["Content-Disposition"] == f'attachment; filename="{png_job.id}-page-00002.png"'
    assert page["ETag"] == f'"{hashlib.sha256(body).hexdigest()}"' == f'"{listing[1]["sha256"]}"'
    assert body.startswith(b"\x89PNG")
    assert client.get(f"/api/v1/jobs/{png_job.id}/pages/3").status_code == 404


def test_result__not_ready_before_the_job_is_terminal(tmp_path, api, no_broker_publish):
    queued = submit(
        testdocs.make_pdf(tmp_path / "a.pdf", pages=1, text_of=unique_text()), output="text"
    )
    running = submit(
        testdocs.make_pdf(tmp_path / "b.pdf", pages=1, text_of=unique_text()), output="text"
    )
    assert execution.conversion_job_claim(job_id=running.id, generation=1, worker="test")
    client = api()

    for job in (queued, running):
        for path in ("result", "pages/1"):
            response = client.get(f"/api/v1/jobs/{job.id}/{path}")
            assert response.status_code == 409, path
            assert response["Content-Type"] == "application/problem+json"
            assert response.json()["code"] == "not_ready"


def test_result__other_tenant_is_not_found(tmp_path, api, no_broker_publish):
    job = submit(
        testdocs.make_pdf(tmp_path / "a.pdf", pages=1, text_of=unique_text()), output="text"
    )
    assert execute(job) == "succeeded"
    owner, stranger = api(), api(tenant="tenant-b")

    for path in ("result", "pages", "pages/1"):
        assert owner.get(f"/api/v1/jobs/{job.id}/{path}").status_code == 200
        theirs = stranger.get(f"/api/v1/jobs/{job.id}/{path}")
        missing = stranger.get(f"/api/v1/jobs/{uuid.uuid4()}/{path}")
        assert theirs.status_code == missing.status_code == 404, path
        assert theirs.content == missing.content


def _content(response) -> bytes:
    return response.content if hasattr(response, "content") else _body(response)


def test_text_pages__live_in_their_checkpoint_rows_and_are_served_as_before(
    tmp_path, api, no_broker_publish, settings
):
    """Issue 12: a small text page has no file of its own (no fsync per page); its bytes commit
    with its checkpoint row, and the result and ``/pages/{n}`` serve it unchanged."""
    from conversion_jobs import storage
    from conversion_jobs.models import PageCheckpoint

    text_of = unique_text()
    source = testdocs.make_pdf(tmp_path / "doc.pdf", pages=3, text_of=text_of)
    job = submit(source, output="text")
    assert execute(job) == "succeeded"

    rows = list(PageCheckpoint.objects.filter(job_id=job.id).order_by("page_number"))
    assert [r.page_number for r in rows] == [1, 2, 3]
    assert all((r.artifact_key or "").startswith("inline:") and r.content for r in rows)
    assert list(storage.list_objects(f"pages/{job.id}")) == []  # no page object was stored
    for row in rows:
        assert hashlib.sha256(bytes(row.content)).hexdigest() == row.artifact_sha256
        assert len(row.content) == row.artifact_size

    client = api()
    result = _body(client.get(f"/api/v1/jobs/{job.id}/result")).decode()
    assert result.split("\f") == [bytes(r.content).decode() for r in rows]
    assert all(text_of(n) in result for n in (1, 2, 3))
    page = client.get(f"/api/v1/jobs/{job.id}/pages/2")
    assert page.status_code == 200
    assert page["Content-Type"] == "text/plain; charset=utf-8"
    assert page["ETag"] == f'"{rows[1].artifact_sha256}"'
    assert _content(page) == bytes(rows[1].content)


def test_text_pages__above_the_inline_limit_are_files(tmp_path, api, no_broker_publish, settings):
    from conversion_jobs import storage
    from conversion_jobs.models import PageCheckpoint

    settings.QUIRE = {**settings.QUIRE, "INLINE_PAGE_MAX_BYTES": 0}
    source = testdocs.make_pdf(tmp_path / "doc.pdf", pages=2, text_of=unique_text())
    job = submit(source, output="text")
    assert execute(job) == "succeeded"
    rows = list(PageCheckpoint.objects.filter(job_id=job.id).order_by("page_number"))
    assert all(r.content is None and storage.exists(r.artifact_key) for r in rows)
    page = api().get(f"/api/v1/jobs/{job.id}/pages/1")
    assert _body(page) == storage.open_object(rows[0].artifact_key).read()


@pytest.mark.parametrize(
    "accept",
    [
        "application/octet-stream",
        "text/plain",
        # what openapi-generator sends: every media type the operation declares
        "application/octet-stream, text/plain, application/pdf, application/zip, "
        "application/problem+json",
    ],
)
def test_result__an_accept_naming_a_declared_type_gets_the_bytes(
    tmp_path, api, no_broker_publish, accept
):
    # Swagger UI and schema-generated clients send the declared download types in Accept
    # (docs/API_CONTRACT.md, "Generated clients"): a download is never refused with a 406.
    job = submit(
        testdocs.make_pdf(tmp_path / "a.pdf", pages=2, text_of=unique_text()), output="text"
    )
    client = api()
    early = client.get(f"/api/v1/jobs/{job.id}/result", HTTP_ACCEPT=accept)
    assert (early.status_code, early["Content-Type"]) == (409, "application/problem+json")
    assert early.json()["code"] == "not_ready"
    assert execute(job) == "succeeded"
    job.refresh_from_db()
    for path, sha256 in (
        ("result", job.result_sha256),
        ("pages/2", job.pages.get(page_number=2).artifact_sha256),
    ):
        response = client.get(f"/api/v1/jobs/{job.id}/{path}", HTTP_ACCEPT=accept)
        assert response.status_code == 200, path
        assert response["Content-Type"] == "text/plain; charset=utf-8"
        assert hashlib.sha256(response.getvalue()).hexdigest() == sha256
    missing = client.get(f"/api/v1/jobs/{job.id}/pages/3", HTTP_ACCEPT=accept)
    assert (missing.status_code, missing["Content-Type"]) == (404, "application/problem+json")
