"""The fair relay (``services/fair.py``, docs/ARCHITECTURE.md §2b): credits, order, weights,
caps, lost messages, broker failures, and two relays at once. Both profiles (the Postgres
function ``quire_fair_pick`` and its SQLite twin) must give the same answers."""

from __future__ import annotations

import threading
from collections import Counter
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection, connections
from django.utils import timezone

from conversion_jobs.models import (
    ConversionJob,
    ConversionOutbox,
    DispatchClock,
    TenantShare,
    WorkerSlot,
)
from conversion_jobs.services import broker, dispatch, fair, transitions
from conversion_jobs.states import State

pytestmark = [pytest.mark.fair_credits]


def tenants_of(units: list[fair.Unit]) -> list[str]:
    return [u.tenant for u in units]


@pytest.mark.django_db
def test_pick__sends_no_more_than_the_free_slots(capacity: Any, unit: Any) -> None:
    capacity(2)
    jobs = [unit("a") for _ in range(5)]
    first = fair.pick(limit=100)
    assert [u.job_id for u in first] == [j.id for j in jobs[:2]]
    assert fair.pick(limit=100) == []  # both slots hold a sent, unclaimed unit
    sent = ConversionOutbox.objects.filter(published_at__isnull=False)
    assert sorted(sent.values_list("job_id", flat=True)) == sorted(j.id for j in jobs[:2])


@pytest.mark.django_db
def test_pick__a_credit_returns_when_the_job_leaves_running(capacity: Any, unit: Any) -> None:
    capacity(1)
    one, two = unit("a"), unit("a")
    assert [u.job_id for u in fair.pick(limit=10)] == [one.id]
    claim = transitions.claim(job_id=one.id, generation=1, worker="w")
    assert claim is not None
    assert fair.pick(limit=10) == []  # running holds the slot
    assert transitions.fail(lease=claim.lease, code="invalid_input")
    assert [u.job_id for u in fair.pick(limit=10)] == [two.id]


@pytest.mark.django_db
def test_pick__registered_worker_slots_are_the_capacity(capacity: Any, unit: Any) -> None:
    for _ in range(3):
        unit("a")
    assert fair.pick(limit=10) == []  # no worker: nothing is sent, everything waits
    WorkerSlot.objects.create(name="h:1", slots=1, seen_at=timezone.now())
    WorkerSlot.objects.create(name="h:2", slots=1, seen_at=timezone.now() - timedelta(hours=1))
    assert len(fair.pick(limit=10)) == 1  # the stale slot does not count


@pytest.mark.django_db
def test_pick__orders_by_virtual_start_time_over_cost(capacity: Any, unit: Any) -> None:
    capacity(4)
    big = [unit("a", cost=10) for _ in range(6)]
    small = [unit("b", cost=1) for _ in range(2)]
    picked = fair.pick(limit=10)
    # start tags: a 0, 10, 20 …; b 0, 1 -> a1, b1, b2, a2 (ties by arrival)
    assert [u.job_id for u in picked] == [big[0].id, small[0].id, small[1].id, big[1].id]


@pytest.mark.django_db
def test_pick__weights_3_to_1_share_3_to_1(capacity: Any, unit: Any) -> None:
    capacity(1000)
    TenantShare.objects.create(tenant="a", weight=3)
    for _ in range(40):
        unit("a")
        unit("b")
    assert Counter(tenants_of(fair.pick(limit=40))) == {"a": 30, "b": 10}


@pytest.mark.django_db
def test_pick__an_idle_tenant_banks_nothing(capacity: Any, unit: Any) -> None:
    capacity(1000)
    for _ in range(5):
        unit("a")
    assert len(fair.pick(limit=5)) == 5  # a alone: its virtual time runs ahead
    TenantShare.objects.filter(tenant="b").delete()
    later_a = [unit("a") for _ in range(3)]
    late_b = [unit("b") for _ in range(3)]
    picked = fair.pick(limit=6)
    # b starts at the clock (a's last start tag, 4), not at 0: one turn ahead of a's next
    # (5), then they alternate; it does not take three turns in a row for the time it was idle
    assert tenants_of(picked) == ["b", "a", "b", "a", "b", "a"]
    assert {u.job_id for u in picked} == {j.id for j in later_a + late_b}


@pytest.mark.django_db
def test_pick__a_running_cap_holds_a_tenant_back(capacity: Any, unit: Any) -> None:
    capacity(10)
    TenantShare.objects.create(tenant="a", running_cap=2)
    for _ in range(5):
        unit("a")
    unit("b")
    assert Counter(tenants_of(fair.pick(limit=10))) == {"a": 2, "b": 1}
    assert fair.pick(limit=10) == []  # a's two sent units fill its cap


@pytest.mark.django_db
def test_pick__skips_units_of_a_job_that_moved_on(capacity: Any, unit: Any) -> None:
    capacity(10)
    gone = unit("a")
    assert transitions.cancel_queued(job_id=gone.id, tenant="a", actor="x") is not None
    live = unit("a")
    assert [u.job_id for u in fair.pick(limit=10)] == [live.id]
    ConversionOutbox.objects.filter(job=gone).update(created_at=timezone.now() - timedelta(hours=1))
    assert fair.outbox_rows_retire_superseded(batch=10) == 1
    row = ConversionOutbox.objects.get(job=gone)
    assert row.published_at is not None and row.last_error_code == "superseded"


@pytest.mark.django_db
def test_relay__a_broker_error_returns_the_units_to_waiting(
    capacity: Any, unit: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    capacity(5)
    jobs = [unit("a") for _ in range(3)]
    calls: list[Any] = []

    def refuse(**kwargs: Any) -> None:
        calls.append(kwargs)
        raise ConnectionRefusedError

    monkeypatch.setattr(broker, "publish_conversion", refuse)
    assert fair.relay(limit=10, path="sweep") == 0
    assert len(calls) == 1  # the first failure stops the pass
    rows = ConversionOutbox.objects.filter(job__in=jobs)
    assert set(rows.values_list("published_at", flat=True)) == {None}
    assert set(rows.values_list("last_error_code", flat=True)) == {"broker_unreachable"}
    assert set(ConversionJob.objects.values_list("dispatched_at", flat=True)) == {None}
    sent: list[Any] = []
    monkeypatch.setattr(broker, "publish_conversion", lambda **kw: sent.append(kw))
    assert fair.relay(limit=10, path="sweep") == 3  # the credits were returned too
    assert sorted(kw["job_id"] for kw in sent) == sorted(j.id for j in jobs)


@pytest.mark.django_db
def test_lost_message__its_credit_returns_and_the_job_is_sent_again(
    capacity: Any, unit: Any, settings: Any
) -> None:
    capacity(1)
    lost, other = unit("a"), unit("a")
    assert [u.job_id for u in fair.pick(limit=10)] == [lost.id]
    assert fair.pick(limit=10) == []
    # the message never reaches a worker: past QUIRE_FAIR_LOST_S it no longer holds the slot
    ConversionJob.objects.filter(id=lost.id).update(
        dispatched_at=timezone.now() - timedelta(seconds=settings.QUIRE["FAIR_LOST_S"] + 1)
    )
    assert [u.job_id for u in fair.pick(limit=10)] == [other.id]
    assert dispatch.conversion_jobs_republish_if_dispatch_stale() == 1
    assert ConversionOutbox.objects.filter(job=lost, published_at__isnull=True).count() == 1
    # a unit that waits its turn is not stale, however long it waits
    ConversionJob.objects.filter(id=lost.id).update(queued_at=timezone.now() - timedelta(days=1))
    assert dispatch.conversion_jobs_republish_if_dispatch_stale() == 0


def _age_pick(job: ConversionJob, seconds: float) -> None:
    """Move a pick ``seconds`` into the past as the pick wrote it: the job's ``dispatched_at``
    and its row's ``published_at`` one and the same time (a confirm would have moved the
    row's)."""
    at = ConversionJob.objects.get(id=job.id).dispatched_at - timedelta(seconds=seconds)
    row = ConversionOutbox.objects.get(job=job)
    if row.published_at == ConversionJob.objects.get(id=job.id).dispatched_at:
        ConversionOutbox.objects.filter(id=row.id).update(published_at=at)
    else:
        ConversionOutbox.objects.filter(id=row.id).update(
            published_at=row.published_at - timedelta(seconds=seconds)
        )
    ConversionJob.objects.filter(id=job.id).update(dispatched_at=at)


@pytest.mark.django_db
def test_unconfirmed_pick__goes_back_to_waiting_after_twice_the_confirm_timeout(
    capacity: Any, unit: Any, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A picker killed between its pick and its publish: its unit waits again after
    2 x QUIRE_PUBLISH_CONFIRM_TIMEOUT_S, not QUIRE_FAIR_LOST_S; a confirmed one stays sent."""
    capacity(2)
    lost, published, waiting = unit("a"), unit("a"), unit("a")
    assert [u.job_id for u in fair.pick(limit=1)] == [lost.id]  # ... and its picker dies
    sent: list[Any] = []
    monkeypatch.setattr(broker, "publish_conversion", lambda **kw: sent.append(kw))
    assert fair.relay(limit=1, path="sweep") == 1  # published and confirmed
    assert [kw["job_id"] for kw in sent] == [published.id]
    assert fair.pick(limit=10) == []  # both slots held
    after = fair.unconfirmed_after_s()
    assert after == 2 * settings.QUIRE["PUBLISH_CONFIRM_TIMEOUT_S"]
    # younger than the bound: a live publisher may still be waiting for its confirm
    _age_pick(lost, after - 0.3)
    _age_pick(published, after + 5)
    assert fair.units_return_unconfirmed(batch=10) == 0
    _age_pick(lost, 0.6)
    assert fair.units_return_unconfirmed(batch=10) == 1
    row = ConversionOutbox.objects.get(job=lost)
    assert (row.published_at, row.last_error_code) == (None, "unconfirmed")
    assert ConversionJob.objects.get(id=lost.id).dispatched_at is None
    assert ConversionOutbox.objects.get(job=published).published_at is not None
    # its slot is free again, and the lost unit is first in line (it was picked before)
    assert [u.job_id for u in fair.pick(limit=10)] == [lost.id]
    assert fair.units_return_unconfirmed(batch=10) == 0
    assert ConversionJob.objects.get(id=waiting.id).dispatched_at is None


@pytest.mark.django_db
def test_unconfirmed_pick__a_claimed_or_superseded_job_is_left_alone(
    capacity: Any, unit: Any
) -> None:
    capacity(5)
    claimed, cancelled = unit("a"), unit("a")
    assert len(fair.pick(limit=10)) == 2
    _age_pick(claimed, 5)
    _age_pick(cancelled, 5)
    assert transitions.claim(job_id=claimed.id, generation=1, worker="w") is not None
    ConversionJob.objects.filter(id=cancelled.id).update(generation=2)
    assert fair.units_return_unconfirmed(batch=10) == 0
    assert set(
        ConversionOutbox.objects.filter(job__in=[claimed, cancelled]).values_list(
            "last_error_code", flat=True
        )
    ) == {None}


@pytest.mark.django_db
def test_clock__follows_the_last_start_tag_sent(capacity: Any, unit: Any) -> None:
    capacity(10)
    for _ in range(3):
        unit("a", cost=4)
    fair.pick(limit=10)
    assert DispatchClock.objects.get(id=1).vclock == pytest.approx(8.0)
    assert TenantShare.objects.get(tenant="a").vtime == pytest.approx(12.0)


def _pick_in_thread(barrier: threading.Barrier, out: list[fair.Unit]) -> None:
    try:
        barrier.wait(timeout=10)
        out.extend(fair.pick(limit=100))
    finally:
        connections.close_all()


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_two_relays_at_once_never_send_a_unit_twice_or_exceed_the_credits(
    capacity: Any, unit: Any
) -> None:
    if connection.vendor != "postgresql":
        pytest.fail("this test needs the production profile (the Postgres advisory lock)")
    capacity(7)
    for round_ in range(5):
        ConversionJob.objects.filter(state=State.QUEUED).delete()
        for i in range(20):
            unit("a" if i % 2 else f"b{round_}")
        barrier = threading.Barrier(4)
        outs: list[list[fair.Unit]] = [[] for _ in range(4)]
        threads = [threading.Thread(target=_pick_in_thread, args=(barrier, out)) for out in outs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        ids = [u.outbox_id for out in outs for u in out]
        assert len(ids) == len(set(ids)) == 7, round_


@pytest.mark.django_db
def test_pick__weights_hold_one_credit_at_a_time(capacity: Any, unit: Any) -> None:
    """As a busy fleet sees it: one slot frees, one pick, the unit runs and ends."""
    capacity(1)
    TenantShare.objects.create(tenant="a", weight=3)
    for _ in range(40):
        unit("a", cost=5)
        unit("b", cost=5)
    served = []
    for _ in range(40):
        (sent,) = fair.pick(limit=1)
        served.append(sent.tenant)
        claim = transitions.claim(job_id=sent.job_id, generation=1, worker="w")
        assert claim is not None and transitions.fail(lease=claim.lease, code="invalid_input")
    assert Counter(served) == {"a": 30, "b": 10}
