"""Reads. Every selector takes the tenant from the verified token: another tenant's job is
indistinguishable from a missing one."""

from __future__ import annotations

import base64
import uuid
from datetime import datetime

from django.db.models import Q, QuerySet

from conversion_jobs.exceptions import InvalidCursor, NotFound
from conversion_jobs.models import ConversionJob, ExecutionAuditEvent, PageCheckpoint


def conversion_job_get(*, job_id: uuid.UUID, tenant: str) -> ConversionJob:
    job = ConversionJob.objects.filter(id=job_id, tenant=tenant).first()
    if job is None:
        raise NotFound()
    return job


def conversion_job_state_version(*, job_id: uuid.UUID, tenant: str) -> int | None:
    return (
        ConversionJob.objects.filter(id=job_id, tenant=tenant)
        .values_list("state_version", flat=True)
        .first()
    )


def conversion_job_wait_status(
    *, job_id: uuid.UUID, tenant: str
) -> tuple[str, int, int | None, int, int, datetime] | None:
    """What a conditional or waiting read compares: (state, state_version, page total, done,
    failed, updated_at), the columns the job's ETag is made of (representation.py)."""
    return (
        ConversionJob.objects.filter(id=job_id, tenant=tenant)
        .values_list(
            "state",
            "state_version",
            "source_page_count",
            "pages_done",
            "pages_failed",
            "updated_at",
        )
        .first()
    )


def encode_cursor(job: ConversionJob) -> str:
    raw = f"{job.created_at.isoformat()}|{job.id}".encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _decode_cursor(cursor: str) -> tuple[datetime, uuid.UUID]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        created, job_id = raw.split("|")
        return datetime.fromisoformat(created), uuid.UUID(job_id)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidCursor() from exc


def conversion_job_list(
    *, tenant: str, state: str | None, cursor: str | None, limit: int
) -> tuple[list[ConversionJob], str | None]:
    """Newest first; keyset pagination on (created_at, id). Returns (jobs, next cursor)."""
    jobs = ConversionJob.objects.for_tenant(tenant)
    if state:
        jobs = jobs.filter(state=state)
    if cursor:
        created, job_id = _decode_cursor(cursor)
        jobs = jobs.filter(Q(created_at__lt=created) | Q(created_at=created, id__lt=job_id))
    page = list(jobs.order_by("-created_at", "-id")[: limit + 1])
    next_cursor = encode_cursor(page[limit - 1]) if len(page) > limit else None
    return page[:limit], next_cursor


def page_checkpoint_list(*, job_id: uuid.UUID, tenant: str) -> QuerySet[PageCheckpoint]:
    return PageCheckpoint.objects.filter(job_id=job_id, job__tenant=tenant).order_by("page_number")


def audit_event_list(*, job_id: uuid.UUID, tenant: str) -> QuerySet[ExecutionAuditEvent]:
    # Audit events have no foreign key (they outlive their job row): the tenant is checked
    # against the job row, so another tenant's events read as none.
    owned = ConversionJob.objects.filter(id=job_id, tenant=tenant).values("id")
    return ExecutionAuditEvent.objects.filter(job_id__in=owned).order_by("seq")
