"""A long job yields at a page boundary (docs/ARCHITECTURE.md §2b): past its slice, while
another tenant waits with no free slot, the attempt checkpoints and ends ``yielded``; the job is
queued again (generation + 1, not counted as an attempt) and resumes from its checkpoints, every
page converted once. Driven through ``conversion_job_execute`` with real converter children."""

from __future__ import annotations

from typing import Any

import pytest

from conversion_jobs.models import (
    ConversionAttempt,
    ConversionOutbox,
    ExecutionAuditEvent,
    PageCheckpoint,
)
from conversion_jobs.services import dispatch, fair
from tests import testdocs
from tests.integration.execution.jobkit import execute, submit, unique_text

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("fast_quire"),
    pytest.mark.fair_credits,
]

SLOW = {"kind": "slow", "seconds": 0.05}


@pytest.fixture
def one_slot(settings: Any) -> None:
    settings.QUIRE = {**settings.QUIRE, "FAIR_CAPACITY": 1, "FAIR_SLICE_S": 0.3}


def test_yield__a_long_job_gives_its_slot_to_a_waiting_tenant_and_resumes(
    tmp_path, one_slot, no_broker_publish
):
    text_of = unique_text()
    source = testdocs.make_pdf(tmp_path / "long.pdf", pages=40, text_of=text_of)
    long = submit(source, output="text", tenant="tenant-a", fault=SLOW)
    other_src = testdocs.make_pdf(tmp_path / "short.pdf", pages=1, text_of=unique_text())
    short = submit(other_src, output="text", tenant="tenant-b")
    # a's unit was sent first (the slot's one credit); b waits behind the running job
    assert {u for _, u in no_broker_publish} == {1}
    assert ConversionOutbox.objects.get(job=short).published_at is None

    assert execute(long) == "yielded"

    long.refresh_from_db()
    assert (long.state, long.generation, long.attempts) == ("queued", 2, 0)
    done_first = PageCheckpoint.objects.filter(job=long, state="done").count()
    assert 0 < done_first < 40
    attempt = ConversionAttempt.objects.get(job=long, generation=1)
    assert (attempt.outcome, attempt.pages_converted) == ("yielded", done_first)
    event = ExecutionAuditEvent.objects.get(job_id=long.id, event_type="yielded")
    assert event.details["attempt"] == 1 and event.details["cost"] == 40 - done_first
    # the freed slot went to b (its virtual time is behind a's), not back to a
    assert ConversionOutbox.objects.get(job=short).published_at is not None
    assert ConversionOutbox.objects.get(job=long, generation=2).published_at is None
    assert execute(short) == "succeeded"
    # b's attempt ended: a's next generation goes into the free slot, sent by the worker's relay
    # pass (standalone) or the next outbox sweep (production: a worker may not publish;
    # docs/ARCHITECTURE.md §2b)
    dispatch.outbox_rows_publish_unpublished()
    assert (str(long.id), 2) in no_broker_publish
    assert fair.pick(limit=5) == []
    # nobody waits now, so a's second attempt runs to the end without yielding
    assert execute(long, generation=2) == "succeeded"

    long.refresh_from_db()
    assert (long.state, long.pages_done, long.attempts) == ("succeeded", 40, 1)
    pages = PageCheckpoint.objects.filter(job=long)
    assert sorted(pages.values_list("page_number", flat=True)) == list(range(1, 41))
    by_generation = dict(
        ConversionAttempt.objects.filter(job=long).values_list("generation", "pages_converted")
    )
    # every page converted once: the second attempt converted exactly what the first had not
    assert by_generation == {1: done_first, 2: 40 - done_first}


def test_yield__no_yield_when_no_other_tenant_waits(tmp_path, one_slot, no_broker_publish):
    source = testdocs.make_pdf(tmp_path / "alone.pdf", pages=20, text_of=unique_text())
    job = submit(source, output="text", tenant="tenant-a", fault=SLOW)
    other = testdocs.make_pdf(tmp_path / "same.pdf", pages=1, text_of=unique_text())
    submit(other, output="text", tenant="tenant-a")  # the same tenant's work does not count

    assert execute(job) == "succeeded"
    assert not ExecutionAuditEvent.objects.filter(job_id=job.id, event_type="yielded").exists()


def test_yield__a_one_or_two_page_job_never_asks(
    tmp_path, one_slot, no_broker_publish, monkeypatch
):
    """Even on a slot whose clock is long past the slice, with another tenant waiting: a unit
    converts a page before it may yield, and finishes its last page (no query, no churn)."""
    import time

    from conversion_jobs.services import runner

    asked: list[str] = []
    real = fair.others_waiting
    monkeypatch.setattr(
        fair, "others_waiting", lambda *, tenant: asked.append(tenant) or real(tenant=tenant)
    )
    for pages in (1, 2):
        source = testdocs.make_pdf(tmp_path / f"p{pages}.pdf", pages=pages, text_of=unique_text())
        job = submit(source, output="text", tenant="tenant-a")
        other = testdocs.make_pdf(tmp_path / f"o{pages}.pdf", pages=1, text_of=unique_text())
        submit(other, output="text", tenant="tenant-b")
        runner._slot.tenant, runner._slot.since = "tenant-a", time.monotonic() - 3600
        runner._slot.ended = time.monotonic()
        assert execute(job) == "succeeded"
    assert asked == []
