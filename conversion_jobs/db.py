"""Database helpers shared by the services."""

from __future__ import annotations

from django.db import IntegrityError

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
