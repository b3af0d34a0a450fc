"""Beat sweeps that move jobs on (DESIGN.md §7.6) and the operator retry.

Each sweep claims its rows with ``SELECT … FOR UPDATE SKIP LOCKED`` inside one transaction and
moves each with a guarded UPDATE, so two beats running at once never move a job twice.
"""

from __future__ import annotations

import logging
import shutil
import time
import uuid
from pathlib import Path

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import F
from django.db.models.functions import Coalesce, Now
from django.utils import timezone

from conversion_jobs.db import violated_constraint
from conversion_jobs.exceptions import NotFound, NotRetryable, QuireError
from conversion_jobs.models import (
    AttemptOutcome,
    ConversionAttempt,
    ConversionJob,
    ConversionOutbox,
    PageCheckpoint,
    PageState,
    WorkerLease,
)
from conversion_jobs.observability import metrics
from conversion_jobs.services.audit import audit_event_append
from conversion_jobs.services.cancellation import resolve_cancellations_cancelled
from conversion_jobs.services.checkpoints import pages_converted_by
from conversion_jobs.services.dispatch import outbox_publish_after_commit
from conversion_jobs.states import State

log = logging.getLogger(__name__)


class ConflictingJob(QuireError):
    """An identical job is already live or succeeded; retry would duplicate it."""

    code = "conflicting_job"
    status = 409


def _redispatch(*, job_id: uuid.UUID, generation: int, traceparent: str) -> None:
    outbox = ConversionOutbox.objects.create(
        job_id=job_id, generation=generation, traceparent=traceparent
    )
    outbox_publish_after_commit(
        outbox_id=outbox.id, job_id=job_id, generation=generation, traceparent=traceparent
    )


def conversion_jobs_requeue_if_retry_due(*, batch: int | None = None) -> int:
    """RETRY_WAIT whose ``next_attempt_at`` has passed -> QUEUED, generation + 1, new outbox row.
    The timer is the Postgres timestamp: a restarted beat loses nothing."""
    batch = batch or settings.QUIRE["SWEEP_BATCH"]
    moved = 0
    with transaction.atomic():
        due = list(
            ConversionJob.objects.due_for_retry()
            .select_for_update(skip_locked=True)
            .values_list("id", "generation", "traceparent")[:batch]
        )
        for job_id, generation, traceparent in due:
            won = ConversionJob.objects.filter(
                id=job_id, state=State.RETRY_WAIT, generation=generation
            ).update(
                state=State.QUEUED,
                generation=F("generation") + 1,
                next_attempt_at=None,
                queued_at=Now(),
                state_version=F("state_version") + 1,
                updated_at=Now(),
            )
            if won:
                _redispatch(job_id=job_id, generation=generation + 1, traceparent=traceparent)
                audit_event_append(
                    job_id=job_id,
                    event_type="retry_dispatched",
                    generation=generation + 1,
                    lock_job=False,
                )
                moved += 1
    if moved:
        metrics.REDISPATCHES.labels(reason="retry_due").inc(moved)
    return moved


def conversion_jobs_recover_if_lease_expired(*, batch: int | None = None) -> int:
    """RUNNING with an expired lease -> QUEUED (generation + 1) or FAILED attempts_exhausted;
    CANCELLING with an expired lease -> CANCELLED. The attempt's outcome becomes lease_lost."""
    batch = batch or settings.QUIRE["SWEEP_BATCH"]
    recovered = 0
    with transaction.atomic():
        expired = list(
            WorkerLease.objects.select_for_update(skip_locked=True)
            .filter(expires_at__lt=timezone.now())
            .values_list("job_id", "generation", "token", "attempt_id")[:batch]
        )
        for job_id, generation, token, attempt_id in expired:
            if _recover_one(
                job_id=job_id, generation=generation, token=token, attempt_id=attempt_id
            ):
                recovered += 1
    return recovered


def _recover_one(*, job_id: uuid.UUID, generation: int, token: uuid.UUID, attempt_id: int) -> bool:
    fence = ConversionJob.objects.filter(id=job_id, generation=generation, lease_token=token)
    row = (
        fence.select_for_update()
        .values_list("state", "attempts", "max_attempts", "traceparent")
        .first()
    )
    ConversionAttempt.objects.filter(id=attempt_id, finished_at__isnull=True).update(
        outcome=AttemptOutcome.LEASE_LOST,
        error_code="lease_lost",
        finished_at=Now(),
        pages_converted=Coalesce(pages_converted_by(job_id=job_id, generation=generation), 0),
    )
    WorkerLease.objects.filter(job_id=job_id, token=token).delete()
    if row is None:
        return False
    state, attempts, max_attempts, traceparent = row
    common = {"lease_token": None, "state_version": F("state_version") + 1, "updated_at": Now()}
    if state == State.CANCELLING:
        fence.filter(state=state).update(state=State.CANCELLED, finished_at=Now(), **common)
        resolve_cancellations_cancelled(job_id=job_id)
        result = "cancelled"
    elif attempts >= max_attempts:
        fence.filter(state=state).update(
            state=State.FAILED,
            error_code="attempts_exhausted",
            error_retryable=True,
            error_detail="last error: lease_lost",
            finished_at=Now(),
            **common,
        )
        result = "exhausted"
    else:
        fence.filter(state=state).update(
            state=State.QUEUED,
            generation=F("generation") + 1,
            queued_at=Now(),
            error_code="lease_lost",
            error_retryable=True,
            **common,
        )
        _redispatch(job_id=job_id, generation=generation + 1, traceparent=traceparent)
        result = "requeued"
    audit_event_append(
        job_id=job_id,
        event_type="lease_expired",
        generation=generation,
        attempt_id=attempt_id,
        details={"result": result},
        lock_job=False,
    )
    metrics.RECOVERIES.labels(result=result).inc()
    if result != "requeued":
        metrics.TERMINAL.labels(state="cancelled" if result == "cancelled" else "failed").inc()
    return True


def conversion_job_retry_failed(
    *, job_id: uuid.UUID, tenant: str | None, actor: str
) -> ConversionJob:
    """Operator retry: FAILED | CANCELLED -> QUEUED, generation + 1, attempts reset, new outbox
    row. The new generation starts clean: the old generation's messages are stale, its attempt
    directories are gone, and its cancellation requests stay resolved against the old
    generation. ``tenant`` None means any tenant (Django admin)."""
    jobs = ConversionJob.objects.filter(id=job_id)
    if tenant is not None:
        jobs = jobs.filter(tenant=tenant)
    try:
        with transaction.atomic():
            row = (
                jobs.select_for_update()
                .values_list("state", "generation", "traceparent", "expired_at")
                .first()
            )
            if row is None:
                raise NotFound()
            state, generation, traceparent, expired_at = row
            if state not in (State.FAILED, State.CANCELLED):
                raise NotRetryable(job_state=state)
            if expired_at is not None:  # its source is gone: only a new submission can help
                raise NotRetryable("the job expired under retention; submit it again")
            jobs.filter(state=state, generation=generation).update(
                state=State.QUEUED,
                generation=F("generation") + 1,
                attempts=0,
                error_code=None,
                error_retryable=False,
                error_detail="",
                finished_at=None,
                pages_failed=0,
                queued_at=Now(),
                state_version=F("state_version") + 1,
                updated_at=Now(),
            )
            # Failed pages get a fresh budget; done pages stay done (never redone).
            PageCheckpoint.objects.filter(job_id=job_id, state=PageState.FAILED).update(
                state=PageState.PENDING, attempts=0, error_code=None
            )
            _redispatch(job_id=job_id, generation=generation + 1, traceparent=traceparent)
            audit_event_append(
                job_id=job_id,
                event_type="operator_retry",
                generation=generation + 1,
                actor=actor,
                lock_job=False,
            )
    except IntegrityError as exc:
        if violated_constraint(exc) == "job_content_identity_live_or_succeeded":
            raise ConflictingJob() from exc
        raise
    metrics.REDISPATCHES.labels(reason="operator_retry").inc()
    return ConversionJob.objects.get(id=job_id)


def _is_uuid(name: str) -> bool:
    try:
        uuid.UUID(name)
    except ValueError:
        return False
    return True


def work_dirs_remove_stale(*, older_than_s: float | None = None) -> int:
    """Remove attempt work directories whose attempt is no longer running (a crashed worker's
    leftovers). A directory is ``<WORK_DIR>/<job_id>/<attempt_id>``; it is live while its
    attempt row is unfinished. Young directories are left alone (their claim may be committing)."""
    root = Path(settings.QUIRE["WORK_DIR"])
    if not root.exists():
        return 0
    older_than_s = older_than_s if older_than_s is not None else settings.QUIRE["LEASE_S"] * 2
    cutoff = time.time() - older_than_s
    candidates: dict[int, Path] = {}
    for job_dir in root.iterdir():
        # Only <job uuid>/ directories: the workers' sandbox directories (``.sandbox/<pid>-…``)
        # also live here, and an idle worker's must never be taken for a dead attempt's.
        if not _is_uuid(job_dir.name):
            continue
        for attempt_dir in job_dir.iterdir() if job_dir.is_dir() else []:
            try:
                if attempt_dir.stat().st_mtime < cutoff:
                    candidates[int(attempt_dir.name.split("-")[0])] = attempt_dir
            except (ValueError, OSError):
                continue
    if not candidates:
        return 0
    live = set(
        ConversionAttempt.objects.filter(id__in=candidates, finished_at__isnull=True).values_list(
            "id", flat=True
        )
    )
    removed = 0
    for attempt_id, path in candidates.items():
        if attempt_id not in live:
            shutil.rmtree(path, ignore_errors=True)
            removed += 1
            try:
                path.parent.rmdir()
            except OSError:
                pass
    return removed
