"""Append-only audit events with a per-job hash chain.

``hash = sha256(prev_hash || canonical(event))``; the first event of a job chains from 64 zeros.
Appends happen inside the transaction (on the hot paths: inside the statement) that made the
change they record. The chain head is kept on the job row and moved under its lock, so two
appends for one job are serialised and the chain never forks.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from django.db import transaction
from django.utils import timezone

from conversion_jobs.models import ConversionJob, ExecutionAuditEvent
from conversion_jobs.store import audit as store
from conversion_jobs.store.audit import GENESIS, SYSTEM_ACTOR, event_hash


def audit_event_append(
    *,
    job_id: uuid.UUID,
    event_type: str,
    generation: int | None = None,
    attempt_id: int | None = None,
    actor: str = SYSTEM_ACTOR,
    details: dict[str, Any] | None = None,
) -> None:
    """Append one event to ``job_id``'s chain (``store.audit.event_append``). Must run inside a
    transaction.

    The chain head lives on the job row (``audit_seq``, ``audit_head``): the append moves it
    under the row's lock, so two appends for one job are serialised and the chain never forks.
    ``details`` must be metadata only: codes, counts, page numbers, durations; never content,
    file names, tokens or clear tenant/subject identifiers.
    """
    if not transaction.get_connection().in_atomic_block:
        raise RuntimeError("audit_event_append must run inside transaction.atomic()")
    event = (job_id, event_type, generation, attempt_id, actor, details or {}, timezone.now())
    if store.event_append(*event) != 1:
        raise ConversionJob.DoesNotExist(f"no job row to chain event {event_type!r} on")


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
        recomputed = event_hash(
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
