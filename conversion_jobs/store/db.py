"""The store's connection helpers: which database this is, constraint names on both profiles,
the web's socket health check."""

from __future__ import annotations

import select
from typing import Any

from django.db import IntegrityError, connection


def postgres() -> bool:
    """The production profile's database (else SQLite, the standalone profile). The store's
    one vendor test: its functions run a statement's Postgres text or its twin."""
    return connection.vendor == "postgresql"


# SQLite names the columns, not the constraint: map its message onto our constraint names.
_SQLITE_UNIQUE = {
    "idempotency_record.tenant, idempotency_record.key": "idempotency_tenant_key",
    "conversion_job.tenant, conversion_job.source_sha256": "job_content_identity_live_or_succeeded",
    "conversion_attempt.job_id, conversion_attempt.generation": "attempt_one_per_generation",
    "page_checkpoint.job_id, page_checkpoint.page_number": "page_unique_per_job",
    "execution_audit_event.job_id, execution_audit_event.seq": "audit_seq_per_job",
}


def violated_constraint(exc: IntegrityError) -> str | None:
    """The name of the constraint an IntegrityError is about, on Postgres and SQLite."""
    diag = getattr(exc.__cause__, "diag", None)
    if diag is not None and getattr(diag, "constraint_name", None):
        return str(diag.constraint_name)
    message = str(exc)
    for columns, name in _SQLITE_UNIQUE.items():
        if columns in message:
            return name
    if "CHECK constraint failed:" in message:
        return message.split("CHECK constraint failed:", 1)[1].strip()
    return None


def health_check_by_socket(db: Any) -> None:
    """Before a request's first query: when ``CONN_HEALTH_CHECKS`` would ask an idle Postgres
    connection ``SELECT 1``, look at its socket instead; a socket with nothing to read is the
    open connection it was after its last answer, and the check counts as done.

    A server that restarted or ended the backend (``pg_terminate_backend``, shutdown, crash
    recovery) wrote a FATAL notice and closed the socket, so it is readable: then, or when
    anything else is pending (a notice, a parameter change), Django's own ``SELECT 1`` runs as
    before and a dead connection is replaced before the request's query. A peer that vanished
    without a word is not seen by either check (``SELECT 1`` would wait out the TCP timeout).
    Saves a round trip and the server's parse of ``SELECT 1`` per request (ADR 0017, session
    6); the web's sync requests call it (``conversion_jobs.web.handler``), nothing else
    depends on it."""
    raw = db.connection
    if (
        raw is None
        or db.vendor != "postgresql"
        or not db.health_check_enabled
        or db.health_check_done
        or raw.closed
        or raw.broken
    ):
        return
    poller = select.poll()
    poller.register(raw.fileno(), select.POLLIN | select.POLLPRI)
    if not poller.poll(0):
        db.health_check_done = True
