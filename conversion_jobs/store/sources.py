"""The lock of a stored source (its digest): acceptances that reuse the object take it shared,
its deleters (retention, the orphan sweep) exclusive."""

from __future__ import annotations

from django.db import connection

from conversion_jobs.store import db

#: advisory lock class of source digests ("QRS")
SOURCE_LOCK_CLASS = 0x515253

LOCK_SHARED = "SELECT pg_advisory_xact_lock_shared(%s, %s)"
LOCK_EXCLUSIVE = "SELECT pg_advisory_xact_lock(%s, %s)"


def source_lock(*, sha256: str, exclusive: bool) -> None:
    """Inside a transaction: take the source's lock until it ends (Postgres: a transaction-level
    advisory lock). On SQLite every write transaction already holds the database's single write
    lock (``BEGIN IMMEDIATE``)."""
    if not db.postgres():
        return
    objid = int.from_bytes(bytes.fromhex(sha256[:8]), "big", signed=True)
    with connection.cursor() as cursor:
        cursor.execute(LOCK_EXCLUSIVE if exclusive else LOCK_SHARED, [SOURCE_LOCK_CLASS, objid])
