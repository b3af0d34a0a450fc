"""Worker-side transitions (docs/ARCHITECTURE.md §3-§5): claim, fenced writes, final transitions.

Every write made on behalf of an attempt is fenced: it matches the job row on
``(id, generation, lease_token, state)``. Zero rows means "you lost" (the lease expired and the
job was recovered, or it was cancelled): the caller stops and publishes nothing. The moves
themselves live in ``transitions.py``; this module is the worker's vocabulary for them.
"""

from __future__ import annotations

import uuid
from typing import Any

from django.conf import settings
from django.db.models.functions import Now

from conversion_jobs.models import AttemptOutcome, PageCheckpoint
from conversion_jobs.retry_policy import backoff_delay
from conversion_jobs.services import transitions
from conversion_jobs.services.db_retry import db_retry
from conversion_jobs.services.leases import Lease, LeaseLost, fenced
from conversion_jobs.services.transitions import Claim, Result
from conversion_jobs.states import State

__all__ = ["Claim", "Result"]


def conversion_job_claim(*, job_id: uuid.UUID, generation: int, worker: str) -> Claim | None:
    """QUEUED -> RUNNING for this generation (one statement on Postgres). None: a duplicate or
    stale delivery (counted; the caller acks it)."""
    return transitions.claim(job_id=job_id, generation=generation, worker=worker)


def conversion_job_record_page_count(*, lease: Lease, page_count: int) -> None:
    """Fenced: remember how many pages the document has (RUNNING only)."""
    if not fenced(lease).update(source_page_count=page_count, updated_at=Now()):
        raise LeaseLost()


def page_count_record_deferred(lease: Lease, unrecorded: dict[str, int]) -> None:
    """Record a deferred page count (``unrecorded["page_count"]``, taken out of it) before a
    terminal failure or a fan-out (fenced; LeaseLost if lost)."""
    if "page_count" in unrecorded:
        db_retry(
            conversion_job_record_page_count, lease=lease, page_count=unrecorded.pop("page_count")
        )


def conversion_job_publish(
    *,
    lease: Lease,
    state: State,
    result: Result,
    checkpoints: list[PageCheckpoint] | None = None,
) -> bool:
    """RUNNING -> SUCCEEDED | PARTIAL, fenced, with the attempt's last page ``checkpoints``.
    True: this call published the result. False: lost; nothing is written."""
    if state == State.SUCCEEDED:
        return transitions.publish_succeeded(lease=lease, result=result, checkpoints=checkpoints)
    if state == State.PARTIAL:
        return transitions.publish_partial(lease=lease, result=result, checkpoints=checkpoints)
    raise ValueError(f"cannot publish as {state}")


def conversion_job_fail(
    *,
    lease: Lease,
    code: str,
    detail: str = "",
    event_type: str = "failed",
    details: dict[str, Any] | None = None,
) -> bool:
    """RUNNING -> FAILED with a terminal code, fenced (audit ``event_type`` with ``details``,
    by default ``failed`` with the code). False: lost (nothing written)."""
    return transitions.fail(
        lease=lease, code=code, detail=detail, event_type=event_type, details=details
    )


def conversion_job_retry_later(*, lease: Lease, code: str) -> str | None:
    """A retryable error: RUNNING -> FAILED ``attempts_exhausted`` when the budget is spent,
    else RUNNING -> RETRY_WAIT after the backoff. Both guarded; the row counts decide. Returns
    the new state, or None (lost)."""
    details = {"code": code, "attempt": lease.attempt_number}
    if transitions.fail(
        lease=lease,
        code="attempts_exhausted",
        detail=f"last error: {code}",
        retryable=True,
        outcome=AttemptOutcome.RETRYABLE_ERROR,
        attempt_error=code,
        event_type="attempts_exhausted",
        details=details,
        only_if_exhausted=True,
    ):
        return State.FAILED
    delay = backoff_delay(
        attempt=lease.attempt_number,
        base_s=settings.QUIRE["BACKOFF_BASE_S"],
        cap_s=settings.QUIRE["BACKOFF_CAP_S"],
    )
    if transitions.retry_later(lease=lease, code=code, delay=delay):
        return State.RETRY_WAIT
    return None


def conversion_job_finish_cancel(*, lease: Lease) -> bool:
    """CANCELLING -> CANCELLED by the worker that held the lease. False: lost."""
    return transitions.finish_cancel(lease=lease)


def attempt_record_lease_lost(*, lease: Lease) -> None:
    """Bookkeeping on our own attempt row only (the sweep may have closed it already)."""
    transitions.attempt_close(
        lease=lease, outcome=AttemptOutcome.LEASE_LOST, error_code="lease_lost"
    )


def conversion_job_yield(
    *, lease: Lease, traceparent: str, cost: int, error_code: str | None = None
) -> bool:
    """RUNNING -> QUEUED "yielded" (``transitions.yield_slice``). False: lost."""
    return transitions.yield_slice(
        lease=lease, traceparent=traceparent, cost=cost, error_code=error_code
    )
