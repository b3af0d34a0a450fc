"""Worker-side transitions (DESIGN.md §7): claim, heartbeat, fenced writes, final transitions.

Every write made on behalf of an attempt is fenced: it matches the job row on
``(id, generation, lease_token, state)``. Zero rows means "you lost" (the lease expired and the
job was recovered, or it was cancelled): the caller stops and publishes nothing.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Count, F, Subquery
from django.db.models.functions import Coalesce, Now
from django.utils import timezone

from conversion_jobs.models import (
    AttemptOutcome,
    CancellationOutcome,
    CancellationRequest,
    ConversionAttempt,
    ConversionJob,
    PageCheckpoint,
    PageState,
    WorkerLease,
)
from conversion_jobs.observability import metrics
from conversion_jobs.retry_policy import backoff_delay
from conversion_jobs.services.audit import audit_event_append
from conversion_jobs.states import State

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Lease:
    """What a worker holds while it runs one generation of one job."""

    job_id: uuid.UUID
    generation: int
    token: uuid.UUID
    attempt_id: int
    attempt_number: int
    started_at: datetime | None = None

    @property
    def first_run(self) -> bool:
        """The job's very first attempt: no page can have a checkpoint yet."""
        return self.generation == 1 and self.attempt_number == 1


@dataclass(frozen=True)
class Claim:
    """A won claim: the lease and the job row as the claim left it."""

    lease: Lease
    job: ConversionJob


class LeaseLost(Exception):
    """A fenced write matched no row: the lease is gone (expired, recovered, or cancelled)."""


def _lease_ttl() -> timedelta:
    return timedelta(seconds=settings.QUIRE["LEASE_S"])


def _fenced(lease: Lease, *states: State) -> Any:
    return ConversionJob.objects.filter(
        id=lease.job_id,
        generation=lease.generation,
        lease_token=lease.token,
        state__in=list(states or (State.RUNNING,)),
    )


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
                    expires_at=now + _lease_ttl(),
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


class HeartbeatResult:
    OK = "ok"
    CANCELLING = "cancelling"
    LOST = "lost"


def lease_heartbeat(*, lease: Lease) -> str:
    """Extend the lease if it is still ours and unexpired. Returns OK, CANCELLING (still ours,
    but the job must stop and end cancelled) or LOST."""
    now = timezone.now()
    with transaction.atomic():
        extended = WorkerLease.objects.filter(
            job_id=lease.job_id, token=lease.token, generation=lease.generation, expires_at__gt=now
        ).update(expires_at=now + _lease_ttl())
        if not extended:
            return HeartbeatResult.LOST
        state = (
            ConversionJob.objects.filter(
                id=lease.job_id, generation=lease.generation, lease_token=lease.token
            )
            .values_list("state", flat=True)
            .first()
        )
        ConversionAttempt.objects.filter(id=lease.attempt_id).update(heartbeat_at=now)
    if state == State.RUNNING:
        return HeartbeatResult.OK
    if state == State.CANCELLING:
        return HeartbeatResult.CANCELLING
    return HeartbeatResult.LOST


def job_state_under_lease(*, lease: Lease) -> str | None:
    """The job's state if this lease still holds it, else None."""
    return (
        ConversionJob.objects.filter(
            id=lease.job_id, generation=lease.generation, lease_token=lease.token
        )
        .values_list("state", flat=True)
        .first()
    )


def conversion_job_record_page_count(*, lease: Lease, page_count: int) -> None:
    """Fenced: remember how many pages the document has (RUNNING only)."""
    if not _fenced(lease).update(source_page_count=page_count, updated_at=Now()):
        raise LeaseLost()


def page_checkpoints_done(*, job_id: uuid.UUID) -> dict[int, PageCheckpoint]:
    return {p.page_number: p for p in PageCheckpoint.objects.filter(job_id=job_id)}


def page_checkpoint_record(
    *,
    lease: Lease,
    page: int,
    state: PageState,
    attempts: int,
    artifact_key: str | None = None,
    artifact_sha256: str | None = None,
    artifact_size: int | None = None,
    media_type: str | None = None,
    error_code: str | None = None,
) -> PageCheckpoint:
    """Fenced upsert of one page's checkpoint (``attempts``: tries spent on this page so far)."""
    checkpoint = PageCheckpoint(
        job_id=lease.job_id,
        page_number=page,
        state=state,
        attempts=attempts,
        artifact_key=artifact_key,
        artifact_sha256=artifact_sha256,
        artifact_size=artifact_size,
        media_type=media_type,
        error_code=error_code,
        generation=lease.generation,
    )
    page_checkpoints_record(lease=lease, checkpoints=[checkpoint])
    return checkpoint


def page_checkpoints_record(*, lease: Lease, checkpoints: list[PageCheckpoint]) -> None:
    """Fenced upsert of a batch of page checkpoints, in three round trips: the guarded UPDATE
    on the job row (it takes the row lock first, so a recovery or a cancel that commits before
    us makes it match zero rows: LeaseLost, nothing written), one upsert, COMMIT."""
    with transaction.atomic():
        if not _fenced(lease).update(updated_at=Now(), **_page_counters(checkpoints)):
            raise LeaseLost()
        _checkpoints_upsert(lease, checkpoints)
    for checkpoint in checkpoints:
        metrics.PAGES.labels(outcome=checkpoint.state).inc()


def _page_counters(checkpoints: list[PageCheckpoint]) -> dict[str, Any]:
    """The job row's page counters moved by ``checkpoints`` (for its guarded UPDATE)."""
    done = sum(1 for c in checkpoints if c.state == PageState.DONE)
    failed = sum(1 for c in checkpoints if c.state == PageState.FAILED)
    counters: dict[str, Any] = {}
    if done:
        counters["pages_done"] = F("pages_done") + done
    if failed:
        counters["pages_failed"] = F("pages_failed") + failed
    return counters


def _checkpoints_upsert(lease: Lease, checkpoints: list[PageCheckpoint]) -> None:
    """The upsert and the audit events of failed pages; the caller holds the fenced row."""
    PageCheckpoint.objects.bulk_create(
        checkpoints,
        update_conflicts=True,
        unique_fields=["job", "page_number"],
        update_fields=[*CHECKPOINT_FIELDS, "updated_at"],
    )
    for checkpoint in checkpoints:
        if checkpoint.state == PageState.FAILED:
            audit_event_append(
                job_id=lease.job_id,
                event_type="page_failed",
                generation=lease.generation,
                attempt_id=lease.attempt_id,
                details={"page": checkpoint.page_number, "code": checkpoint.error_code},
                lock_job=False,
            )


CHECKPOINT_FIELDS = [
    "state",
    "attempts",
    "artifact_key",
    "artifact_sha256",
    "artifact_size",
    "media_type",
    "error_code",
    "generation",
]


def pages_converted_by(*, job_id: Any, generation: Any) -> Subquery:
    """Pages an attempt checkpointed as done (one attempt per generation, so the generation
    stamped on the checkpoint names the attempt): computed when the attempt closes rather than
    counted with an extra UPDATE per page."""
    return Subquery(
        PageCheckpoint.objects.filter(job_id=job_id, generation=generation, state=PageState.DONE)
        .values("job_id")
        .annotate(n=Count("id"))
        .values("n")[:1]
    )


def _close_attempt(*, lease: Lease, outcome: AttemptOutcome, error_code: str | None) -> None:
    attempt = ConversionAttempt.objects.filter(id=lease.attempt_id, finished_at__isnull=True)
    started = lease.started_at
    if started is None:
        started = attempt.values_list("started_at", flat=True).first()
    closed = attempt.update(
        outcome=outcome,
        error_code=error_code,
        finished_at=Now(),
        pages_converted=Coalesce(
            pages_converted_by(job_id=lease.job_id, generation=lease.generation), 0
        ),
    )
    if closed and started is not None:
        metrics.ATTEMPT_DURATION.labels(outcome=outcome).observe(
            (timezone.now() - started).total_seconds()
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
        won = _fenced(lease, guard_state).update(
            **values,
            **_page_counters(checkpoints or []),
            lease_token=None,
            state_version=F("state_version") + 1,
            updated_at=Now(),
        )
        if not won:
            return False
        if checkpoints:
            _checkpoints_upsert(lease, checkpoints)
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
        row = _fenced(lease).select_for_update().values_list("attempts", "max_attempts").first()
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
