"""Cancellation (docs/ARCHITECTURE.md §3, API_CONTRACT §2.4). Every call records a
``cancellation_request``.

Cancel and completion race through guarded UPDATEs on the job row (``transitions.py``):
whichever commits first wins, the other matches zero rows. The cancel edges are tried in order
and the row counts decide; only when none moved does a read say why (already cancelled, too
late, or no such job). The request's outcome records what happened.
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

#: The cancel edges, in the order they are tried, with the outcome each one's win means.
_EDGES = (
    (State.QUEUED, transitions.cancel_queued, CancellationOutcome.CANCELLED),
    (State.RETRY_WAIT, transitions.cancel_retry_wait, CancellationOutcome.CANCELLED),
    (State.RUNNING, transitions.cancel_running, CancellationOutcome.CANCELLING),
)


@dataclass(frozen=True)
class CancelResult:
    job: ConversionJob
    outcome: CancellationOutcome


def conversion_job_cancel(*, job_id: uuid.UUID, tenant: str, actor: str) -> CancelResult:
    """QUEUED | RETRY_WAIT -> CANCELLED; RUNNING -> CANCELLING; CANCELLING / CANCELLED -> no
    change (same answer). Raises NotFound (other tenant or missing; nothing recorded) or
    TooLate (a finished job; recorded, result untouched)."""
    with transaction.atomic():
        # Recorded first (unresolved), so the terminal hook of a winning edge resolves it with
        # the others; its seen state and outcome are filled in below.
        job = ConversionJob.objects.filter(id=job_id, tenant=tenant).values_list(
            "state", "generation"
        )
        seen = job.first()
        if seen is None:
            raise NotFound()
        request = CancellationRequest.objects.create(
            job_id=job_id,
            tenant=tenant,
            actor=actor,
            generation_seen=seen[1],
            state_seen=seen[0],
            outcome=CancellationOutcome.CANCELLING,
        )
        state_seen: str
        for source, move, won_outcome in _EDGES:
            generation = move(job_id=job_id, tenant=tenant, actor=actor)
            if generation is not None:
                state_seen, outcome = source.value, won_outcome
                break
        else:
            state_seen, generation = job.get()
            outcome = (
                CancellationOutcome.ALREADY_CANCELLED
                if state_seen in (State.CANCELLING, State.CANCELLED)
                else CancellationOutcome.TOO_LATE
            )
        resolved: dict[str, object] = (
            {} if outcome == CancellationOutcome.CANCELLED else {"outcome": outcome}
        )
        if outcome in (CancellationOutcome.ALREADY_CANCELLED, CancellationOutcome.TOO_LATE):
            resolved["resolved_at"] = timezone.now()
        CancellationRequest.objects.filter(id=request.id).update(
            generation_seen=generation, state_seen=state_seen, **resolved
        )
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
