"""Inline text results (ADR 0017, "Session 4: inline text results"): a text job whose every done
page is inline in its checkpoint row publishes no result file; its result key says "the done
inline pages joined in page order", and the download serves exactly the bytes the file would
have held (``assemble_result``), under the recorded sha256 and size."""

from __future__ import annotations

import hashlib
from datetime import timedelta
from pathlib import Path

import pytest
from django.utils import timezone

from conversion_jobs import converters, storage
from conversion_jobs.models import ConversionJob, PageCheckpoint
from conversion_jobs.services import retention
from conversion_jobs.services.artifacts import artifacts_remove_orphans
from tests import testdocs
from tests.integration.execution.jobkit import execute, result_files, submit, unique_text

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("fast_quire")]


def _text_job(tmp_path: Path, pages: int, text_of) -> ConversionJob:
    return submit(
        testdocs.make_pdf(tmp_path / "doc.pdf", pages=pages, text_of=text_of), output="text"
    )


def _download(client, job_id) -> tuple[int, bytes, dict[str, str]]:
    response = client.get(f"/api/v1/jobs/{job_id}/result")
    body = b"".join(response.streaming_content) if response.streaming else bytes(response.content)
    return response.status_code, body, response


def _assembled(job: ConversionJob, tmp_path: Path) -> bytes:
    """What the result file would have held: ``assemble_result`` over the job's done pages."""
    rows = PageCheckpoint.objects.filter(job_id=job.id, state="done")
    dest = tmp_path / f"{job.id}.assembled"
    converters.assemble_result(
        output="text",
        pages=[(r.page_number, bytes(r.content)) for r in rows],
        dest=dest,
        prepared_document=None,
    )
    return dest.read_bytes()


@pytest.mark.parametrize("pages", [1, 4])
def test_text_job__publishes_an_inline_result_served_as_the_assembled_bytes(
    tmp_path, api, no_broker_publish, pages
):
    text_of = unique_text("inline é ü")  # non-ASCII: the bytes are UTF-8 as assembled
    job = _text_job(tmp_path, pages, text_of)
    assert execute(job) == "succeeded"

    job.refresh_from_db()
    assert job.result_key == f"inline:results/{job.id}/result.g1.txt"
    assert result_files(job.id) == []  # no result object was written
    assert list(storage.list_objects(f"pages/{job.id}")) == []
    expected = _assembled(job, tmp_path)
    assert all(text_of(n) in expected.decode() for n in range(1, pages + 1))
    assert expected.count(b"\f") == pages - 1
    assert (hashlib.sha256(expected).hexdigest(), len(expected)) == (
        job.result_sha256,
        job.result_size,
    )

    client = api()
    status, body, response = _download(client, job.id)
    assert (status, body) == (200, expected)
    assert response["Content-Type"] == "text/plain; charset=utf-8"
    assert response["Content-Disposition"] == f'attachment; filename="{job.id}.txt"'
    assert response["ETag"] == f'"{job.result_sha256}"'
    cached = client.get(f"/api/v1/jobs/{job.id}/result", HTTP_IF_NONE_MATCH=response["ETag"])
    assert (cached.status_code, cached["ETag"]) == (304, response["ETag"])
    other = api(tenant="tenant-b").get(f"/api/v1/jobs/{job.id}/result")
    assert other.status_code == 404


def test_text_job__one_page_above_the_inline_limit_falls_back_to_a_result_file(
    tmp_path, api, no_broker_publish, settings
):
    short = unique_text()

    def text_of(n: int) -> str:
        return short(n) + (" and a much longer line of words on it" if n == 2 else "")

    settings.QUIRE = {**settings.QUIRE, "INLINE_PAGE_MAX_BYTES": len(short(2)) + 8}
    job = _text_job(tmp_path, 3, text_of)
    assert execute(job) == "succeeded"

    job.refresh_from_db()
    rows = {r.page_number: r for r in PageCheckpoint.objects.filter(job_id=job.id)}
    assert [n for n, r in sorted(rows.items()) if r.content is None] == [2]
    assert job.result_key == f"results/{job.id}/result.g1.txt"
    assert result_files(job.id) == [job.result_key]
    stored = storage.open_object(job.result_key).read()
    assert hashlib.sha256(stored).hexdigest() == job.result_sha256
    assert stored.decode().split("\f")[1].startswith(short(2))
    status, body, _response = _download(api(), job.id)
    assert (status, body) == (200, stored)


def test_inline_result__retention_expires_and_purges_it_cleanly(
    tmp_path, api, no_broker_publish, settings
):
    settings.QUIRE = {**settings.QUIRE, "RESULT_RETENTION_S": 3600, "ORPHAN_GRACE_S": 0}
    job = _text_job(tmp_path, 2, unique_text())
    assert execute(job) == "succeeded"
    assert artifacts_remove_orphans() == 0  # the inline key names no object; nothing to sweep
    ConversionJob.objects.filter(id=job.id).update(finished_at=timezone.now() - timedelta(hours=2))

    result = retention.retention_apply()

    assert (result.jobs_expired, result.jobs_purged) == (1, 1)
    job.refresh_from_db()
    assert job.expired_at is not None and job.purged_at is not None
    assert not PageCheckpoint.objects.filter(job_id=job.id).exists()
    assert result_files(job.id) == []
    status, _body, response = _download(api(), job.id)
    assert (status, response.json()["code"]) == (409, "no_result")


def test_inline_result__rows_gone_under_a_live_job_read_as_no_result(
    tmp_path, api, no_broker_publish
):
    """The bytes served always match the recorded sha256: if the rows no longer make up the
    result (expired between reading the job and reading its pages), nothing is served."""
    job = _text_job(tmp_path, 2, unique_text())
    assert execute(job) == "succeeded"
    PageCheckpoint.objects.filter(job_id=job.id, page_number=2).delete()

    status, _body, response = _download(api(), job.id)
    assert (status, response.json()["code"]) == (409, "no_result")


def test_text_job__inline_pages_above_the_result_limit_are_stored_as_a_file(
    tmp_path, api, no_broker_publish, settings
):
    """Every page is inline, but together they exceed QUIRE_INLINE_RESULT_MAX_BYTES: the result
    is a stored file (a download never holds more than the limit in the web's memory)."""
    settings.QUIRE = {**settings.QUIRE, "INLINE_RESULT_MAX_BYTES": 16}
    job = _text_job(tmp_path, 3, unique_text())
    assert execute(job) == "succeeded"

    job.refresh_from_db()
    rows = PageCheckpoint.objects.filter(job_id=job.id)
    assert all(r.content is not None for r in rows)  # the pages themselves stay inline
    assert job.result_key == f"results/{job.id}/result.g1.txt"
    assert result_files(job.id) == [job.result_key]
    stored = storage.open_object(job.result_key).read()
    assert hashlib.sha256(stored).hexdigest() == job.result_sha256
    assert len(stored) == job.result_size > 16
