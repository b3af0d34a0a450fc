"""Cancellation (DESIGN.md §8). Every call records a ``cancellation_request``.

Cancel and completion race through guarded UPDATEs on the job row: whichever commits first
wins, the other matches zero rows. The request's outcome records what happened.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from django.db import transaction
from django.db.models import F
from django.db.models.functions import Now
from django.utils import timezone

from conversion_jobs.exceptions import NotFound, TooLate
from conversion_jobs.models import CancellationOutcome, CancellationRequest, ConversionJob
from conversion_jobs.observability import metrics
from conversion_jobs.services.audit import audit_event_append
from conversion_jobs.states import State


@dataclass(frozen=True)
class CancelResult:
    job: ConversionJob
    outcome: CancellationOutcome


def conversion_job_cancel(*, job_id: uuid.UUID, tenant: str, actor: str) -> CancelResult:
    """QUEUED | RETRY_WAIT -> CANCELLED; RUNNING -> CANCELLING; CANCELLING / CANCELLED -> no
    change (same answer). Raises NotFound (other tenant or missing; nothing recorded) or
    TooLate (a finished job; recorded, result untouched)."""
    with transaction.atomic():
        seen = (
            ConversionJob.objects.select_for_update()
            .filter(id=job_id, tenant=tenant)
            .values_list("state", "generation")
            .first()
        )
        if seen is None:
            raise NotFound()
        state, generation = seen
        guard = ConversionJob.objects.filter(id=job_id, tenant=tenant, generation=generation)
        if state in (State.QUEUED, State.RETRY_WAIT):
            guard.filter(state=state).update(
                state=State.CANCELLED,
                next_attempt_at=None,
                finished_at=Now(),
                state_version=F("state_version") + 1,
                updated_at=Now(),
            )
            outcome, resolved = CancellationOutcome.CANCELLED, True
        elif state == State.RUNNING:
            guard.filter(state=state).update(
                state=State.CANCELLING, state_version=F("state_version") + 1, updated_at=Now()
            )
            outcome, resolved = CancellationOutcome.CANCELLING, False
        elif state in (State.CANCELLING, State.CANCELLED):
            outcome, resolved = CancellationOutcome.ALREADY_CANCELLED, True
        else:
            outcome, resolved = CancellationOutcome.TOO_LATE, True
        CancellationRequest.objects.create(
            job_id=job_id,
            tenant=tenant,
            actor=actor,
            generation_seen=generation,
            state_seen=state,
            outcome=outcome,
            resolved_at=timezone.now() if resolved else None,
        )
        audit_event_append(
            job_id=job_id,
            event_type="cancel_requested",
            generation=generation,
            actor=actor,
            details={"state_seen": state, "outcome": outcome.value},
            lock_job=False,
        )
    metrics.CANCELLATIONS.labels(outcome=outcome.value).inc()
    if outcome == CancellationOutcome.CANCELLED:
        metrics.CANCELLATION_LATENCY.observe(0.0)
        metrics.TERMINAL.labels(state="cancelled").inc()
    job = ConversionJob.objects.get(id=job_id)
    if outcome == CancellationOutcome.TOO_LATE:
        raise TooLate(job_state=job.state)
    return CancelResult(job=job, outcome=outcome)


def resolve_cancellations_cancelled(*, job_id: uuid.UUID) -> None:
    """The job reached CANCELLED: resolve pending requests and observe their latency.
    Runs inside the transaction that made the transition."""
    now = timezone.now()
    pending = CancellationRequest.objects.filter(job_id=job_id, resolved_at__isnull=True)
    for requested_at in pending.values_list("requested_at", flat=True):
        metrics.CANCELLATION_LATENCY.observe((now - requested_at).total_seconds())
    pending.update(resolved_at=now, outcome=CancellationOutcome.CANCELLED)
