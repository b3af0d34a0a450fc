"""Worker-side transitions (DESIGN.md §7): claim, heartbeat, fenced writes, final transitions.

Every write made on behalf of an attempt is fenced: it matches the job row on
``(id, generation, lease_token, state)``. Zero rows means "you lost" (the lease expired and the
job was recovered, or it was cancelled): the caller stops and publishes nothing.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import F
from django.db.models.functions import Coalesce, Now
from django.utils import timezone

from conversion_jobs.models import (
    AttemptOutcome,
    CancellationOutcome,
    CancellationRequest,
    ConversionAttempt,
    ConversionJob,
    PageCheckpoint,
    WorkerLease,
)
from conversion_jobs.observability import metrics
from conversion_jobs.retry_policy import backoff_delay
from conversion_jobs.services.audit import audit_event_append
from conversion_jobs.services.checkpoints import (
    checkpoints_upsert,
    page_counters,
    pages_converted_by,
)
from conversion_jobs.services.leases import Lease, LeaseLost, fenced, lease_ttl
from conversion_jobs.states import State

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Claim:
    """A won claim: the lease and the job row as the claim left it."""

    lease: Lease
    job: ConversionJob


def conversion_job_claim(*, job_id: uuid.UUID, generation: int, worker: str) -> Claim | None:
    """QUEUED -> RUNNING for this generation, creating the attempt and the lease.
    None: a duplicate or stale delivery (counted; the caller acks it).

    One transaction, six statements: the guarded UPDATE (the CAS), the job row read back (the
    runner needs it anyway), the attempt INSERT, the lease upsert (a lease row left by a
    recovered generation is replaced), the audit chain head and the audit INSERT."""
    token = uuid.uuid4()
    with transaction.atomic():
        won = ConversionJob.objects.filter(
            id=job_id, state=State.QUEUED, generation=generation
        ).update(
            state=State.RUNNING,
            attempts=F("attempts") + 1,
            lease_token=token,
            state_version=F("state_version") + 1,
            updated_at=Now(),
        )
        if not won:
            current = (
                ConversionJob.objects.filter(id=job_id).values_list("generation", flat=True).first()
            )
            reason = "stale" if current is not None and current > generation else "duplicate"
            metrics.DUPLICATE_DELIVERIES.labels(reason=reason).inc()
            return None
        job = ConversionJob.objects.get(id=job_id)
        now = timezone.now()
        attempt = ConversionAttempt.objects.create(
            job_id=job_id,
            generation=generation,
            number=job.attempts,
            worker=worker[:128],
            heartbeat_at=now,
        )
        WorkerLease.objects.bulk_create(
            [
                WorkerLease(
                    job_id=job_id,
                    generation=generation,
                    attempt=attempt,
                    token=token,
                    expires_at=now + lease_ttl(),
                )
            ],
            update_conflicts=True,
            unique_fields=["job"],
            update_fields=["generation", "attempt", "token", "expires_at"],
        )
        audit_event_append(
            job_id=job_id,
            event_type="claimed",
            generation=generation,
            attempt_id=attempt.id,
            details={"attempt": job.attempts},
            lock_job=False,
        )
    metrics.CLAIMS.inc()
    lease = Lease(job_id, generation, token, attempt.id, job.attempts, attempt.started_at)
    return Claim(lease, job)


def conversion_job_record_page_count(*, lease: Lease, page_count: int) -> None:
    """Fenced: remember how many pages the document has (RUNNING only)."""
    if not fenced(lease).update(source_page_count=page_count, updated_at=Now()):
        raise LeaseLost()


def _close_attempt(*, lease: Lease, outcome: AttemptOutcome, error_code: str | None) -> None:
    closed = ConversionAttempt.objects.filter(id=lease.attempt_id, finished_at__isnull=True).update(
        outcome=outcome,
        error_code=error_code,
        finished_at=Now(),
        pages_converted=Coalesce(
            pages_converted_by(job_id=lease.job_id, generation=lease.generation), 0
        ),
    )
    if closed:
        metrics.ATTEMPT_DURATION.labels(outcome=outcome).observe(
            (timezone.now() - lease.started_at).total_seconds()
        )


def _end_lease(lease: Lease) -> None:
    WorkerLease.objects.filter(job_id=lease.job_id, token=lease.token).delete()


def _finish(
    lease: Lease,
    *,
    guard_state: State,
    values: dict[str, Any],
    outcome: AttemptOutcome,
    error_code: str | None,
    event_type: str,
    details: dict[str, Any],
    checkpoints: list[PageCheckpoint] | None = None,
) -> bool:
    """One fenced terminal transition with its bookkeeping, in one transaction: the guarded
    UPDATE (its row count is the answer), the attempt's last page checkpoints (``checkpoints``:
    written here rather than in a transaction of their own), the lease ended, the attempt closed,
    pending cancellations resolved, the audit event appended. False: lost, nothing written."""
    from conversion_jobs.services.cancellation import resolve_cancellations_cancelled

    with transaction.atomic():
        won = fenced(lease, guard_state).update(
            **values,
            **page_counters(checkpoints or []),
            lease_token=None,
            state_version=F("state_version") + 1,
            updated_at=Now(),
        )
        if not won:
            return False
        if checkpoints:
            checkpoints_upsert(lease, checkpoints)
        _end_lease(lease)
        _close_attempt(lease=lease, outcome=outcome, error_code=error_code)
        if outcome == AttemptOutcome.CANCELLED:
            resolve_cancellations_cancelled(job_id=lease.job_id)
        elif guard_state != State.RUNNING and values.get("state") != State.RETRY_WAIT:
            # Under a RUNNING guard no request can be pending: a cancel of a RUNNING job makes
            # it CANCELLING in the request's own transaction, and nothing leads back to RUNNING.
            _resolve_cancellations_lost(lease.job_id)
        audit_event_append(
            job_id=lease.job_id,
            event_type=event_type,
            generation=lease.generation,
            attempt_id=lease.attempt_id,
            details=details,
            lock_job=False,
        )
    for checkpoint in checkpoints or []:
        metrics.PAGES.labels(outcome=checkpoint.state).inc()
    return True


def conversion_job_publish(
    *,
    lease: Lease,
    state: State,
    result_key: str,
    result_sha256: str,
    result_size: int,
    result_media_type: str,
    pages_done: int,
    pages_failed: int,
    checkpoints: list[PageCheckpoint] | None = None,
) -> bool:
    """RUNNING -> SUCCEEDED | PARTIAL, fenced, with the attempt's last page ``checkpoints``.
    True: this call published the result. False: the lease was lost or the job was cancelled
    first; nothing is published and those checkpoints are not written."""
    if state not in (State.SUCCEEDED, State.PARTIAL):
        raise ValueError(f"cannot publish as {state}")
    won = _finish(
        lease,
        guard_state=State.RUNNING,
        values={
            "state": state,
            "result_key": result_key,
            "result_sha256": result_sha256,
            "result_size": result_size,
            "result_media_type": result_media_type,
            "finished_at": Now(),
        },
        outcome=AttemptOutcome.SUCCEEDED,
        error_code=None,
        event_type="published",
        details={
            "state": state.value,
            "pages_done": pages_done,
            "pages_failed": pages_failed,
            "result_sha256": result_sha256,
            "result_size": result_size,
        },
        checkpoints=checkpoints,
    )
    if not won:
        return False
    metrics.TERMINAL.labels(state=state.value).inc()
    return True


def _resolve_cancellations_lost(job_id: uuid.UUID) -> None:
    """A completion that commits first makes any pending cancel a loser."""
    CancellationRequest.objects.filter(job_id=job_id, resolved_at__isnull=True).update(
        outcome=CancellationOutcome.LOST_TO_COMPLETION, resolved_at=Now()
    )


def conversion_job_fail(*, lease: Lease, code: str, detail: str = "") -> bool:
    """RUNNING -> FAILED with a terminal code, fenced. False: lost (nothing written)."""
    won = _finish(
        lease,
        guard_state=State.RUNNING,
        values={
            "state": State.FAILED,
            "error_code": code,
            "error_retryable": False,
            "error_detail": detail[:256],
            "finished_at": Now(),
        },
        outcome=AttemptOutcome.TERMINAL_ERROR,
        error_code=code,
        event_type="failed",
        details={"code": code},
    )
    if not won:
        return False
    metrics.TERMINAL.labels(state="failed").inc()
    return True


def conversion_job_retry_later(*, lease: Lease, code: str) -> str | None:
    """RUNNING -> RETRY_WAIT (next_attempt_at = backoff, a Postgres timestamp), or -> FAILED
    ``attempts_exhausted`` when the budget is spent. Fenced; returns the new state or None."""
    with transaction.atomic():
        row = fenced(lease).select_for_update().values_list("attempts", "max_attempts").first()
        if row is None:
            return None
        attempts, max_attempts = row
        details = {"code": code, "attempt": attempts}
        if attempts >= max_attempts:
            new_state, delay = State.FAILED, None
            won = _finish(
                lease,
                guard_state=State.RUNNING,
                values={
                    "state": State.FAILED,
                    "error_code": "attempts_exhausted",
                    "error_retryable": True,
                    "error_detail": f"last error: {code}",
                    "finished_at": Now(),
                },
                outcome=AttemptOutcome.RETRYABLE_ERROR,
                error_code=code,
                event_type="attempts_exhausted",
                details=details,
            )
        else:
            new_state = State.RETRY_WAIT
            delay = backoff_delay(
                attempt=attempts,
                base_s=settings.QUIRE["BACKOFF_BASE_S"],
                cap_s=settings.QUIRE["BACKOFF_CAP_S"],
            )
            won = _finish(
                lease,
                guard_state=State.RUNNING,
                values={
                    "state": State.RETRY_WAIT,
                    "next_attempt_at": Now() + delay,
                    "error_code": code,
                    "error_retryable": True,
                },
                outcome=AttemptOutcome.RETRYABLE_ERROR,
                error_code=code,
                event_type="retry_scheduled",
                details=details,
            )
    if not won:
        return None
    if delay is None:
        metrics.TERMINAL.labels(state="failed").inc()
    else:
        metrics.RETRY_DELAY.observe(delay.total_seconds())
    return new_state


def conversion_job_finish_cancel(*, lease: Lease) -> bool:
    """CANCELLING -> CANCELLED by the worker that held the lease. False: lost."""
    won = _finish(
        lease,
        guard_state=State.CANCELLING,
        values={"state": State.CANCELLED, "finished_at": Now()},
        outcome=AttemptOutcome.CANCELLED,
        error_code=None,
        event_type="cancelled",
        details={"by": "worker"},
    )
    if not won:
        return False
    metrics.TERMINAL.labels(state="cancelled").inc()
    return True


def attempt_record_lease_lost(*, lease: Lease) -> None:
    """Bookkeeping on our own attempt row only (the sweep may have closed it already)."""
    _close_attempt(lease=lease, outcome=AttemptOutcome.LEASE_LOST, error_code="lease_lost")
