"""One-page jobs (ADR 0017, session 4): the page count is written by the publishing statement
instead of a fenced UPDATE of its own, and is still recorded when the job fails."""

from __future__ import annotations

from pathlib import Path

import pytest

from conversion_jobs.models import ConversionJob, ExecutionAuditEvent
from tests import testdocs
from tests.integration.execution.jobkit import execute, submit, unique_text

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("fast_quire")]


def _pdf(tmp_path: Path, name: str, pages: int) -> Path:
    return testdocs.make_pdf(tmp_path / f"{name}.pdf", pages=pages, text_of=unique_text(name))


def test_one_page__published_with_its_page_count(tmp_path: Path) -> None:
    job = submit(_pdf(tmp_path, "ok", 1), output="text")
    assert job.source_page_count is None
    assert execute(job) == "succeeded"
    done = ConversionJob.objects.get(id=job.id)
    assert (done.source_page_count, done.pages_done, done.state_version) == (1, 1, 3)
    events = ExecutionAuditEvent.objects.filter(job_id=job.id).values_list("event_type", flat=True)
    assert list(events.order_by("seq")) == ["accepted", "claimed", "published"]


def test_one_page_of_many__published_with_the_document_page_count(tmp_path: Path) -> None:
    job = submit(_pdf(tmp_path, "range", 3), output="text", options={"pages": [2, 2]})
    assert execute(job) == "succeeded"
    done = ConversionJob.objects.get(id=job.id)
    assert (done.source_page_count, done.pages_done) == (3, 1)


def test_one_page__failed_page_still_records_the_page_count(tmp_path: Path) -> None:
    job = submit(_pdf(tmp_path, "bad", 1), output="text", fault={"kind": "fail", "page": 1})
    assert execute(job) == "failed"
    failed = ConversionJob.objects.get(id=job.id)
    assert (failed.state, failed.source_page_count, failed.result_key) == ("failed", 1, None)


def test_page_range_beyond_the_document__fails_with_the_page_count(tmp_path: Path) -> None:
    job = submit(_pdf(tmp_path, "beyond", 2), output="text", options={"pages": [5, 6]})
    assert execute(job) == "failed"
    failed = ConversionJob.objects.get(id=job.id)
    assert (failed.error_code, failed.source_page_count) == ("invalid_input", 2)
