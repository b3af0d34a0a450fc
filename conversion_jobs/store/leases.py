"""The fencing predicate and the statements a lease holder runs (docs/ARCHITECTURE.md §4).

A fenced statement matches the job row on ``(id, generation, lease_token)`` and the state it
must still be in; zero rows means the lease is gone (expired and recovered, or the job was
cancelled). ``FENCE`` is that predicate in SQL (``store/jobs.py``'s publish,
``store/checkpoints.py``'s batch) and :func:`held` its ORM twin: the one place it is written."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any, Protocol

from django.db.models import QuerySet

from conversion_jobs.models import (
    ConversionAttempt,
    ConversionJob,
    JobRange,
    RangeState,
    WorkerLease,
)
from conversion_jobs.states import State


class Fence(Protocol):
    """What fences a write: the job, its generation, the lease token (``services.leases.Lease``)."""

    @property
    def job_id(self) -> uuid.UUID: ...

    @property
    def generation(self) -> int: ...

    @property
    def token(self) -> uuid.UUID: ...


class RangeFence(Protocol):
    """A page range's fence (``services.leases.RangeLease``)."""

    @property
    def range_id(self) -> int: ...

    @property
    def generation(self) -> int: ...

    @property
    def token(self) -> uuid.UUID: ...


#: The fencing predicate over ``conversion_job``, with ``fence_params``'s parameters.
FENCE = "id = %(job)s AND generation = %(generation)s AND lease_token = %(token)s"


def fence_params(fence: Fence) -> dict[str, Any]:
    """``FENCE``'s parameters."""
    return {"job": fence.job_id, "generation": fence.generation, "token": fence.token}


def held(fence: Fence, *states: State) -> QuerySet[ConversionJob]:
    """``FENCE`` as a queryset: the job row under ``fence`` (in one of ``states``, when given)."""
    jobs = ConversionJob.objects.filter(
        id=fence.job_id, generation=fence.generation, lease_token=fence.token
    )
    return jobs.filter(state__in=list(states)) if states else jobs


def lease_extend(fence: Fence, *, now: datetime, expires: datetime) -> int:
    """The lease row's expiry moved to ``expires`` if it is still ``fence``'s and unexpired at
    ``now``. Row count: 1 extended, 0 lost."""
    return int(
        WorkerLease.objects.filter(
            job_id=fence.job_id, token=fence.token, generation=fence.generation, expires_at__gt=now
        ).update(expires_at=expires)
    )


def state_under(fence: Fence) -> str | None:
    """The job's state while ``fence`` holds it, else None."""
    return held(fence).values_list("state", flat=True).first()


def attempt_heartbeat(attempt_id: int, *, now: datetime) -> int:
    """The open attempt's ``heartbeat_at`` (informational). Row count: 0 once it closed."""
    return int(
        ConversionAttempt.objects.filter(id=attempt_id, finished_at__isnull=True).update(
            heartbeat_at=now
        )
    )


def lease_delete(fence: Fence) -> int:
    """The lease row goes (a lease of the same job under another token stays)."""
    return int(WorkerLease.objects.filter(job_id=fence.job_id, token=fence.token).delete()[0])


def job_row_lock(fence: Fence, *states: State) -> bool:
    """Lock the job row under ``fence`` in one of ``states`` (``FOR NO KEY UPDATE``; SQLite: the
    transaction's write lock). False: the job is not held under it."""
    locked = held(fence, *states).select_for_update(no_key=True).values_list("id", flat=True)
    return locked.first() is not None


def range_row_lock(fence: RangeFence) -> bool:
    """Lock the range row under ``fence`` (after its job row). False: the range is not held
    under it (recovered: a new generation; or no longer running)."""
    return (
        JobRange.objects.select_for_update(no_key=True)
        .filter(
            id=fence.range_id,
            generation=fence.generation,
            lease_token=fence.token,
            state=RangeState.RUNNING,
        )
        .values_list("id", flat=True)
        .first()
        is not None
    )
