"""Tenant erasure (issue 24 point 4; docs/OPERABILITY.md "Tenant erasure").

``manage.py erase_tenant`` and ``POST /api/v1/erasures`` (scope ``tenants:erase``) run
:func:`tenant_erase`. Rows first, objects second, each step resumable after a crash at any point
and idempotent, as retention is (``services/retention.py``):

1. ``cancel``: every live job of the tenant is cancelled through the cancel edges
   (``services/cancellation.py``: queued / retry_wait -> cancelled, running -> cancelling); the
   step ends once no job of the tenant is live (a cancelling job's worker stopped at its next
   page or heartbeat, or the lease sweep ended it), so no worker writes an object after step 3.
2. ``rows``: per batch of jobs, one transaction: the objects those rows name are written down
   (``erasure_object``), the jobs' audit chains are deleted the way retention purges them
   (``quire.audit_purge``), then the job rows with every row that hangs off them (outbox,
   attempts, leases, checkpoints, cancellations, idempotency records, inline sources); then the
   tenant's webhook endpoints (their messages, delivery attempts and audit chains) and its
   quarantine rows. A kill between two batches leaves whole batches: the next run goes on.
3. ``objects``: each written-down object is deleted (a job's ``results/`` and ``pages/``; a
   source only when no other job names its digest: sources are content-addressed and may be
   another tenant's too), then its row. Deleting what is gone already deletes nothing.
4. ``done``: a job accepted meanwhile sends the erasure back to step 1; otherwise
   ``finished_at`` is set.

The record (``tenant_erasure``) names the tenant only by its pseudonym, and keeps the counts,
the times and the pseudonymous actor. An unfinished record is the one a new run resumes.
"""

from __future__ import annotations

import logging
import time

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import F
from django.utils import timezone

from conversion_jobs import storage
from conversion_jobs.exceptions import NotFound, TooLate
from conversion_jobs.models import (
    ConversionJob,
    DocumentQuarantine,
    ErasureObject,
    ExecutionAuditEvent,
    TenantErasure,
)
from conversion_jobs.observability import metrics
from conversion_jobs.pseudonym import pseudonym
from conversion_jobs.services.artifacts import source_delete_if_unused
from conversion_jobs.services.cancellation import conversion_job_cancel
from conversion_jobs.states import LIVE_STATES
from conversion_jobs.store import audit as audit_store
from conversion_jobs.webhooks.models import WebhookEndpoint

log = logging.getLogger(__name__)

#: Jobs per transaction of the rows step.
BATCH = 200


def _open_record(*, tenant_pseudonym: str, actor: str) -> TenantErasure:
    """The tenant's unfinished erasure, or a new one (two runners at once: one row, by the
    partial unique constraint)."""
    found = TenantErasure.objects.filter(
        tenant_pseudonym=tenant_pseudonym, finished_at__isnull=True
    ).first()
    if found is not None:
        return found
    now = timezone.now()
    try:
        with transaction.atomic():
            return TenantErasure.objects.create(
                tenant_pseudonym=tenant_pseudonym, actor=actor, started_at=now, updated_at=now
            )
    except IntegrityError:
        return TenantErasure.objects.get(tenant_pseudonym=tenant_pseudonym, finished_at=None)


def _has_rows(tenant: str) -> bool:
    return (
        ConversionJob.objects.filter(tenant=tenant).exists()
        or WebhookEndpoint.objects.filter(tenant=tenant).exists()
        or DocumentQuarantine.objects.filter(tenant=tenant).exists()
    )


def _advance(record: TenantErasure, step: str, **counts: int) -> None:
    TenantErasure.objects.filter(id=record.id).update(
        step=step, updated_at=timezone.now(), **{k: F(k) + v for k, v in counts.items()}
    )
    record.step = step


def tenant_erase(*, tenant: str, actor: str, deadline_s: float | None = None) -> TenantErasure:
    """Erase ``tenant`` (steps above), resuming its unfinished erasure if there is one. With
    ``deadline_s`` (the API) it stops after about that long and returns the record still
    unfinished: call again to go on. A tenant with nothing left and a finished erasure gets that
    record back (nothing new is written). Returns the record as it now stands."""
    tenant_pseudonym = pseudonym("tenant", tenant)
    if not _has_rows(tenant):
        latest = (
            TenantErasure.objects.filter(tenant_pseudonym=tenant_pseudonym)
            .order_by("-started_at")
            .first()
        )
        if latest is not None and latest.finished_at is not None:
            return latest
    record = _open_record(tenant_pseudonym=tenant_pseudonym, actor=actor)
    TenantErasure.objects.filter(id=record.id).update(runs=F("runs") + 1)
    stop_at = None if deadline_s is None else time.monotonic() + deadline_s
    while True:
        if record.step == "cancel":
            if not _cancel_live(record=record, tenant=tenant, actor=actor, stop_at=stop_at):
                break
            _advance(record, "rows")
        if record.step == "rows":
            if not _delete_rows(record=record, tenant=tenant, stop_at=stop_at):
                break
            _advance(record, "objects")
        if record.step == "objects":
            if not _delete_objects(record=record, stop_at=stop_at):
                break
            if ConversionJob.objects.filter(tenant=tenant).exists():
                _advance(record, "cancel")  # accepted meanwhile: once more from the start
                continue
            TenantErasure.objects.filter(id=record.id).update(
                step="done", finished_at=timezone.now(), updated_at=timezone.now()
            )
            metrics.TENANT_ERASURES.inc()
            log.info("tenant erased", extra={"erasure": record.id, "tenant": tenant_pseudonym})
        break
    record.refresh_from_db()
    return record


def _over(stop_at: float | None) -> bool:
    return stop_at is not None and time.monotonic() > stop_at


def _cancel_live(*, record: TenantErasure, tenant: str, actor: str, stop_at: float | None) -> bool:
    """Cancel every live job, then wait until none is leased. False: stopped before (deadline,
    or ``QUIRE_ERASURE_CANCEL_WAIT_S`` passed with a job still leased)."""
    live = list(
        ConversionJob.objects.filter(tenant=tenant, state__in=list(LIVE_STATES)).values_list(
            "id", flat=True
        )
    )
    cancelled = 0
    for job_id in live:
        try:
            result = conversion_job_cancel(job_id=job_id, tenant=tenant, actor=actor)
        except (TooLate, NotFound):
            continue  # it finished (or went) meanwhile: nothing to cancel
        cancelled += result.outcome in ("cancelled", "cancelling")
        if _over(stop_at):
            break
    if cancelled:
        _advance(record, "cancel", jobs_cancelled=cancelled)
    wait_until = time.monotonic() + float(settings.QUIRE["ERASURE_CANCEL_WAIT_S"])
    while ConversionJob.objects.filter(tenant=tenant, state__in=list(LIVE_STATES)).exists():
        if _over(stop_at) or time.monotonic() > wait_until:
            return False
        # A job accepted since the list above: cancel it too (cancel is idempotent).
        for job_id in ConversionJob.objects.filter(
            tenant=tenant, state__in=list(LIVE_STATES)
        ).values_list("id", flat=True):
            try:
                conversion_job_cancel(job_id=job_id, tenant=tenant, actor=actor)
            except (TooLate, NotFound):
                pass
        time.sleep(0.2)
    return True


def _delete_rows(*, record: TenantErasure, tenant: str, stop_at: float | None) -> bool:
    """The tenant's rows, a batch of jobs per transaction (their objects written down first);
    then its webhook endpoints and quarantine rows. False: stopped at the deadline."""
    while True:
        with transaction.atomic():
            jobs = list(
                ConversionJob.objects.select_for_update()
                .filter(tenant=tenant)
                .values_list("id", "source_key", "source_sha256")[:BATCH]
            )
            if not jobs:
                break
            ids = [job_id for job_id, _key, _sha in jobs]
            todo = [
                ErasureObject(erasure_id=record.id, kind="prefix", key=f"{area}/{job_id}")
                for job_id in ids
                for area in ("results", "pages")
            ]
            sources = {(key, sha) for _id, key, sha in jobs if not storage.is_inline_source(key)}
            todo += [
                ErasureObject(erasure_id=record.id, kind="source", key=key)
                for key, _sha in sorted(sources)
            ]
            ErasureObject.objects.bulk_create(todo)
            audit_store.purge_on()
            events = ExecutionAuditEvent.objects.filter(job_id__in=ids).delete()[0]
            deleted, _by_model = ConversionJob.objects.filter(id__in=ids).delete()
            _advance(
                record,
                "rows",
                jobs_deleted=len(ids),
                rows_deleted=deleted - len(ids),
                audit_events_deleted=events,
            )
        if _over(stop_at):
            return False
    with transaction.atomic():
        endpoints = list(
            WebhookEndpoint.objects.select_for_update()
            .filter(tenant=tenant)
            .values_list("id", flat=True)
        )
        audit_store.purge_on()
        events = ExecutionAuditEvent.objects.filter(job_id__in=endpoints).delete()[0]
        hooks = WebhookEndpoint.objects.filter(id__in=endpoints).delete()[0]
        quarantined = DocumentQuarantine.objects.filter(tenant=tenant).delete()[0]
        _advance(record, "rows", rows_deleted=hooks + quarantined, audit_events_deleted=events)
    return True


def _delete_objects(*, record: TenantErasure, stop_at: float | None) -> bool:
    """Each written-down object, then its row. False: stopped at the deadline."""
    for item in ErasureObject.objects.filter(erasure_id=record.id).order_by("id").iterator():
        if item.kind == "prefix":
            removed = storage.delete_prefix(item.key)
        else:
            sha = item.key.rsplit("/", 1)[-1]
            removed = int(
                source_delete_if_unused(sha256=sha, key=item.key, live_only=False, grace_s=0)
            )
        with transaction.atomic():
            ErasureObject.objects.filter(id=item.id).delete()
            _advance(record, "objects", objects_deleted=removed)
        if _over(stop_at):
            return False
    return True


def erasure_representation(record: TenantErasure) -> dict[str, object]:
    """The record as the API and the command show it (the tenant as its pseudonym only)."""
    return {
        "id": record.id,
        "tenant": record.tenant_pseudonym,
        "state": "finished" if record.finished_at is not None else "in_progress",
        "step": record.step,
        "counts": {
            "jobs_cancelled": record.jobs_cancelled,
            "jobs_deleted": record.jobs_deleted,
            "rows_deleted": record.rows_deleted,
            "audit_events_deleted": record.audit_events_deleted,
            "objects_deleted": record.objects_deleted,
        },
        "runs": record.runs,
        "actor": record.actor,
        "started_at": record.started_at.isoformat(),
        "finished_at": record.finished_at.isoformat() if record.finished_at else None,
    }
