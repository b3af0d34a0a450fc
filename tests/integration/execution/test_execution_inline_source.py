"""An inline source (ADR 0017 session 10) through the real worker path: the claim reads its
bytes, the converter child converts them, the retry of a later attempt reads them again, and
the store never holds the source."""

from __future__ import annotations

import pytest

from conversion_jobs import storage
from conversion_jobs.models import ConversionJob, InlineSource
from conversion_jobs.services import execution, recovery, transitions
from tests import testdocs
from tests.integration.execution.jobkit import (
    downloaded_result,
    execute,
    submit,
    unique_text,
    work_dir_entries,
)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("fast_quire")]


def test_execute__inline_pdf_text_round_trips(tmp_path, api, no_broker_publish):
    text_of = unique_text("Inline source")
    source = testdocs.make_pdf(tmp_path / "doc.pdf", pages=3, text_of=text_of)
    job = submit(source, output="text", inline=True)
    assert storage.is_inline_source(job.source_key)
    assert InlineSource.objects.filter(job=job).exists()

    assert execute(job) == "succeeded"

    job.refresh_from_db()
    assert (job.state, job.pages_done) == ("succeeded", 3)
    assert downloaded_result(api, job).decode().split("\f") == [text_of(n) for n in range(1, 4)]
    assert list(storage.list_objects("sources")) == []
    assert work_dir_entries() == []


def test_execute__inline_source_survives_a_retry(tmp_path, api, no_broker_publish):
    """A retryable failure, then the redispatched generation claims the bytes again."""
    text_of = unique_text("Inline retry")
    source = testdocs.make_pdf(tmp_path / "doc.pdf", pages=2, text_of=text_of)
    job = submit(source, output="text", inline=True)
    claim = transitions.claim(job_id=job.id, generation=1, worker="w")
    assert claim is not None and claim.source == source.read_bytes()
    assert execution.conversion_job_retry_later(lease=claim.lease, code="storage_error")
    ConversionJob.objects.filter(id=job.id).update(next_attempt_at="2000-01-01T00:00:00Z")
    assert recovery.conversion_jobs_requeue_if_retry_due() == 1
    job.refresh_from_db()
    assert (job.state, job.generation) == ("queued", 2)

    assert execute(job, generation=2) == "succeeded"
    assert downloaded_result(api, job).decode().split("\f") == [text_of(n) for n in range(1, 3)]


def test_execute__inline_row_missing_fails_with_source_missing(tmp_path, no_broker_publish):
    job = submit(testdocs.make_pdf(tmp_path / "doc.pdf", pages=1), output="text", inline=True)
    InlineSource.objects.filter(job=job).delete()
    assert execute(job) == "failed"
    job.refresh_from_db()
    assert (job.state, job.error_code) == ("failed", "source_missing")


def test_execute__operator_retry_of_a_failed_inline_job_reads_its_bytes(
    tmp_path, api, no_broker_publish
):
    text_of = unique_text("Inline operator retry")
    source = testdocs.make_pdf(tmp_path / "doc.pdf", pages=1, text_of=text_of)
    job = submit(source, output="text", inline=True)
    claim = transitions.claim(job_id=job.id, generation=1, worker="w")
    assert claim is not None
    assert execution.conversion_job_fail(lease=claim.lease, code="invalid_input", detail="x")
    retried = recovery.conversion_job_retry_failed(job_id=job.id, tenant=None, actor="op")
    assert (retried.state, retried.generation) == ("queued", 2)
    assert execute(retried, generation=2) == "succeeded"
    assert downloaded_result(api, job).decode() == text_of(1)
