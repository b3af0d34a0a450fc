"""Database helpers shared by the services."""

from __future__ import annotations

from typing import Any

from django.db import IntegrityError, connection

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


def prepared_cursor() -> Any:
    """A cursor whose statements are prepared once per database connection and then only
    bound and executed: for the few hot statements Postgres would otherwise parse and plan on
    every call (the acceptance's pre-check: ≈ 0.22 ms of planning for 0.02-0.04 ms of
    execution; ADR 0017, session 5). Used like ``connection.cursor()``.

    Postgres only; parameters are bound server-side (typed by psycopg), so a statement must not
    rely on client-side literal rendering. Django's query logging (DEBUG,
    ``CaptureQueriesContext``) needs literal SQL: while it is on, the statements run through the
    ordinary client-side binding cursor, unprepared. Not for a transaction-mode connection
    pooler without prepared-statement support (the reason Django keeps preparation off by
    default; Quire's processes connect directly, OPERABILITY.md)."""
    if connection.vendor != "postgresql" or connection.queries_logged:
        return connection.cursor()
    global _PreparingCursor
    if _PreparingCursor is None:
        from django.db.backends.postgresql.base import ServerBindingCursor

        class PreparingCursor(ServerBindingCursor):  # type: ignore[misc, valid-type]
            def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Any:
                kwargs.setdefault("prepare", True)
                return super().execute(query, params, **kwargs)  # type: ignore[misc]

        _PreparingCursor = PreparingCursor
    connection.close_if_health_check_failed()
    connection.ensure_connection()
    raw = connection.connection
    if raw.prepare_threshold is None:
        # Django turns psycopg's preparation off (None); a threshold never reached turns it on
        # for explicit ``prepare=True`` only. Django's own (client-side binding) cursors never
        # prepare whatever the threshold.
        raw.prepare_threshold = 2**31 - 1
    with connection.wrap_database_errors:
        # what BaseDatabaseWrapper.cursor() does with the cursor it creates
        return connection._prepare_cursor(  # type: ignore[attr-defined]
            _PreparingCursor(raw)
        )


_PreparingCursor: Any = None
