"""Page ranges are units of the fair pick (ADR 0021 "Page ranges", ADR 0023 "Dispatch"): a
fanned-out job's ranges are ordered with every other tenant's units by cost / weight, running
ranges (and ranges sent, not yet claimed) hold the slots, the fanned-out job itself holds none.
Both profiles: the Postgres function ``quire_fair_pick`` and its SQLite twin."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from conversion_jobs.models import ConversionJob, ConversionOutbox, JobRange, RangeState
from conversion_jobs.services import broker, fair, fanout, transitions
from conversion_jobs.services.leases import Lease

pytestmark = [pytest.mark.fair_credits]


@pytest.fixture
def fanned_out(make_job: Any) -> Any:
    """A PDF -> text job of ``tenant`` claimed and planned by the real planner transaction
    (``fanout.ranges_plan``) into ``ranges`` ranges of ``pages`` pages: one range row and one
    outbox row per range, each costing its pages (text: factor 1). Returns (job, lease)."""

    def make(tenant: str, ranges: int, pages: int) -> tuple[ConversionJob, Lease]:
        job = make_job(tenant=tenant, dispatch_cost=ranges * pages)
        ConversionOutbox.objects.create(job=job, generation=1, published_at=timezone.now())
        claim = transitions.claim(job_id=job.id, generation=1, worker="planner")
        assert claim is not None
        spans = [(1 + i * pages, (i + 1) * pages) for i in range(ranges)]
        assert fanout.ranges_plan(
            lease=claim.lease, job=job, spans=spans, document_key=None, todo=ranges * pages
        )
        return ConversionJob.objects.get(id=job.id), claim.lease

    return make


def order(units: list[fair.Unit]) -> list[tuple[str, int | None]]:
    return [(u.tenant, u.range_first) for u in units]


@pytest.mark.django_db
def test_plan__each_range_row_is_a_unit_costing_its_pages(capacity: Any, fanned_out: Any) -> None:
    capacity(100)
    job, _lease = fanned_out("a", ranges=3, pages=50)
    rows = ConversionOutbox.objects.filter(job=job, range_first__isnull=False).order_by("id")
    assert list(rows.values_list("range_first", "range_generation", "cost")) == [
        (1, 1, 50),
        (51, 1, 50),
        (101, 1, 50),
    ]
    picked = fair.pick(limit=10)
    assert [(u.range_first, u.range_generation, u.cost) for u in picked] == [
        (1, 1, 50),
        (51, 1, 50),
        (101, 1, 50),
    ]
    assert all(u.page_range == broker.RangeRef(u.range_first, 1) for u in picked)
    # the pick marks the ranges sent (not the job: it is running)
    assert JobRange.objects.filter(job=job, dispatched_at__isnull=False).count() == 3


@pytest.mark.django_db
def test_pick__a_fanned_out_jobs_ranges_interleave_with_another_tenants_jobs(
    capacity: Any, unit: Any, fanned_out: Any
) -> None:
    capacity(100)
    job, _lease = fanned_out("a", ranges=4, pages=10)
    small = [unit("b", cost=10) for _ in range(3)]
    big = unit("b", cost=25)
    picked = fair.pick(limit=6)
    # start tags: a's ranges 0, 10, 20, 30; b's jobs 0, 10, 20, then 30 (cost 25); ties by
    # arrival (a's rows were written first): the ranges take turns with b's jobs, cost for cost
    assert order(picked) == [("a", 1), ("b", None), ("a", 11), ("b", None), ("a", 21), ("b", None)]
    assert [u.job_id for u in picked if u.tenant == "b"] == [j.id for j in small]
    assert all(u.job_id == job.id for u in picked if u.tenant == "a")
    # the next two: a's last range (30) and b's big job (30), by arrival
    assert order(fair.pick(limit=2)) == [("a", 31), ("b", None)]
    assert ConversionOutbox.objects.get(job=big).published_at is not None


@pytest.mark.django_db
def test_pick__a_heavier_weight_gets_more_ranges_per_turn(
    capacity: Any, unit: Any, fanned_out: Any
) -> None:
    capacity(100)
    fair.tenant_share_set(tenant="a", weight=3)
    fanned_out("a", ranges=6, pages=10)
    for _ in range(4):
        unit("b", cost=10)
    picked = fair.pick(limit=4)
    # a's ranges start at 0, 10/3, 20/3, 10; b's jobs at 0, 10: three of a's per one of b's
    assert order(picked) == [("a", 1), ("b", None), ("a", 11), ("a", 21)]


@pytest.mark.django_db
def test_credits__ranges_running_or_sent_hold_the_slots_not_their_job(
    capacity: Any, unit: Any, fanned_out: Any
) -> None:
    capacity(2)
    job, lease = fanned_out("a", ranges=4, pages=10)
    other = unit("b", cost=1000)
    # the fanned-out job itself (running, its planner gone) holds no slot: two units go
    first = fair.pick(limit=10)
    assert order(first) == [("a", 1), ("b", None)]
    assert fair.pick(limit=10) == []  # a range and a job sent, not yet claimed
    claim = fanout.range_claim(
        job_id=job.id, generation=1, first=1, range_generation=1, worker="w:1"
    )
    assert claim is not None
    assert fair.pick(limit=10) == []  # the running range holds its slot
    b_claim = transitions.claim(job_id=other.id, generation=1, worker="w:2")
    assert b_claim is not None and transitions.fail(lease=b_claim.lease, code="invalid_input")
    assert order(fair.pick(limit=10)) == [("a", 11)]  # b's slot came back: a's next range
    assert fair.pick(limit=10) == []
    assert fanout.range_finish(range_lease=claim.range_lease, lease=claim.lease) is False
    assert order(fair.pick(limit=10)) == [("a", 21)]  # the done range's slot came back
    assert JobRange.objects.get(job=job, first_page=1).state == RangeState.DONE
    assert lease.job_id == job.id


@pytest.mark.django_db
def test_credits__the_join_holds_the_jobs_slot(capacity: Any, fanned_out: Any) -> None:
    capacity(1)
    job, _lease = fanned_out("a", ranges=1, pages=10)
    assert order(fair.pick(limit=10)) == [("a", 1)]
    claim = fanout.range_claim(job_id=job.id, generation=1, first=1, range_generation=1, worker="w")
    assert claim is not None
    assert fanout.range_finish(range_lease=claim.range_lease, lease=claim.lease) is True
    # every range done, the job running: its joining worker holds the slot
    assert fair.busy_by_tenant() == {"a": 1}


@pytest.mark.django_db
def test_lost_range_message__its_slot_returns_and_the_range_is_sent_again(
    capacity: Any, fanned_out: Any, settings: Any
) -> None:
    capacity(1)
    job, _lease = fanned_out("a", ranges=2, pages=10)
    assert order(fair.pick(limit=10)) == [("a", 1)]
    assert fair.pick(limit=10) == []
    # the message never reaches a worker: past QUIRE_FAIR_LOST_S it no longer holds the slot
    JobRange.objects.filter(job=job, first_page=1).update(
        dispatched_at=timezone.now() - timedelta(seconds=settings.QUIRE["FAIR_LOST_S"] + 1)
    )
    assert order(fair.pick(limit=10)) == [("a", 11)]
    assert fanout._ranges_republish_if_dispatch_stale(batch=10) == 1
    again = ConversionOutbox.objects.get(job=job, range_first=1, published_at__isnull=True)
    assert (again.range_generation, again.cost) == (1, 10)
    # a range waiting its turn (its row unpublished) is not stale, however long it waits
    JobRange.objects.filter(job=job).update(updated_at=timezone.now() - timedelta(days=1))
    assert fanout._ranges_republish_if_dispatch_stale(batch=10) == 0


@pytest.mark.django_db
def test_retire_superseded__rows_of_ranges_that_moved_on(capacity: Any, fanned_out: Any) -> None:
    capacity(0)  # no worker: everything waits
    job, _lease = fanned_out("a", ranges=2, pages=10)
    # range 1 was claimed through an earlier message of its generation, then cancelled
    JobRange.objects.filter(job=job, first_page=1).update(state=RangeState.CANCELLED)
    ConversionOutbox.objects.filter(job=job).update(created_at=timezone.now() - timedelta(hours=1))
    assert fair.outbox_rows_retire_superseded(batch=10) == 1
    retired = ConversionOutbox.objects.get(job=job, range_first=1)
    assert retired.published_at is not None and retired.last_error_code == "superseded"
    assert ConversionOutbox.objects.get(job=job, range_first=11).published_at is None


@pytest.mark.django_db
def test_relay__publishes_a_range_unit_as_the_ranges_message(
    capacity: Any, fanned_out: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    capacity(10)
    job, _lease = fanned_out("a", ranges=2, pages=10)
    sent: list[dict[str, Any]] = []
    monkeypatch.setattr(broker, "publish_conversion", lambda **kw: sent.append(kw))
    assert fair.relay(limit=10, path="wake") == 2
    assert [(kw["job_id"], kw["generation"], kw["page_range"]) for kw in sent] == [
        (job.id, 1, broker.RangeRef(1, 1)),
        (job.id, 1, broker.RangeRef(11, 1)),
    ]


def _until(predicate: Any, timeout: float = 10.0) -> bool:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


@pytest.fixture
def listening_relay() -> Any:
    """``relay_wake.run`` on its own thread, as in the sweeper process (Postgres only)."""
    import threading

    from django.db import connection, connections

    from conversion_jobs.services import relay_wake

    if connection.vendor != "postgresql":
        pytest.fail("this test needs the production profile (LISTEN / NOTIFY)")
    stop = threading.Event()

    def run() -> None:
        try:
            relay_wake.run(stop)
        finally:
            connections.close_all()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    yield
    stop.set()
    thread.join(relay_wake.IDLE_S + 5)


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_wake__a_plan_wakes_the_relay_which_sends_the_ranges_at_once(
    capacity: Any, fanned_out: Any, no_broker_publish: list[Any], listening_relay: Any
) -> None:
    capacity(2)
    job, _lease = fanned_out("a", ranges=3, pages=10)  # the plan's commit NOTIFYs
    # two credits: two ranges sent by the woken relay (no sweep runs here), page order
    assert _until(lambda: len(no_broker_publish) >= 2)
    assert no_broker_publish == [(str(job.id), 1, 1, 1), (str(job.id), 1, 11, 1)]


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_wake__a_freed_worker_slot_is_filled_at_once_in_production(
    capacity: Any, unit: Any, no_broker_publish: list[Any], listening_relay: Any
) -> None:
    capacity(1)
    first = unit("a")
    fair.slot_freed()
    assert _until(lambda: len(no_broker_publish) == 1)
    second = unit("b")
    claim = transitions.claim(job_id=first.id, generation=1, worker="w")
    assert claim is not None and transitions.fail(lease=claim.lease, code="invalid_input")
    assert no_broker_publish == [(str(first.id), 1)]  # nobody picked yet: no tick here
    fair.slot_freed()  # what a production worker does after an attempt: NOTIFY
    assert _until(lambda: len(no_broker_publish) == 2)
    assert no_broker_publish[1] == (str(second.id), 1)


@pytest.mark.django_db
def test_wake__fair_dispatch_off_publishes_the_range_rows_in_page_order(
    settings: Any, fanned_out: Any, no_broker_publish: list[Any]
) -> None:
    from conversion_jobs.services import dispatch

    settings.QUIRE = {**settings.QUIRE, "FAIR_DISPATCH": False}
    job, _lease = fanned_out("a", ranges=3, pages=10)
    assert dispatch.outbox_rows_publish_woken() == 3
    assert no_broker_publish == [(str(job.id), 1, first, 1) for first in (1, 11, 21)]
    assert dispatch.outbox_rows_publish_woken() == 0  # marked published
