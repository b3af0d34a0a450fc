"""An idle system's acceptance sends its own unit (``store.fair.ADMIT``, ADR 0021 "Sent at
acceptance"): the acceptance's statement is the pick when the pick would choose this very unit
(nothing waits, a credit is free, no running cap), and only then. It takes the pick's lock
without waiting, and a sender that committed after its snapshot makes it leave the unit to
the pick, so acceptances and picks at once never spend more than the credits. Postgres only:
SQLite's acceptance never sends (its pick does)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from django.db import connection, connections
from django.utils import timezone

from conversion_jobs.models import (
    ConversionJob,
    ConversionOutbox,
    DispatchClock,
    TenantShare,
)
from conversion_jobs.observability import metrics
from conversion_jobs.services import broker, dispatch, fair
from conversion_jobs.states import State
from conversion_jobs.store.fair import PICK_LOCK
from tests import testdocs
from tests.integration.execution.jobkit import submit, unique_text

pytestmark = [pytest.mark.fair_credits, pytest.mark.postgres]


@pytest.fixture(autouse=True)
def _clock() -> None:
    """The clock's one row (migration 0017), which a transactional test's flush removes: the
    commit's callbacks (the fast path) run only outside a test's wrapping transaction."""
    if connection.vendor == "postgresql":
        DispatchClock.objects.get_or_create(id=1)


def _needs_postgres() -> None:
    if connection.vendor != "postgresql":
        pytest.fail("this test needs the production profile (the acceptance's one statement)")


def _accept(tmp: Path, tenant: str = "a") -> ConversionJob:
    source = testdocs.make_pdf(tmp / f"{time.monotonic_ns()}.pdf", pages=1, text_of=unique_text())
    return submit(source, output="text", tenant=tenant)


@pytest.fixture
def handed(monkeypatch: pytest.MonkeyPatch) -> dict[str, bool]:
    """Per job, whether its commit's fast path was told its acceptance sent it (the fast path
    still runs: inline here, there is no web)."""
    seen: dict[str, bool] = {}
    real = dispatch.outbox_publish_fast

    def record(item: Any) -> bool:
        seen[str(item.job_id)] = item.sent
        return real(item)

    monkeypatch.setattr(dispatch, "outbox_publish_fast", record)
    return seen


@pytest.fixture
def picks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The limit of every fair pick this process runs (the pick still runs)."""
    seen: list[int] = []
    real = fair.pick
    monkeypatch.setattr(fair, "pick", lambda *, limit: seen.append(limit) or real(limit=limit))
    return seen


def _sent(job: ConversionJob, handed: dict[str, bool]) -> bool:
    """Written sent by its acceptance: so said to the fast path, and the rows agree."""
    if not handed[str(job.id)]:
        return False
    assert ConversionJob.objects.get(id=job.id).dispatched_at is not None
    return True


@pytest.mark.django_db(transaction=True)
def test_accept__an_idle_system_sends_its_own_unit_without_a_pick(
    capacity: Any,
    tmp_path: Path,
    no_broker_publish: Any,
    handed: Any,
    picks: list[int],
) -> None:
    _needs_postgres()
    capacity(2)
    before = metrics.FAIR_SENT_AT_ACCEPTANCE._value.get()
    clock = DispatchClock.objects.get(id=1).vclock
    job = _accept(tmp_path)
    assert _sent(job, handed)
    fresh = ConversionJob.objects.get(id=job.id)
    row = ConversionOutbox.objects.get(job=job)
    assert (fresh.dispatched_generation, row.publish_attempts) == (1, 1)
    assert fresh.dispatched_at is not None and row.published_at is not None
    # the commit's fast path published it (inline here: no web) and the confirm moved the row
    assert no_broker_publish == [(str(job.id), 1)]
    assert row.published_at > fresh.dispatched_at
    assert picks == []  # no pick before the publish
    assert metrics.FAIR_SENT_AT_ACCEPTANCE._value.get() == before + 1
    # the virtual time moved as the pick moves it: the tenant by the unit's cost from the clock
    share = TenantShare.objects.get(tenant="a")
    assert share.vtime == pytest.approx(clock + max(fresh.dispatch_cost, 1))
    assert DispatchClock.objects.get(id=1).vclock == pytest.approx(clock)


@pytest.mark.django_db(transaction=True)
def test_accept__a_unit_sent_at_acceptance_that_the_broker_refuses_waits_again(
    capacity: Any, tmp_path: Path, handed: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    _needs_postgres()
    capacity(2)

    def refuse(**_kw: Any) -> None:
        raise ConnectionRefusedError

    monkeypatch.setattr(broker, "publish_conversion", refuse)
    job = _accept(tmp_path)
    assert handed[str(job.id)]  # sent by its acceptance, then refused by the broker
    row = ConversionOutbox.objects.get(job=job)
    assert (row.published_at, row.last_error_code) == (None, "broker_unreachable")
    assert ConversionJob.objects.get(id=job.id).dispatched_at is None  # its credit is back
    sent: list[Any] = []
    monkeypatch.setattr(broker, "publish_conversion", lambda **kw: sent.append(kw))
    assert fair.relay_if_waiting(limit=10, path="sweep") == 1  # the sweep's pick sends it
    assert [kw["job_id"] for kw in sent] == [job.id]


@pytest.mark.django_db(transaction=True)
def test_accept__the_unit_waits_for_the_pick_when_another_waits_or_no_credit_is_free(
    capacity: Any,
    tmp_path: Path,
    no_broker_publish: Any,
    unit: Any,
    handed: Any,
    picks: list[int],
) -> None:
    _needs_postgres()
    capacity(2)
    # another tenant's unit waits (a pick would weigh both): left to the pick, which sends both
    other = unit("b")
    first = _accept(tmp_path)
    assert not _sent(first, handed)
    assert sorted(p[0] for p in no_broker_publish) == sorted([str(other.id), str(first.id)])
    assert len(picks) == 1
    # both credits are now held by sent units: nothing free, nothing sent, and no pick runs
    # (it could send nothing: the next slot freed wakes the relay)
    blocked = _accept(tmp_path)
    assert not _sent(blocked, handed)
    assert ConversionOutbox.objects.get(job=blocked).published_at is None
    assert len(no_broker_publish) == 2
    assert len(picks) == 1
    # a slot frees: the relay's pick (what the worker's wake-up runs) sends the waiting unit
    ConversionJob.objects.filter(id=other.id).update(
        state=State.FAILED, error_code="invalid_input", finished_at=timezone.now()
    )
    assert fair.relay_if_waiting(limit=10, path="wake") == 1
    assert no_broker_publish[-1] == (str(blocked.id), 1)


@pytest.mark.django_db(transaction=True)
def test_accept__a_tenant_with_a_running_cap_is_left_to_the_pick(
    capacity: Any, tmp_path: Path, no_broker_publish: Any, handed: Any
) -> None:
    _needs_postgres()
    capacity(4)
    TenantShare.objects.create(tenant="a", running_cap=1)
    job = _accept(tmp_path)
    assert not _sent(job, handed)
    assert no_broker_publish == [(str(job.id), 1)]  # the pick sent it (the cap allows one)


@pytest.mark.django_db(transaction=True)
def test_accept__a_pick_in_progress_holds_the_lock_and_the_unit_waits_for_it(
    capacity: Any, tmp_path: Path, no_broker_publish: Any, handed: Any
) -> None:
    _needs_postgres()
    capacity(2)
    other = connections.create_connection("default")
    try:
        with other.cursor() as cursor:
            cursor.execute("BEGIN")
            cursor.execute("SELECT pg_advisory_xact_lock(%s)", [PICK_LOCK])
            # the acceptance never waits for the lock; its fast path's pick does, until the
            # pick in progress ends, and then sends the unit
            ended = threading.Timer(0.5, lambda: cursor.execute("COMMIT"))
            ended.start()
            job = _accept(tmp_path)
            ended.join()
    finally:
        other.close()
    assert not _sent(job, handed)
    assert no_broker_publish == [(str(job.id), 1)]


def _sender_commits_during_the_acceptance(tmp: Path, *, commit: bool) -> ConversionJob:
    """Another sender's transaction has written the clock row (as a pick that sent, or another
    acceptance's gate, does) and ends while this acceptance's statement waits for that row."""
    other = connections.create_connection("default")
    try:
        with other.cursor() as cursor:
            cursor.execute("BEGIN")
            cursor.execute("UPDATE dispatch_clock SET vclock = vclock WHERE id = 1")
            ended = threading.Timer(0.5, lambda: cursor.execute("COMMIT" if commit else "ROLLBACK"))
            ended.start()
            started = time.monotonic()
            job = _accept(tmp)
            waited = time.monotonic() - started
            ended.join()
        assert waited >= 0.4, "the acceptance's gate did not wait for the sender's row"
        return job
    finally:
        other.close()


@pytest.mark.django_db(transaction=True)
def test_accept__a_sender_that_commits_meanwhile_wins_and_one_that_rolls_back_does_not(
    capacity: Any, tmp_path: Path, no_broker_publish: Any, handed: Any
) -> None:
    """The snapshot question: the acceptance's statement read the busy slots before the other
    sender committed; the clock row's re-check on its newest version refuses the send."""
    _needs_postgres()
    capacity(2)
    lost = _sender_commits_during_the_acceptance(tmp_path, commit=True)
    assert not _sent(lost, handed)
    ConversionJob.objects.all().delete()  # nothing waits, nothing is busy again
    won = _sender_commits_during_the_acceptance(tmp_path, commit=False)
    assert _sent(won, handed)


@pytest.mark.django_db(transaction=True)
def test_accept__acceptances_and_picks_at_once_never_exceed_the_credits(
    capacity: Any, tmp_path: Path, no_broker_publish: Any
) -> None:
    """Real concurrency: four threads accept jobs (one statement each, autocommit, as the web
    does) while a fifth picks in a loop; no worker claims, so the slots stay held by what was
    sent, and exactly the credits' worth is sent however the statements interleave."""
    _needs_postgres()
    credits = 3
    capacity(credits)
    stop = threading.Event()
    errors: list[BaseException] = []

    def accept(n: int, index: int) -> None:
        try:
            for i in range(n):
                _accept(tmp_path, tenant=f"t{(index + i) % 3}")
        except BaseException as exc:  # reported below
            errors.append(exc)
        finally:
            connections.close_all()

    def picks() -> None:
        try:
            while not stop.is_set():
                fair.relay(limit=100, path="sweep")
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections.close_all()

    for round_ in range(3):
        ConversionJob.objects.all().delete()
        stop.clear()
        picker = threading.Thread(target=picks)
        picker.start()
        threads = [threading.Thread(target=accept, args=(6, i)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        stop.set()
        picker.join(30)
        assert not errors, errors
        fair.relay(limit=100, path="sweep")
        queued = ConversionJob.objects.filter(state=State.QUEUED)
        assert queued.count() == 24, round_
        assert queued.filter(dispatched_at__isnull=False).count() == credits, round_
        sent = [p[0] for p in no_broker_publish]
        assert len(sent) == len(set(sent)) == credits * (round_ + 1), round_
