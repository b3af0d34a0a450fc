"""The process's heartbeat thread (ADR 0017, session 4): one thread serves every running
attempt of a worker process; an attempt registers with ``start()`` and withdraws with
``finish()``; the lease is extended while registered, never after; a cancel or a lost lease
raises the attempt's stop flag; a one-page job that ends before ``HEARTBEAT_S`` never beats
and starts no thread of its own."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from conversion_jobs.models import WorkerLease
from conversion_jobs.services import execution
from conversion_jobs.services.cancellation import conversion_job_cancel
from conversion_jobs.services.heartbeat import Heartbeat, StopReason
from conversion_jobs.services.leases import Lease
from tests import testdocs
from tests.integration.execution.jobkit import execute, submit, unique_text, wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("fast_quire")]


def _claimed(tmp_path: Path, name: str) -> Lease:
    pdf = testdocs.make_pdf(tmp_path / f"{name}.pdf", pages=1, text_of=unique_text(name))
    job = submit(pdf, output="text")
    claim = execution.conversion_job_claim(job_id=job.id, generation=job.generation, worker="t")
    assert claim is not None
    return claim.lease


def _expires(lease: Lease) -> Any:
    return WorkerLease.objects.get(job_id=lease.job_id).expires_at


def _heartbeat_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "quire-heartbeat"]


def test_one_thread_extends_every_registered_lease_and_none_after_finish(tmp_path: Path) -> None:
    first, second = _claimed(tmp_path, "a"), _claimed(tmp_path, "b")
    before = {lease.job_id: _expires(lease) for lease in (first, second)}
    beats = [Heartbeat(first), Heartbeat(second)]
    for heartbeat in beats:
        heartbeat.start()
    try:
        assert len(_heartbeat_threads()) == 1
        for lease in (first, second):
            wait_for(lambda lease=lease: _expires(lease) > before[lease.job_id], timeout=10)
    finally:
        for heartbeat in beats:
            heartbeat.finish()
    assert not any(h.stop.is_set() for h in beats)
    # Withdrawn: no beat is in flight and none comes later (several intervals pass).
    after = _expires(first)
    threading.Event().wait(beats[0].interval * 4)
    assert _expires(first) == after
    assert len(_heartbeat_threads()) == 1


def test_a_cancel_raises_the_stop_flag_with_its_reason(tmp_path: Path) -> None:
    lease = _claimed(tmp_path, "c")
    heartbeat = Heartbeat(lease)
    heartbeat.start()
    try:
        conversion_job_cancel(job_id=lease.job_id, tenant="tenant-a", actor="tester")
        assert heartbeat.stop.wait(10)
        assert heartbeat.reason == StopReason.CANCELLED
    finally:
        heartbeat.finish()


def test_a_lost_lease_raises_the_stop_flag(tmp_path: Path) -> None:
    lease = _claimed(tmp_path, "d")
    heartbeat = Heartbeat(lease)
    heartbeat.start()
    try:
        WorkerLease.objects.filter(job_id=lease.job_id).delete()  # as a recovery would
        assert heartbeat.stop.wait(10)
        assert heartbeat.reason == StopReason.LOST
    finally:
        heartbeat.finish()


def test_short_attempts_share_the_process_thread(tmp_path: Path, settings: Any) -> None:
    settings.QUIRE = {**settings.QUIRE, "HEARTBEAT_S": 30}
    idents = set()
    for name in ("e", "f", "g"):
        pdf = testdocs.make_pdf(tmp_path / f"{name}.pdf", pages=1, text_of=unique_text(name))
        job = submit(pdf, output="text")
        assert execute(job) == "succeeded"
        idents |= {t.ident for t in _heartbeat_threads()}
        job.refresh_from_db()
        assert job.source_page_count == 1  # recorded by the publish (no UPDATE of its own)
    assert len(idents) == 1


@pytest.mark.postgres
def test_heartbeat_holds_one_row_lock_at_a_time__no_cycle_with_a_publish(tmp_path: Path) -> None:
    """A publish locks the job, closes the attempt and deletes the lease in one statement; a
    heartbeat that held the lease row while it waited for the attempt row deadlocked with it
    (seen in CI). Here a second connection holds the attempt row as a publish would: the beat
    extends the lease and commits, and waits only for the attempt row, so the other side can
    take the lease row at once."""
    from django.db import connection

    from conversion_jobs.services.leases import lease_heartbeat
    from tests.integration.transitions.test_edges import second_connection

    lease = _claimed(tmp_path, "lock-order")
    before = _expires(lease)
    other = second_connection()
    try:
        other.execute(
            "UPDATE conversion_attempt SET pages_converted = 0 WHERE id = %s", (lease.attempt_id,)
        )
        done: dict[str, Any] = {}

        def beat_once() -> None:
            try:
                done["result"] = lease_heartbeat(lease=lease)
            finally:
                connection.close()

        beat = threading.Thread(target=beat_once)
        beat.start()
        wait_for(lambda: _expires(lease) > before, timeout=10)  # committed while we hold A
        assert beat.is_alive()  # now waiting for the attempt row only
        other.execute("SET LOCAL lock_timeout = '2s'")
        deleted = other.execute(
            "DELETE FROM worker_lease WHERE job_id = %s", (lease.job_id,)
        ).rowcount
        assert deleted == 1
        other.rollback()
        beat.join(10)
        assert done["result"] == "ok"
    finally:
        other.close()
