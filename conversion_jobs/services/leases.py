"""What a worker holds while it runs an attempt, and the fenced reads and writes made under it
(docs/ARCHITECTURE.md §4). A fenced statement matches the job row on ``(id, generation, lease_token,
state)``; zero rows means the lease is gone (expired and recovered, or the job was cancelled).
The predicate and the statements are the store's (``store/leases.py``)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from conversion_jobs.states import State
from conversion_jobs.store import leases as store


@dataclass(frozen=True)
class Lease:
    """What a worker holds while it runs one generation of one job."""

    job_id: uuid.UUID
    generation: int
    token: uuid.UUID
    #: None only for the repair sweep's stand-in lease of a job with no attempt row
    #: (``recovery.conversion_jobs_repair_if_leaseless``)
    attempt_id: int | None
    attempt_number: int
    #: The attempt's start (for its duration metric); None when a sweep acts on a lease row.
    started_at: datetime | None

    @property
    def first_run(self) -> bool:
        """The job's very first attempt: no page can have a checkpoint yet."""
        return self.generation == 1 and self.attempt_number == 1


@dataclass(frozen=True)
class RangeLease:
    """What a worker holds while it runs one generation of one page range of a fanned-out job
    (``job_range``, ADR 0023); its writes are fenced on this and on the job's ``Lease``."""

    range_id: int
    job_id: uuid.UUID
    first_page: int
    last_page: int
    generation: int
    token: uuid.UUID


class LeaseLost(Exception):
    """A fenced write matched no row: the lease is gone (expired, recovered, or cancelled)."""


def lease_ttl() -> timedelta:
    return timedelta(seconds=settings.QUIRE["LEASE_S"])


def fenced(lease: Lease, *states: State) -> Any:
    """The job row under ``lease`` in one of ``states`` (default: running)."""
    return store.held(lease, *(states or (State.RUNNING,)))


class HeartbeatResult:
    OK = "ok"
    CANCELLING = "cancelling"
    LOST = "lost"


def lease_heartbeat(*, lease: Lease) -> str:
    """Extend the lease if it is still ours and unexpired. Returns OK, CANCELLING (still ours,
    but the job must stop and end cancelled) or LOST."""
    now = timezone.now()
    with transaction.atomic():
        if not store.lease_extend(lease, now=now, expires=now + lease_ttl()):
            return HeartbeatResult.LOST
        state = store.state_under(lease)
    # The attempt's heartbeat_at (informational) in its own statement: a transaction that held
    # the lease row and then wanted the attempt row deadlocked with a publish that held the job
    # and the attempt and wanted the lease (seen in CI). Holding one row lock at a time, the
    # heartbeat can be in no lock cycle.
    if lease.attempt_id is not None:  # always, for a worker's lease
        store.attempt_heartbeat(lease.attempt_id, now=now)
    if state == State.RUNNING:
        return HeartbeatResult.OK
    if state == State.CANCELLING:
        return HeartbeatResult.CANCELLING
    return HeartbeatResult.LOST


def job_state_under_lease(*, lease: Lease) -> str | None:
    """The job's state if this lease still holds it, else None."""
    return store.state_under(lease)
