"""A page range yields at a page boundary (ADR 0021, "A range yields"): past its slice, while
another tenant's unit waits with no free slot, the range checkpoints and goes back to
``queued`` in its next range generation; its job stays running, the freed slot goes to the
waiting tenant, and the range resumes from its checkpoints: every page converted once. Driven
through the real range runner with real converter children (both profiles)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from conversion_jobs.models import (
    ConversionJob,
    ConversionOutbox,
    ExecutionAuditEvent,
    JobRange,
    PageCheckpoint,
)
from conversion_jobs.services import dispatch, fair
from tests import testdocs
from tests.integration.execution.jobkit import execute, submit, unique_text
from tests.integration.fanout.rangekit import ranges_of, refused, run_range

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.fair_credits,
    pytest.mark.usefixtures("fast_quire", "no_broker_publish"),
]

SLOW = {"kind": "slow", "seconds": 0.05}


@pytest.fixture
def one_slot_ranges(settings: Any) -> None:
    """One slot, a 0.3 s slice, ranges of 10 pages (a 30-page document has three)."""
    settings.QUIRE = {
        **settings.QUIRE,
        "FAIR_CAPACITY": 1,
        "FAIR_SLICE_S": 0.3,
        "FANOUT": True,
        "FANOUT_MIN_PAGES": 4,
        "FANOUT_RANGE_MIN_PAGES": 10,
        "FANOUT_RANGE_MAX_PAGES": 10,
        "FANOUT_SLOTS": 1,
    }


def _fanned_out(tmp_path: Path, *, tenant: str) -> ConversionJob:
    source = testdocs.make_pdf(tmp_path / "long.pdf", pages=30, text_of=unique_text("yield"))
    job = submit(source, output="text", tenant=tenant, fault=SLOW)
    assert execute(job) == "fanned_out"
    return ConversionJob.objects.get(id=job.id)


def _other_waits(tmp_path: Path) -> ConversionJob:
    source = testdocs.make_pdf(tmp_path / "short.pdf", pages=1, text_of=unique_text("b"))
    other = submit(source, output="text", tenant="tenant-b")
    assert ConversionOutbox.objects.get(job=other).published_at is None  # no free slot
    return other


def test_range_yield__the_slot_goes_to_the_waiting_tenant_and_the_range_resumes(
    tmp_path: Path, one_slot_ranges: None, no_broker_publish: list[Any]
) -> None:
    job = _fanned_out(tmp_path, tenant="tenant-a")
    first = ranges_of(job.id)[0]
    fair.pick(limit=1)  # the first range's unit takes the one slot
    other = _other_waits(tmp_path)

    assert run_range(job, first) == "yielded"

    row = JobRange.objects.get(id=first.id)
    done = PageCheckpoint.objects.filter(job=job, state="done", page_number__range=(1, 10)).count()
    assert 0 < done < 10
    assert (row.state, row.generation, row.attempts, row.lease_token) == ("queued", 2, 0, None)
    job.refresh_from_db()
    assert (job.state, job.generation) == ("running", 1)  # the job and its other ranges go on
    event = ExecutionAuditEvent.objects.get(job_id=job.id, event_type="range_yielded")
    assert event.details == {"first_page": 1, "cost": 10 - done}
    resumed = ConversionOutbox.objects.get(job=job, range_first=1, range_generation=2)
    assert (resumed.cost, resumed.published_at) == (10 - done, None)
    # the freed slot went to b (its virtual time is behind a's), not back to a
    assert ConversionOutbox.objects.get(job=other).published_at is not None
    assert execute(other) == "succeeded"

    # a's ranges, the yielded one in its second generation, run to the end: nobody waits now
    dispatch.outbox_rows_publish_unpublished()
    outcomes = [run_range(job, r) for r in ranges_of(job.id)]
    assert outcomes[-1] == "succeeded" and set(outcomes[:-1]) == {"range_done"}
    job.refresh_from_db()
    assert (job.state, job.pages_done) == ("succeeded", 30)
    pages = PageCheckpoint.objects.filter(job=job, state="done")
    assert sorted(pages.values_list("page_number", flat=True)) == list(range(1, 31))
    # every page converted once: the pages done before the yield kept their first write
    assert set(pages.filter(page_number__lte=done).values_list("attempts", flat=True)) == {1}


def test_range_yield__consecutive_ranges_of_one_tenant_share_the_slots_clock(
    tmp_path: Path, one_slot_ranges: None
) -> None:
    """The slot ran the tenant's first range (0.5 s, past the 0.3 s slice) right before the
    second: the second yields at its first check, after one page, once another tenant waits."""
    job = _fanned_out(tmp_path, tenant="tenant-a")
    first, second = ranges_of(job.id)[:2]
    assert run_range(job, first) == "range_done"  # nobody waits: the slice passes unused
    fair.pick(limit=1)  # the second range's unit takes the slot
    _other_waits(tmp_path)

    assert run_range(job, second) == "yielded"

    row = JobRange.objects.get(id=second.id)
    assert (row.state, row.generation) == ("queued", 2)
    event = ExecutionAuditEvent.objects.get(job_id=job.id, event_type="range_yielded")
    assert event.details == {"first_page": second.first_page, "cost": 9}
    assert PageCheckpoint.objects.filter(job=job, page_number=second.first_page).exists()


def test_range_yield__not_while_only_the_same_tenant_waits(
    tmp_path: Path, one_slot_ranges: None
) -> None:
    job = _fanned_out(tmp_path, tenant="tenant-a")
    fair.pick(limit=1)
    # the job's own other ranges wait, and another job of the same tenant: no yield
    source = testdocs.make_pdf(tmp_path / "same.pdf", pages=1, text_of=unique_text("a"))
    submit(source, output="text", tenant="tenant-a")

    assert run_range(job, ranges_of(job.id)[0]) == "range_done"
    assert not ExecutionAuditEvent.objects.filter(job_id=job.id, event_type="range_yielded")


def test_range_yield__a_cancelled_job_stops_instead_of_yielding(
    tmp_path: Path, one_slot_ranges: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The yield is fenced on the job: a cancel that lands between the slice check and the
    yield leaves the range to stop as cancelled, nothing requeued."""
    from conversion_jobs.services import cancellation, fanout

    job = _fanned_out(tmp_path, tenant="tenant-a")
    first = ranges_of(job.id)[0]
    fair.pick(limit=1)
    _other_waits(tmp_path)
    real_yield = fanout.range_yield

    def cancel_first(**kwargs: Any) -> bool:
        cancellation.conversion_job_cancel(job_id=job.id, tenant="tenant-a", actor="test")
        return real_yield(**kwargs)

    monkeypatch.setattr(fanout, "range_yield", cancel_first)
    before = refused("range_yield")

    assert run_range(job, first) == "cancelled"

    assert refused("range_yield") == before + 1
    assert not ConversionOutbox.objects.filter(job=job, range_generation=2).exists()
    assert JobRange.objects.get(id=first.id).state == "cancelled"
