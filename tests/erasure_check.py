"""What is left of a tenant: every table's rows and every stored object that belong to it
(tenant erasure, issue 24 point 4). Used by the integration and e2e tests of the erasure."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from conversion_jobs import storage
from conversion_jobs.models import (
    CancellationRequest,
    ConversionAttempt,
    ConversionJob,
    ConversionOutbox,
    DocumentCrash,
    DocumentQuarantine,
    ExecutionAuditEvent,
    IdempotencyRecord,
    InlineSource,
    PageCheckpoint,
    WorkerLease,
)
from conversion_jobs.webhooks.models import WebhookAttempt, WebhookEndpoint, WebhookMessage


@dataclass
class Footprint:
    """A tenant's ids, taken before its erasure (after it, nothing names them any more)."""

    tenant: str
    jobs: list[Any] = field(default_factory=list)
    endpoints: list[Any] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)


def footprint(tenant: str) -> Footprint:
    jobs = list(ConversionJob.objects.filter(tenant=tenant).values_list("id", "source_key"))
    return Footprint(
        tenant=tenant,
        jobs=[job_id for job_id, _key in jobs],
        endpoints=list(WebhookEndpoint.objects.filter(tenant=tenant).values_list("id", flat=True)),
        sources=sorted({key for _id, key in jobs if not storage.is_inline_source(key)}),
    )


def rows_left(f: Footprint) -> dict[str, int]:
    """Rows of every table that belong to the tenant (all zero once it is erased)."""
    jobs, chains = f.jobs, [*f.jobs, *f.endpoints]
    counts = {
        "conversion_job": ConversionJob.objects.filter(tenant=f.tenant).count(),
        "conversion_job_by_id": ConversionJob.objects.filter(id__in=jobs).count(),
        "conversion_outbox": ConversionOutbox.objects.filter(job_id__in=jobs).count(),
        "conversion_attempt": ConversionAttempt.objects.filter(job_id__in=jobs).count(),
        "worker_lease": WorkerLease.objects.filter(job_id__in=jobs).count(),
        "page_checkpoint": PageCheckpoint.objects.filter(job_id__in=jobs).count(),
        "inline_source": InlineSource.objects.filter(job_id__in=jobs).count(),
        "cancellation_request": CancellationRequest.objects.filter(tenant=f.tenant).count()
        + CancellationRequest.objects.filter(job_id__in=jobs).count(),
        "idempotency_record": IdempotencyRecord.objects.filter(tenant=f.tenant).count(),
        "execution_audit_event": ExecutionAuditEvent.objects.filter(job_id__in=chains).count(),
        "webhook_endpoint": WebhookEndpoint.objects.filter(tenant=f.tenant).count(),
        "webhook_message": WebhookMessage.objects.filter(endpoint_id__in=f.endpoints).count()
        + WebhookMessage.objects.filter(job_id__in=jobs).count(),
        "webhook_attempt": WebhookAttempt.objects.filter(
            message__endpoint_id__in=f.endpoints
        ).count(),
        "document_quarantine": DocumentQuarantine.objects.filter(tenant=f.tenant).count(),
        "document_crash": DocumentCrash.objects.filter(job_id__in=jobs).count(),
    }
    return counts


def objects_left(f: Footprint) -> list[str]:
    """Stored objects of the tenant: its jobs' pages and results, and its sources."""
    left = [
        obj.key
        for job_id in f.jobs
        for area in ("pages", "results")
        for obj in storage.list_objects(f"{area}/{job_id}")
    ]
    left += [key for key in f.sources if storage.exists(key)]
    return left
