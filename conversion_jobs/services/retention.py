"""Retention (issue 6): expire results and sources after configured ages, prune published
outbox rows and finished webhook messages, and purge whole audit chains past their own
retention.

Rows first, files second: a job is marked ``expired_at`` (its page rows deleted, an ``expired``
audit event appended) in one transaction; its files are deleted afterwards and ``purged_at``
set. A crash between the two leaves ``expired_at`` set and ``purged_at`` empty, and the next
sweep finishes the file deletion. Readers never see a row that points at a deleted file as
servable, because the API refuses anything with ``expired_at`` set.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Max
from django.db.models.functions import Now
from django.utils import timezone

from conversion_jobs import storage
from conversion_jobs.models import (
    ConversionJob,
    ConversionOutbox,
    ExecutionAuditEvent,
    InlineSource,
    PageCheckpoint,
)
from conversion_jobs.observability import metrics
from conversion_jobs.services.artifacts import source_delete_if_unused
from conversion_jobs.services.audit import audit_event_append
from conversion_jobs.states import TERMINAL_STATES
from conversion_jobs.store import audit as audit_store
from conversion_jobs.webhooks.models import MessageState, WebhookAttempt, WebhookMessage

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetentionResult:
    outbox_pruned: int = 0
    jobs_expired: int = 0
    jobs_purged: int = 0
    audit_events_purged: int = 0
    webhook_messages_pruned: int = 0


def _ago(key: str) -> datetime:
    return timezone.now() - timedelta(seconds=float(settings.QUIRE[key]))


def outbox_rows_prune_published(*, batch: int) -> int:
    cutoff = _ago("OUTBOX_RETENTION_S")
    ids = list(
        ConversionOutbox.objects.filter(published_at__lt=cutoff).values_list("id", flat=True)[
            :batch
        ]
    )
    return ConversionOutbox.objects.filter(id__in=ids).delete()[0] if ids else 0


def conversion_jobs_expire_if_past_retention(*, batch: int) -> int:
    """Terminal jobs finished before the cutoff: mark expired, drop page rows, audit it."""
    cutoff = _ago("RESULT_RETENTION_S")
    expired = 0
    with transaction.atomic():
        due = list(
            ConversionJob.objects.select_for_update(skip_locked=True)
            .filter(
                finished_at__lt=cutoff, expired_at__isnull=True, state__in=list(TERMINAL_STATES)
            )
            .values_list("id", "generation")[:batch]
        )
        for job_id, generation in due:
            if not ConversionJob.objects.filter(id=job_id, expired_at__isnull=True).update(
                expired_at=Now(), updated_at=Now()
            ):
                continue
            pages = PageCheckpoint.objects.filter(job_id=job_id).delete()[0]
            audit_event_append(
                job_id=job_id,
                event_type="expired",
                generation=generation,
                details={"page_rows": pages},
            )
            expired += 1
    return expired


def conversion_jobs_purge_files_if_expired(*, batch: int) -> int:
    """Delete the files of expired jobs (and an inline source's row), then record
    ``purged_at``. Idempotent."""
    purged = 0
    jobs = list(
        ConversionJob.objects.filter(expired_at__isnull=False, purged_at__isnull=True).values_list(
            "id", "source_key", "source_sha256"
        )[:batch]
    )
    for job_id, source_key, sha in jobs:
        storage.delete_prefix(f"results/{job_id}")
        storage.delete_prefix(f"pages/{job_id}")
        if storage.is_inline_source(source_key):
            # The job's own copy (never shared): the row goes, the job row stays for its audit.
            InlineSource.objects.filter(job_id=job_id).delete()
        else:
            # Sources are content-addressed and shared: delete only when no unexpired job
            # uses it.
            source_delete_if_unused(sha256=sha, key=source_key, live_only=True)
        purged += ConversionJob.objects.filter(id=job_id, purged_at__isnull=True).update(
            purged_at=Now()
        )
    return purged


def webhook_messages_prune_finished(*, batch: int) -> int:
    """Delivered and failed webhook messages created before ``QUIRE_WEBHOOK_RETENTION_S``, with
    their attempts (a pending one stays, however old: it is still owed)."""
    cutoff = _ago("WEBHOOK_RETENTION_S")
    ids = list(
        WebhookMessage.objects.filter(created_at__lt=cutoff)
        .exclude(state=MessageState.PENDING)
        .values_list("id", flat=True)[:batch]
    )
    if not ids:
        return 0
    with transaction.atomic():
        WebhookAttempt.objects.filter(message_id__in=ids).delete()
        return int(WebhookMessage.objects.filter(id__in=ids).delete()[0])


def audit_chains_purge_if_past_retention(*, batch: int) -> int:
    """Whole chains only (a job's newest event older than the cutoff), through the one audited
    path the append-only trigger allows."""
    cutoff = _ago("AUDIT_RETENTION_S")
    job_ids = list(
        ExecutionAuditEvent.objects.values("job_id")
        .annotate(newest=Max("created_at"))
        .filter(newest__lt=cutoff)
        .values_list("job_id", flat=True)[:batch]
    )
    if not job_ids:
        return 0
    with transaction.atomic():
        audit_store.purge_on()
        deleted = ExecutionAuditEvent.objects.filter(job_id__in=job_ids).delete()[0]
    log.info("audit chains purged", extra={"chains": len(job_ids), "events": deleted})
    return int(deleted)


def retention_apply(*, batch: int | None = None) -> RetentionResult:
    batch = batch or settings.QUIRE["SWEEP_BATCH"]
    result = RetentionResult(
        outbox_pruned=outbox_rows_prune_published(batch=batch),
        jobs_expired=conversion_jobs_expire_if_past_retention(batch=batch),
        jobs_purged=conversion_jobs_purge_files_if_expired(batch=batch),
        audit_events_purged=audit_chains_purge_if_past_retention(batch=batch),
        webhook_messages_pruned=webhook_messages_prune_finished(batch=batch),
    )
    metrics.RETENTION_PURGES.labels(kind="outbox_rows").inc(result.outbox_pruned)
    metrics.RETENTION_PURGES.labels(kind="jobs_expired").inc(result.jobs_expired)
    metrics.RETENTION_PURGES.labels(kind="jobs_purged").inc(result.jobs_purged)
    metrics.RETENTION_PURGES.labels(kind="audit_events").inc(result.audit_events_purged)
    metrics.RETENTION_PURGES.labels(kind="webhook_messages").inc(result.webhook_messages_pruned)
    return result
