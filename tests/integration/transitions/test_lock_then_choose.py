"""Callers that may take one of several edges (cancel, lease recovery, operator retry) lock the
job row and choose the edge from the state they hold (``transitions.job_lock_for_choice``).

The race each test stages: a second real connection has moved the job and not yet committed
(it holds the row lock) when the caller starts; it commits once the caller waits on the lock.
A caller that tried its edges one after another saw the old state in the first tries, then the
new one in the last: every edge matched zero rows (issue 22 point 2; these tests failed so
before the change). Locking first, the caller waits, sees the new state and takes its edge."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from django.db import connection, connections, transaction
from django.utils import timezone

from conversion_jobs.exceptions import NotRetryable
from conversion_jobs.models import (
    CancellationRequest,
    ConversionAttempt,
    ConversionJob,
    WorkerLease,
)
from conversion_jobs.services import recovery, transitions
from conversion_jobs.services.audit import audit_chain_verify
from conversion_jobs.services.cancellation import conversion_job_cancel
from conversion_jobs.states import State
from tests.integration.transitions.test_edges import _wait_until_blocked, second_connection

AGO = timedelta(seconds=30)


def _claimed(make_job: Callable[..., ConversionJob]) -> ConversionJob:
    """A running job with its real attempt and lease."""
    job = make_job(state=State.QUEUED)
    assert transitions.claim(job_id=job.id, generation=job.generation, worker="w") is not None
    return ConversionJob.objects.get(id=job.id)


def _race(second: psycopg.Connection, job_id: Any, call: Callable[[], Any]) -> dict[str, Any]:
    """Run ``call`` in a thread while ``second`` holds its uncommitted move; commit the move
    once the call waits on the row lock. Returns {"value": …} or {"error": …}."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = call()
        except BaseException as exc:
            outcome["error"] = exc
        finally:
            connections.close_all()

    thread = threading.Thread(target=run)
    thread.start()
    try:
        _wait_until_blocked(job_id)
        second.commit()
    finally:
        thread.join(timeout=30)
    assert not thread.is_alive()
    return outcome


def _watch_until_blocked() -> None:
    """``_wait_until_blocked`` polled from a connection of its own."""
    watcher = second_connection()
    watcher.autocommit = True
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if watcher.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND wait_event_type = 'Lock'"
            ).fetchone()[0]:
                return
            time.sleep(0.02)
        raise AssertionError("the competitor never waited on the row lock")
    finally:
        watcher.close()


@pytest.fixture
def second() -> Any:
    if connection.vendor != "postgresql":
        pytest.fail("this test needs the production profile (DATABASE_URL=postgres://…)")
    conn = second_connection()
    yield conn
    conn.rollback()
    conn.close()


# --- cancel -------------------------------------------------------------------------------------

#: A retry timer came due: beat's requeue (retry_wait -> queued, generation + 1).
DUE_RETRY_REQUEUED = (
    "UPDATE conversion_job SET state = 'queued', generation = generation + 1, "
    "next_attempt_at = NULL, queued_at = now(), state_version = state_version + 1 WHERE id = %s"
)
#: The worker's retryable error (running -> retry_wait), its lease and attempt ended with it.
RUNNING_TO_RETRY_WAIT = (
    "UPDATE conversion_job SET state = 'retry_wait', lease_token = NULL, "
    "next_attempt_at = now() + interval '5 seconds', error_code = 'converter_crashed', "
    "error_retryable = true, state_version = state_version + 1 WHERE id = %(id)s; "
    "DELETE FROM worker_lease WHERE job_id = %(id)s; "
    "UPDATE conversion_attempt SET finished_at = now(), outcome = 'retryable_error', "
    "error_code = 'converter_crashed' WHERE job_id = %(id)s AND finished_at IS NULL"
)


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("move", ["retry_wait->queued", "running->retry_wait"])
def test_cancel__job_that_moves_on_while_cancel_waits_is_cancelled_not_too_late(
    move, make_job, second, no_broker_publish
):
    if move == "retry_wait->queued":
        job = make_job(state=State.RETRY_WAIT, next_attempt_at=timezone.now() - AGO)
        second.execute(DUE_RETRY_REQUEUED, (job.id,))
    else:
        job = _claimed(make_job)
        for statement in RUNNING_TO_RETRY_WAIT.split("; "):
            second.execute(statement, {"id": job.id})

    outcome = _race(
        second, job.id, lambda: conversion_job_cancel(job_id=job.id, tenant=job.tenant, actor="a")
    )

    assert "error" not in outcome, repr(outcome.get("error"))  # was TooLate (409 too_late)
    assert outcome["value"].outcome == "cancelled"
    after = ConversionJob.objects.get(id=job.id)
    assert after.state == State.CANCELLED
    request = CancellationRequest.objects.get(job_id=job.id)
    seen = "queued" if move == "retry_wait->queued" else "retry_wait"
    assert (request.state_seen, request.outcome) == (seen, "cancelled")
    assert request.resolved_at is not None
    assert audit_chain_verify(job_id=job.id)[1] == []


# --- lease recovery -----------------------------------------------------------------------------

#: The cancel API on a running job (running -> cancelling), committed while the sweep waits.
CANCEL_RUNNING = (
    "UPDATE conversion_job SET state = 'cancelling', state_version = state_version + 1 "
    "WHERE id = %s"
)


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_recover_expired_lease__cancel_committed_while_sweeping_ends_cancelled(
    make_job, second, no_broker_publish
):
    job = _claimed(make_job)
    WorkerLease.objects.filter(job_id=job.id).update(expires_at=timezone.now() - AGO)
    second.execute(CANCEL_RUNNING, (job.id,))

    outcome = _race(second, job.id, recovery.conversion_jobs_recover_if_lease_expired)

    assert "error" not in outcome, repr(outcome.get("error"))
    assert outcome["value"] == 1  # was 0: every edge missed and the lease row was dropped
    after = ConversionJob.objects.get(id=job.id)
    assert (after.state, after.lease_token) == (State.CANCELLED, None)
    assert not WorkerLease.objects.filter(job_id=job.id).exists()
    attempt = ConversionAttempt.objects.get(job_id=job.id)
    assert (attempt.outcome, attempt.error_code) == ("lease_lost", "lease_lost")
    assert audit_chain_verify(job_id=job.id)[1] == []


# --- operator retry -----------------------------------------------------------------------------

#: Another operator retried the cancelled job and its new generation failed again, committed
#: while this retry waits (cancelled -> queued -> running -> failed, seen as one commit).
RETRIED_AND_FAILED_AGAIN = (
    "UPDATE conversion_job SET state = 'failed', generation = generation + 1, "
    "error_code = 'converter_crashed', state_version = state_version + 3 WHERE id = %s"
)


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_operator_retry__job_that_failed_while_retry_waits_is_retried(
    make_job, second, no_broker_publish
):
    job = make_job(state=State.CANCELLED)
    second.execute(RETRIED_AND_FAILED_AGAIN, (job.id,))

    outcome = _race(
        second,
        job.id,
        lambda: recovery.conversion_job_retry_failed(job_id=job.id, tenant=job.tenant, actor="a"),
    )

    # was NotRetryable("the job expired under retention") for a job that never expired
    assert "error" not in outcome, repr(outcome.get("error"))
    assert (outcome["value"].state, outcome["value"].generation) == (State.QUEUED, 3)
    assert ConversionJob.objects.get(id=job.id).state == State.QUEUED


# --- the lock itself ----------------------------------------------------------------------------


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_job_lock_for_choice__a_competing_edge_waits_until_the_choice_commits(
    make_job, no_broker_publish
):
    """While a caller holds the row (a barrier at the point the lock is held), a competing
    edge on another connection waits; once the choice commits, the competitor loses."""
    job = make_job(state=State.RETRY_WAIT, next_attempt_at=timezone.now() - AGO)
    held_now, chosen_now = threading.Barrier(2), threading.Event()
    competitor: dict[str, Any] = {}

    def compete() -> None:
        held_now.wait(timeout=10)
        try:
            competitor["won"] = transitions.requeue_due_retry(
                job_id=job.id, generation=job.generation, traceparent=""
            )
            competitor["after_choice"] = chosen_now.is_set()
        finally:
            connections.close_all()

    thread = threading.Thread(target=compete)
    thread.start()
    with transaction.atomic():
        held = transitions.job_lock_for_choice(job_id=job.id, tenant=job.tenant)
        assert held is not None and held.state == State.RETRY_WAIT
        held_now.wait(timeout=10)
        # polled from outside: a statistics view keeps its first snapshot for the transaction
        _watch_until_blocked()  # the competitor waits on the row we hold
        transitions.chosen(
            transitions.cancel_retry_wait(job_id=job.id, tenant=job.tenant, actor="a")
        )
        chosen_now.set()
    thread.join(timeout=30)
    assert competitor == {"won": False, "after_choice": True}
    assert ConversionJob.objects.get(id=job.id).state == State.CANCELLED


# --- both profiles -----------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_job_lock_for_choice__outside_a_transaction_is_refused(make_job):
    job = make_job()
    with pytest.raises(RuntimeError):  # autocommit: the lock would end with the statement
        transitions.job_lock_for_choice(job_id=job.id)


@pytest.mark.django_db
def test_job_lock_for_choice__reads_what_the_choice_needs(make_job):
    job = make_job(state=State.RUNNING, attempts=5, max_attempts=5, traceparent="00-t")
    with transaction.atomic():
        held = transitions.job_lock_for_choice(job_id=job.id)
        assert held is not None
        assert (held.state, held.generation, held.exhausted, held.expired) == (
            State.RUNNING,
            1,
            True,
            False,
        )
        assert (held.lease_token, held.traceparent) == (job.lease_token, "00-t")
        assert transitions.job_lock_for_choice(job_id=job.id, tenant="other") is None


@pytest.mark.django_db
def test_operator_retry__expired_job_is_refused_and_a_live_one_names_its_state(
    make_job, no_broker_publish
):
    expired = make_job(state=State.FAILED, expired_at=timezone.now())
    with pytest.raises(NotRetryable, match="expired"):
        recovery.conversion_job_retry_failed(job_id=expired.id, tenant=None, actor="a")
    live = make_job(state=State.RUNNING)
    with pytest.raises(NotRetryable) as refused:
        recovery.conversion_job_retry_failed(job_id=live.id, tenant=None, actor="a")
    assert "expired" not in str(refused.value)


def test_chosen__an_edge_that_lost_under_the_lock_is_a_defect_not_an_answer():
    for lost in (None, False, 0):
        with pytest.raises(transitions.ChoiceLost):
            transitions.chosen(lost)
    for won in (True, 1, 7):  # a won edge answers True, or the generation it moved
        transitions.chosen(won)
