"""PNG results are the ZIP of the job's page objects, streamed, never stored a second time
(ADR 0018, session-4 "zipres"): on both backends."""

from __future__ import annotations

import hashlib
import io
import zipfile
from datetime import timedelta

import pytest
from django.utils import timezone

from conversion_jobs import storage
from conversion_jobs.models import ConversionJob, PageCheckpoint
from conversion_jobs.services import retention
from tests import testdocs
from tests.integration.execution.jobkit import (
    execute,
    object_bytes,
    run_until_pages_then_lose_lease,
    submit,
    unique_text,
    work_dir_entries,
)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("fast_quire")]


def _download(client, job) -> bytes:
    response = client.get(f"/api/v1/jobs/{job.id}/result")
    assert response.status_code == 200
    assert response["Content-Type"] == "application/zip"
    assert response["Content-Length"] == str(job.result_size)
    assert response["ETag"] == f'"{job.result_sha256}"'
    assert response["Content-Disposition"] == f'attachment; filename="{job.id}.zip"'
    return b"".join(response.streaming_content)


def _pages(job) -> list[bytes]:
    checkpoints = PageCheckpoint.objects.filter(job=job, state="done").order_by("page_number")
    return [object_bytes(c.artifact_key) for c in checkpoints]


def _assert_zip_of_pages(body: bytes, job, pages: int) -> None:
    assert (hashlib.sha256(body).hexdigest(), len(body)) == (job.result_sha256, job.result_size)
    archive = zipfile.ZipFile(io.BytesIO(body))
    assert archive.testzip() is None
    assert archive.namelist() == [f"page-{n:04d}.png" for n in range(1, pages + 1)]
    contents = [archive.read(name) for name in archive.namelist()]
    assert contents == _pages(job)
    assert all(c.startswith(b"\x89PNG") for c in contents)


def test_png_result__is_the_zip_of_the_page_objects_and_stores_no_object(
    backend, tmp_path, api, no_broker_publish
):
    source = testdocs.make_pdf(tmp_path / "d.pdf", pages=3, text_of=unique_text())
    job = submit(source, output="png", options={"dpi": 36})
    assert execute(job) == "succeeded"
    job.refresh_from_db()
    client = api()

    assert job.result_key == f"zip:results/{job.id}/result.g1.zip"
    assert job.result_media_type == "application/zip"
    assert not list(storage.list_objects(f"results/{job.id}"))
    body = _download(client, job)
    _assert_zip_of_pages(body, job, pages=3)
    assert _download(client, job) == body  # the same bytes every time
    cached = client.get(
        f"/api/v1/jobs/{job.id}/result", HTTP_IF_NONE_MATCH=f'"{job.result_sha256}"'
    )
    assert (cached.status_code, cached["ETag"]) == (304, f'"{job.result_sha256}"')


def test_png_result__of_a_resumed_job_mixes_both_attempts_pages(
    backend, tmp_path, api, no_broker_publish
):
    pages, stolen_after = 6, 2
    source = testdocs.make_pdf(tmp_path / "six.pdf", pages=pages, text_of=unique_text())
    job = submit(source, output="png", options={"dpi": 36}, fault={"kind": "slow", "seconds": 0.2})
    run_until_pages_then_lose_lease(job, stolen_after)

    assert execute(job) == "succeeded"

    generations = set(PageCheckpoint.objects.filter(job=job).values_list("generation", flat=True))
    assert generations == {1, 2}
    job.refresh_from_db()
    assert job.result_key == f"zip:results/{job.id}/result.g2.zip"
    _assert_zip_of_pages(_download(api(), job), job, pages=pages)
    assert work_dir_entries() == []


def test_png_result__a_missing_page_object_fails_the_download_cleanly(
    backend, tmp_path, api, no_broker_publish
):
    source = testdocs.make_pdf(tmp_path / "d.pdf", pages=2, text_of=unique_text())
    job = submit(source, output="png", options={"dpi": 36})
    assert execute(job) == "succeeded"
    storage.delete(PageCheckpoint.objects.get(job=job, page_number=2).artifact_key)

    response = api().get(f"/api/v1/jobs/{job.id}/result")

    assert response.status_code == 500
    assert response["Content-Type"].startswith("application/problem+json")
    assert response.json()["code"] == "result_incomplete"


def test_png_result__retention_deletes_the_pages_and_leaves_no_result_object(
    backend, tmp_path, api, settings, no_broker_publish
):
    source = testdocs.make_pdf(tmp_path / "d.pdf", pages=2, text_of=unique_text())
    job = submit(source, output="png", options={"dpi": 36})
    assert execute(job) == "succeeded"
    settings.QUIRE = {**settings.QUIRE, "RESULT_RETENTION_S": 60, "ORPHAN_GRACE_S": 0}
    ConversionJob.objects.filter(id=job.id).update(finished_at=timezone.now() - timedelta(hours=1))

    applied = retention.retention_apply()

    assert applied.jobs_expired == 1 and applied.jobs_purged == 1
    assert not list(storage.list_objects(f"pages/{job.id}"))
    assert not list(storage.list_objects(f"results/{job.id}"))
    response = api().get(f"/api/v1/jobs/{job.id}/result")
    assert (response.status_code, response.json()["code"]) == (409, "no_result")
