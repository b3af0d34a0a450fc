"""The audit chain's statements (``execution_audit_event``, the head on the job row) and the
hash they compute in SQL exactly as :func:`event_hash` computes it in Python.

``hash = sha256(prev_hash || canonical(event))``; the first event of a job chains from 64 zeros.
A statement that appends an event inside a larger one (claim, publish: ``store/jobs.py``) splices
:func:`chain_sql` into its text."""

from __future__ import annotations

import hashlib
import re
import uuid
from datetime import datetime
from typing import Any

from django.db import connection

from conversion_jobs.canonical import canonical_json
from conversion_jobs.models import ConversionJob, ExecutionAuditEvent
from conversion_jobs.store import db

GENESIS = "0" * 64
SYSTEM_ACTOR = "system"


def event_hash(*, prev_hash: str, **event: Any) -> str:
    """An event's link in its chain: ``sha256(prev_hash || event_body(**event))`` in hex (the
    verifier's computation; :func:`chain_sql` is the same in SQL). ``event``: ``event_body``'s
    fields, ``seq`` included."""
    return hashlib.sha256((prev_hash + event_body(**event)).encode()).hexdigest()


#: One append on Postgres: lock the job row (its chain head), move the head, insert the event.
#: ``FOR UPDATE`` in the first CTE returns the newest committed head even after a wait.
APPEND = """
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


def event_append(
    job_id: uuid.UUID,
    event_type: str,
    generation: int | None,
    attempt_id: int | None,
    actor: str,
    details: dict[str, Any],
    created_at: datetime,
) -> int:
    """Append one event to ``job_id``'s chain (``APPEND``; SQLite, whose writers are serialised
    by ``BEGIN IMMEDIATE``: the same three steps from Python). The caller holds the
    transaction. Returns the row count: 1, or 0 when there is no such job."""
    event: dict[str, Any] = {
        "job_id": job_id,
        "event_type": event_type,
        "generation": generation,
        "attempt_id": attempt_id,
        "actor": actor,
        "details": details,
        "created_at": created_at,
    }
    if db.postgres():
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
            prev="h.audit_head", seq="h.audit_seq + 1", body=event_body(**event), params=params
        )
        with connection.cursor() as cursor:
            cursor.execute(APPEND.format(hash=chained), params)
            return int(cursor.rowcount)
    job = ConversionJob.objects.filter(id=job_id)
    head = job.values_list("audit_seq", "audit_head").first()
    if head is None:
        return 0
    seq, prev = head[0] + 1, head[1]
    digest = event_hash(prev_hash=prev, seq=seq, **event)
    job.update(audit_seq=seq, audit_head=digest)
    ExecutionAuditEvent.objects.create(**event, seq=seq, prev_hash=prev, hash=digest)
    return 1


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


def purge_on() -> None:
    """Open the one path the append-only trigger lets delete (docs/DATA_MODEL.md §8), in the
    caller's transaction only (SQLite has no such trigger: nothing to open)."""
    if db.postgres():
        with connection.cursor() as cursor:
            cursor.execute("SET LOCAL quire.audit_purge = 'on'")
