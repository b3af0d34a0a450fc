"""The fair relay's gate (docs/ARCHITECTURE.md §2b, ADR 0021 "Idle latency: the gated fast
path"): what a worker's claim of a *gated* message - one sent before its unit was picked - does
when it finds no pick's mark on the job."""

from __future__ import annotations

import uuid

from django.db import connection

from conversion_jobs.models import ConversionOutbox
from conversion_jobs.store import db

#: The key of the advisory lock ``quire_fair_pick`` takes (migrations 0017-0019): one picker at
#: a time; a gated claim takes it shared to wait for a pick in progress.
PICK_LOCK = 7102421
#: ``conversion_outbox.last_error_code`` of a waiting unit whose gated message was refused;
#: ``quire_fair_pick`` returns it as ``out_refused``.
GATE_REFUSED = "gate_refused"


def gate_supported() -> bool:
    """Gated messages need the pick's advisory lock: Postgres only."""
    return db.postgres()


def pick_wait() -> None:
    """Inside the caller's transaction: wait until no pick is in progress, and keep any from
    starting until the caller commits (the pick's advisory lock, shared). SQLite: nothing (its
    transactions hold the database's one write lock, and no gated message is sent there)."""
    if db.postgres():
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock_shared(%s)", [PICK_LOCK])


def gate_refuse(*, outbox_id: int, job_id: uuid.UUID, generation: int) -> int:
    """Record on the unit's waiting row that its gated message was refused (no pick had marked
    it): the pick that later chooses it says so, and its publisher sends the unit again. Row
    count: 0 when the row is no longer waiting (a pick marked it meanwhile) or is another job's."""
    return int(
        ConversionOutbox.objects.filter(
            id=outbox_id, job_id=job_id, generation=generation, published_at__isnull=True
        ).update(last_error_code=GATE_REFUSED)
    )
