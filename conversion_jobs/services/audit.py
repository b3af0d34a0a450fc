"""Append-only audit events with a per-job hash chain.

``hash = sha256(prev_hash || canonical(event))``; the first event of a job chains from 64 zeros.
Appends happen inside the transaction that made the change they record. They lock the job row
first (most callers already hold it through their guarded UPDATE), so two appends for one job
are serialised and the chain never forks.
"""

from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import transaction
from django.utils import timezone

from conversion_jobs.models import ConversionJob, ExecutionAuditEvent
from conversion_jobs.options import canonical_json

GENESIS = "0" * 64
SYSTEM_ACTOR = "system"


def _event_hash(
    *,
    prev_hash: str,
    job_id: uuid.UUID,
    seq: int,
    event_type: str,
    generation: int | None,
    attempt_id: int | None,
    actor: str,
    details: dict[str, Any],
    created_at: datetime,
) -> str:
    body = canonical_json(
        {
            "job": str(job_id),
            "seq": seq,
            "type": event_type,
            "generation": generation,
            "attempt": attempt_id,
            "actor": actor,
            "details": details,
            "at": created_at.isoformat(timespec="microseconds"),
        }
    )
    return hashlib.sha256((prev_hash + body).encode()).hexdigest()


def audit_event_append(
    *,
    job_id: uuid.UUID,
    event_type: str,
    generation: int | None = None,
    attempt_id: int | None = None,
    actor: str = SYSTEM_ACTOR,
    details: dict[str, Any] | None = None,
    lock_job: bool = True,
    first: bool = False,
) -> ExecutionAuditEvent:
    """Append one event to ``job_id``'s chain. Must run inside a transaction.

    ``first=True`` skips the look-up of the previous event for a job created in this
    transaction. ``details`` must be metadata only: codes, counts, page numbers, durations;
    never content, file names, tokens or clear tenant/subject identifiers.
    """
    if not transaction.get_connection().in_atomic_block:
        raise RuntimeError("audit_event_append must run inside transaction.atomic()")
    if lock_job:
        list(ConversionJob.objects.select_for_update().filter(id=job_id).values_list("id"))
    # ``first``: the caller just created the job, so the chain is empty (the unique
    # (job_id, seq) constraint would reject a second "first" event anyway).
    last = (
        None
        if first
        else ExecutionAuditEvent.objects.filter(job_id=job_id)
        .order_by("-seq")
        .values_list("seq", "hash")
        .first()
    )
    seq, prev = (last[0] + 1, last[1]) if last else (1, GENESIS)
    fields: dict[str, Any] = {
        "job_id": job_id,
        "seq": seq,
        "event_type": event_type,
        "generation": generation,
        "attempt_id": attempt_id,
        "actor": actor,
        "details": details or {},
        "created_at": timezone.now(),
    }
    return ExecutionAuditEvent.objects.create(
        **fields, prev_hash=prev, hash=_event_hash(prev_hash=prev, **fields)
    )


@dataclass(frozen=True)
class ChainBreak:
    job_id: uuid.UUID
    event_id: int
    seq: int
    reason: str


def audit_chain_verify(*, job_id: uuid.UUID | None = None) -> tuple[int, list[ChainBreak]]:
    """Walk every chain (or one job's). Returns (events checked, breaks found)."""
    events = ExecutionAuditEvent.objects.order_by("job_id", "seq")
    if job_id is not None:
        events = events.filter(job_id=job_id)
    breaks: list[ChainBreak] = []
    checked = 0
    current_job: uuid.UUID | None = None
    prev = GENESIS
    expected_seq = 1
    for event in events.iterator(chunk_size=2000):
        checked += 1
        if event.job_id != current_job:
            current_job, prev, expected_seq = event.job_id, GENESIS, 1
            # Retention may purge a chain's head; the chain then restarts at the first kept event.
            if event.seq != 1:
                prev, expected_seq = event.prev_hash, event.seq
        if event.seq != expected_seq:
            breaks.append(ChainBreak(event.job_id, event.id, event.seq, "sequence gap"))
        if event.prev_hash != prev:
            breaks.append(ChainBreak(event.job_id, event.id, event.seq, "prev_hash mismatch"))
        recomputed = _event_hash(
            prev_hash=event.prev_hash,
            job_id=event.job_id,
            seq=event.seq,
            event_type=event.event_type,
            generation=event.generation,
            attempt_id=event.attempt_id,
            actor=event.actor,
            details=event.details,
            created_at=event.created_at,
        )
        if recomputed != event.hash:
            breaks.append(ChainBreak(event.job_id, event.id, event.seq, "hash mismatch"))
        prev, expected_seq = event.hash, event.seq + 1
    return checked, breaks
