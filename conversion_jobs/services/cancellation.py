"""Cancellation (docs/ARCHITECTURE.md §3, API_CONTRACT §2.4). Every call records a
``cancellation_request``.

A cancel locks the job row first (``transitions.job_lock_for_choice``) and takes the one edge
the state it holds allows, in the same transaction (docs/ARCHITECTURE.md, "Lock, then
choose"): a job that moves on (retry_wait -> queued, running -> retry_wait) while the cancel
waits for the lock is cancelled from where it went, never answered ``too_late`` while live.
Completion racing the cancel either commits first (the cancel sees a finished job: too late)
or waits on the lock and then matches zero rows. The request's outcome records what happened.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from django.db import transaction
from django.utils import timezone

from conversion_jobs.exceptions import NotFound, TooLate
from conversion_jobs.models import CancellationOutcome, CancellationRequest, ConversionJob
from conversion_jobs.observability import metrics
from conversion_jobs.services import transitions
from conversion_jobs.services.audit import audit_event_append
from conversion_jobs.states import State

#: The cancel edge out of each live state, with the outcome its move means.
_EDGES = {
    State.QUEUED: (transitions.cancel_queued, CancellationOutcome.CANCELLED),
    State.RETRY_WAIT: (transitions.cancel_retry_wait, CancellationOutcome.CANCELLED),
    State.RUNNING: (transitions.cancel_running, CancellationOutcome.CANCELLING),
}


@dataclass(frozen=True)
class CancelResult:
    job: ConversionJob
    outcome: CancellationOutcome


def conversion_job_cancel(*, job_id: uuid.UUID, tenant: str, actor: str) -> CancelResult:
    """QUEUED | RETRY_WAIT -> CANCELLED; RUNNING -> CANCELLING; CANCELLING / CANCELLED -> no
    change (same answer). Raises NotFound (other tenant or missing; nothing recorded) or
    TooLate (a finished job; recorded, result untouched)."""
    with transaction.atomic():
        held = transitions.job_lock_for_choice(job_id=job_id, tenant=tenant)
        if held is None:
            raise NotFound()
        # Recorded first (unresolved), so the terminal hook of the edge resolves it with the
        # others; its outcome is filled in below.
        request = CancellationRequest.objects.create(
            job_id=job_id,
            tenant=tenant,
            actor=actor,
            generation_seen=held.generation,
            state_seen=held.state,
            outcome=CancellationOutcome.CANCELLING,
        )
        state_seen, generation = held.state.value, held.generation
        if held.state in _EDGES:
            move, outcome = _EDGES[held.state]
            transitions.chosen(move(job_id=job_id, tenant=tenant, actor=actor))
        elif held.state in (State.CANCELLING, State.CANCELLED):
            outcome = CancellationOutcome.ALREADY_CANCELLED
        else:
            outcome = CancellationOutcome.TOO_LATE
        resolved: dict[str, object] = (
            {} if outcome == CancellationOutcome.CANCELLED else {"outcome": outcome}
        )
        if outcome in (CancellationOutcome.ALREADY_CANCELLED, CancellationOutcome.TOO_LATE):
            resolved["resolved_at"] = timezone.now()
        if resolved:
            CancellationRequest.objects.filter(id=request.id).update(**resolved)
        audit_event_append(
            job_id=job_id,
            event_type="cancel_requested",
            generation=generation,
            actor=actor,
            details={"state_seen": state_seen, "outcome": outcome.value},
        )
    metrics.CANCELLATIONS.labels(outcome=outcome.value).inc()
    answer = ConversionJob.objects.get(id=job_id)
    if outcome == CancellationOutcome.TOO_LATE:
        raise TooLate(job_state=answer.state)
    return CancelResult(job=answer, outcome=outcome)
