"""Beat sweeps that move jobs on (docs/ARCHITECTURE.md §1 "Sweeps") and the operator retry.

Each sweep claims its rows with ``SELECT … FOR UPDATE SKIP LOCKED`` inside one transaction and
moves each through its edge in ``transitions.py`` (a guarded UPDATE), so two beats running at
once never move a job twice. Where a job may take one of several edges (lease recovery, the
repair sweep, operator retry) the job row is locked first and the edge chosen from the state
held (``transitions.job_lock_for_choice``).
"""

from __future__ import annotations

import logging
import shutil
import time
import uuid
from collections import Counter
from pathlib import Path

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Exists, OuterRef
from django.utils import timezone

from conversion_jobs.exceptions import NotFound, NotRetryable, QuireError
from conversion_jobs.models import AttemptOutcome, ConversionAttempt, ConversionJob, WorkerLease
from conversion_jobs.observability import metrics
from conversion_jobs.services import transitions
from conversion_jobs.services.leases import Lease
from conversion_jobs.states import LEASED_STATES, State
from conversion_jobs.store.db import violated_constraint

log = logging.getLogger(__name__)


class ConflictingJob(QuireError, code="conflicting_job", status=409):
    """An identical job is already live or succeeded; retry would duplicate it."""


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
            moved += transitions.requeue_due_retry(
                job_id=job_id, generation=generation, traceparent=traceparent
            )
    return moved


def conversion_jobs_recover_if_lease_expired(*, batch: int | None = None) -> int:
    """RUNNING with an expired lease -> FAILED attempts_exhausted or QUEUED (generation + 1);
    CANCELLING with an expired lease -> CANCELLED. The attempt's outcome becomes lease_lost."""
    batch = batch or settings.QUIRE["SWEEP_BATCH"]
    recovered = 0
    with transaction.atomic():
        expired = list(
            WorkerLease.objects.select_for_update(skip_locked=True, of=("self",))
            .filter(expires_at__lt=timezone.now())
            .values_list("job_id", "generation", "token", "attempt_id", "job__traceparent")[:batch]
        )
        for job_id, generation, token, attempt_id, traceparent in expired:
            lease = Lease(job_id, generation, token, attempt_id, 0, None)
            result = _recover_one(lease, traceparent)
            if result is None:
                continue
            metrics.RECOVERIES.labels(result=result).inc()
            recovered += 1
    return recovered


def _recover_one(lease: Lease, traceparent: str) -> str | None:
    """Lock the job row, then take the one recovery edge the state it holds allows
    (``_recover_held``). None: the lease row was stale (the job moved on under another token):
    its attempt is closed, its row removed."""
    held = transitions.job_lock_for_choice(job_id=lease.job_id)
    if held is None or not held.holds(lease):
        transitions.attempt_close(
            lease=lease, outcome=AttemptOutcome.LEASE_LOST, error_code="lease_lost"
        )
        WorkerLease.objects.filter(job_id=lease.job_id, token=lease.token).delete()
        return None
    return _recover_held(held, lease, traceparent)


def _recover_held(held: transitions.Held, lease: Lease, traceparent: str) -> str:
    """The edge out of a leased state whose lease is gone, chosen from the locked row:
    CANCELLING -> CANCELLED; RUNNING with its attempt budget spent -> FAILED
    ``attempts_exhausted``; RUNNING -> QUEUED (generation + 1). Returns which (the metrics'
    ``result``). A cancel that commits while this waits for the lock is seen here (it used to
    fall between two tried edges and leave the job ``cancelling`` with no lease)."""
    if held.state == State.CANCELLING:
        transitions.chosen(transitions.finish_cancel(lease=lease, by_sweep=True))
        return "cancelled"
    if held.exhausted:
        transitions.chosen(transitions.fail_lease_lost(lease=lease))
        return "exhausted"
    transitions.chosen(transitions.requeue_lost_lease(lease=lease, traceparent=traceparent))
    return "requeued"


def conversion_jobs_repair_if_leaseless(*, batch: int | None = None) -> int:
    """RUNNING | CANCELLING with no lease row and no open attempt — a state no edge leaves
    behind, so no other sweep would ever move it (the lease sweep starts from lease rows) —
    repaired like an expired lease: CANCELLING -> CANCELLED, RUNNING -> FAILED
    ``attempts_exhausted`` or QUEUED (generation + 1). Defence in depth: it should find
    nothing; ``quire_jobs_repaired_total`` counts what it did find (docs/OPERABILITY.md)."""
    batch = batch or settings.QUIRE["SWEEP_BATCH"]
    results: Counter[str] = Counter()
    open_attempt = ConversionAttempt.objects.filter(job_id=OuterRef("id"), finished_at__isnull=True)
    with transaction.atomic():
        stranded = list(
            ConversionJob.objects.filter(state__in=sorted(LEASED_STATES))
            .filter(
                ~Exists(WorkerLease.objects.filter(job_id=OuterRef("id"))), ~Exists(open_attempt)
            )
            .select_for_update(skip_locked=True)
            .values_list("id", flat=True)[:batch]
        )
        for job_id in stranded:
            held = transitions.job_lock_for_choice(job_id=job_id)  # held already: no wait
            if held is None or held.state not in LEASED_STATES or held.lease_token is None:
                continue
            attempt = (
                ConversionAttempt.objects.filter(job_id=job_id, generation=held.generation)
                .values_list("id", "number")
                .first()
            )
            lease = Lease(
                job_id,
                held.generation,
                held.lease_token,
                attempt[0] if attempt else None,
                attempt[1] if attempt else 0,
                None,
            )
            results[_recover_held(held, lease, held.traceparent)] += 1
    for result, count in results.items():
        metrics.REPAIRS.labels(result=result).inc(count)
    log.info(  # each run, counts only: what the sweep did is visible (issue 22 point 1)
        "repaired leaseless jobs: requeued=%d exhausted=%d cancelled=%d",
        results["requeued"],
        results["exhausted"],
        results["cancelled"],
    )
    return results.total()


#: The operator-retry edge out of each state it may start from (chosen under the row lock).
_RETRY_EDGES = {
    State.FAILED: transitions.retry_failed,
    State.CANCELLED: transitions.retry_cancelled,
}


def conversion_job_retry_failed(
    *, job_id: uuid.UUID, tenant: str | None, actor: str
) -> ConversionJob:
    """Operator retry: FAILED | CANCELLED -> QUEUED, generation + 1, attempts reset, new outbox
    row; the edge is chosen from the job row held under its lock (``job_lock_for_choice``), so
    a job that finished a moment ago is retried, not refused. The new generation starts
    clean: the old generation's messages are stale, its attempt directories are gone, and its
    cancellation requests stay resolved against the old generation. ``tenant`` None means any
    tenant (Django admin). Raises NotFound, NotRetryable (live, succeeded, or expired) or
    ConflictingJob."""
    try:
        # The answer is the job as this retry left it: read before the commit, so the new
        # outbox row's publish (on commit) cannot let a worker's claim show through.
        with transaction.atomic():
            held = transitions.job_lock_for_choice(job_id=job_id, tenant=tenant)
            if held is None:
                raise NotFound()
            move = _RETRY_EDGES.get(held.state)
            if move is None:
                raise NotRetryable(job_state=held.state.value)
            if held.expired:
                # its source is gone: only a new submission can help
                raise NotRetryable("the job expired under retention; submit it again")
            transitions.chosen(move(job_id=job_id, tenant=tenant, actor=actor))
            return ConversionJob.objects.get(id=job_id)
    except IntegrityError as exc:
        if violated_constraint(exc) == "job_content_identity_live_or_succeeded":
            raise ConflictingJob() from exc
        raise


def _is_uuid(name: str) -> bool:
    try:
        uuid.UUID(name)
    except ValueError:
        return False
    return True


#: An emptied work dir waiting for its worker process's next attempt is
#: ``<WORK_DIR>/.spare-work-<hex>`` (``runner._tidy``: the ended attempt's name is gone with its
#: files). One left by a crashed process, or by a process idle for long, is removed here; a
#: worker whose spare went makes a new directory.
SPARE_WORKDIR_PREFIX = ".spare-work-"


def work_dirs_remove_stale(*, older_than_s: float | None = None) -> int:
    """Remove attempt work directories whose attempt is no longer running (a crashed worker's
    leftovers). A directory is ``<WORK_DIR>/<job_id>.<attempt_id>-<token>`` (before session 5
    ``<WORK_DIR>/<job_id>/<attempt_id>-<token>``, still recognised); it is live while its
    attempt row is unfinished. Young directories are left alone (their claim may be committing).
    Spare work dirs (``SPARE_WORKDIR_PREFIX``, empty) go once older than the same cutoff; they
    are not counted."""
    root = Path(settings.QUIRE["WORK_DIR"])
    if not root.exists():
        return 0
    older_than_s = older_than_s if older_than_s is not None else settings.QUIRE["LEASE_S"] * 2
    cutoff = time.time() - older_than_s
    candidates: dict[int, Path] = {}
    for entry in root.iterdir():
        # Only <job uuid>.<attempt>-… and <job uuid>/ entries: the workers' sandbox directories
        # (``.sandbox/<pid>-…``) also live here, and an idle worker's must never be taken for a
        # dead attempt's.
        job, dot, attempt = entry.name.partition(".")
        if entry.name.startswith(SPARE_WORKDIR_PREFIX):
            # rmdir by name, never rmtree: a spare is empty, and a worker that renames it into
            # its attempt's name at this moment keeps it (the name is gone: ENOENT).
            try:
                if entry.stat().st_mtime < cutoff:
                    entry.rmdir()
            except OSError:
                pass
            continue
        if dot and _is_uuid(job):
            attempt_dirs = [(entry, attempt)]
        elif _is_uuid(entry.name) and entry.is_dir():
            attempt_dirs = [(d, d.name) for d in entry.iterdir()]
        else:
            continue
        for attempt_dir, name in attempt_dirs:
            try:
                if attempt_dir.stat().st_mtime < cutoff:
                    candidates[int(name.split("-")[0])] = attempt_dir
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
            if path.parent != root:  # the older layout's job directory
                try:
                    path.parent.rmdir()
                except OSError:
                    pass
    return removed
