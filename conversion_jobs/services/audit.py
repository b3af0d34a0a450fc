"""Append-only audit events with a per-job hash chain.

``hash = sha256(prev_hash || canonical(event))``; the first event of a job chains from 64 zeros.
Appends happen inside the transaction (on the hot paths: inside the statement) that made the
change they record. The chain head is kept on the job row and moved under its lock, so two
appends for one job are serialised and the chain never forks.
"""

from __future__ import annotations

import hashlib
import re
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import connection, transaction
from django.utils import timezone

from conversion_jobs.models import ConversionJob, ExecutionAuditEvent
from conversion_jobs.options import canonical_json

GENESIS = "0" * 64
SYSTEM_ACTOR = "system"


def event_hash(
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
    body = event_body(
        job_id=job_id,
        seq=seq,
        event_type=event_type,
        generation=generation,
        attempt_id=attempt_id,
        actor=actor,
        details=details,
        created_at=created_at,
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
) -> None:
    """Append one event to ``job_id``'s chain. Must run inside a transaction.

    The chain head lives on the job row (``audit_seq``, ``audit_head``): the append moves it
    under the row's lock, so two appends for one job are serialised and the chain never forks.
    On Postgres the append is one statement (``_APPEND_SQL``); on SQLite (whose writers are
    serialised by ``BEGIN IMMEDIATE``) it is the same three steps from Python. ``details`` must
    be metadata only: codes, counts, page numbers, durations; never content, file names, tokens
    or clear tenant/subject identifiers.
    """
    if not transaction.get_connection().in_atomic_block:
        raise RuntimeError("audit_event_append must run inside transaction.atomic()")
    created_at = timezone.now()
    details = details or {}
    if connection.vendor == "postgresql":
        params: dict[str, Any] = {
            "job": job_id,
            "type": event_type,
            "generation": generation,
            "attempt": attempt_id,
            "actor": actor,
            "details": canonical_json(details),
            "at": created_at,
        }
        chained = chain_sql(
            prev="h.audit_head",
            seq="h.audit_seq + 1",
            body=event_body(
                job_id=job_id,
                event_type=event_type,
                generation=generation,
                attempt_id=attempt_id,
                actor=actor,
                details=details,
                created_at=created_at,
            ),
            params=params,
        )
        with connection.cursor() as cursor:
            cursor.execute(_APPEND_SQL.format(hash=chained), params)
            if cursor.rowcount != 1:
                raise ConversionJob.DoesNotExist(f"no job row to chain event {event_type!r} on")
        return
    job = ConversionJob.objects.filter(id=job_id)
    head = job.values_list("audit_seq", "audit_head").first()
    if head is None:
        raise ConversionJob.DoesNotExist(f"no job row to chain event {event_type!r} on")
    seq, prev = head[0] + 1, head[1]
    fields: dict[str, Any] = {
        "job_id": job_id,
        "seq": seq,
        "event_type": event_type,
        "generation": generation,
        "attempt_id": attempt_id,
        "actor": actor,
        "details": details,
        "created_at": created_at,
    }
    digest = event_hash(prev_hash=prev, **fields)
    job.update(audit_seq=seq, audit_head=digest)
    ExecutionAuditEvent.objects.create(**fields, prev_hash=prev, hash=digest)


#: One append on Postgres: lock the job row (its chain head), move the head, insert the event.
#: ``FOR UPDATE`` in the first CTE returns the newest committed head even after a wait.
_APPEND_SQL = """
WITH h AS (
    SELECT id, audit_seq, audit_head FROM conversion_job WHERE id = %(job)s FOR UPDATE
), head AS (
    UPDATE conversion_job j SET audit_seq = h.audit_seq + 1, audit_head = {hash}
    FROM h WHERE j.id = h.id
    RETURNING j.audit_seq AS seq, j.audit_head AS hash, h.audit_head AS prev
)
INSERT INTO execution_audit_event
    (job_id, seq, event_type, generation, attempt_id, actor, details, created_at, prev_hash, hash)
SELECT %(job)s, seq, %(type)s, %(generation)s, %(attempt)s, %(actor)s, %(details)s::jsonb,
       %(at)s, prev, hash
FROM head
"""

#: Placeholder for a value only the statement knows (the next seq, a new attempt id, ...).
_SLOT = re.compile(r'"@@quire:(\w+)@@"')


def slot(name: str) -> str:
    """A value of the event body that SQL fills in (see :func:`chain_sql`)."""
    return f"@@quire:{name}@@"


def event_body(
    *,
    job_id: uuid.UUID,
    event_type: str,
    generation: int | str | None,
    attempt_id: int | str | None,
    actor: str,
    details: dict[str, Any],
    created_at: datetime,
    seq: int | str | None = None,
) -> str:
    """The canonical JSON an event's hash covers (``seq`` defaults to a SQL slot)."""
    return canonical_json(
        {
            "job": str(job_id),
            "seq": slot("seq") if seq is None else seq,
            "type": event_type,
            "generation": generation,
            "attempt": attempt_id,
            "actor": actor,
            "details": details,
            "at": created_at.isoformat(timespec="microseconds"),
        }
    )


def spliced_sql(template: str, *, exprs: dict[str, str], params: dict[str, Any]) -> str:
    """A SQL text expression equal to ``template`` with each slot replaced by its SQL
    expression's text (an integer's text is its JSON). The literal pieces become parameters."""
    pieces = _SLOT.split(template)
    out: list[str] = []
    for index, piece in enumerate(pieces):
        if index % 2:
            out.append(f"({exprs[piece]})::text")
        else:
            name = f"_lit{len(params)}"
            params[name] = piece
            out.append(f"%({name})s::text")
    return " || ".join(out)


def chain_sql(
    *, prev: str, seq: str, body: str, params: dict[str, Any], exprs: dict[str, str] | None = None
) -> str:
    """The SQL expression of an event's hash, ``sha256(prev || body)`` in hex, exactly as
    :func:`event_hash` computes it in Python (the verifier), for a statement that knows the
    chain head (``prev``, ``seq``) only when it runs."""
    body_sql = spliced_sql(body, exprs={"seq": seq, **(exprs or {})}, params=params)
    return f"encode(sha256(convert_to(({prev}) || {body_sql}, 'UTF8')), 'hex')"


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
