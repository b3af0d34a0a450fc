"""One long document on many workers: fenced page ranges and one join (ADR 0023,
docs/ARCHITECTURE.md "Page ranges").

A claimed job whose pages still to convert exceed ``FANOUT_MIN_PAGES`` is split: its attempt
(the *planner*) writes one ``job_range`` row and one outbox row per range, in one transaction
fenced on the job's lease, and ends. The job stays ``running`` under the planner's lease token;
its ``worker_lease`` row no longer expires (``FANNED_OUT_UNTIL``): the ranges hold their own
leases. Any worker claims a range (a CAS on the range's generation while the job is running in
the planned generation), converts its pages with the job's ordinary checkpoints (absolute page
numbers), every write fenced on the job *and* the range, and marks the range done. The worker
whose range is the last one done (decided under the job row's lock) becomes the one finalizer:
the job lease expires again (it is heartbeated like an attempt's), and the result is assembled
and published by the job's own fenced publish (``runner._finalize``).

Lock order: a transaction that locks a job row and range rows takes the job row first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import logging
import math
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from django.conf import settings
from django.db import transaction
from django.db.models import Exists, F, OuterRef, Q
from django.db.models.functions import Now
from django.utils import timezone

from conversion_jobs import converters, storage
from conversion_jobs.converters.base import PDF, Prepared
from conversion_jobs.converters.errors import SourceMissing
from conversion_jobs.models import (
    ConversionJob,
    ConversionOutbox,
    InlineSource,
    JobRange,
    RangeState,
    WorkerLease,
)
from conversion_jobs.observability import metrics
from conversion_jobs.services import fair, transitions
from conversion_jobs.services.audit import audit_event_append
from conversion_jobs.services.checkpoints import (
    job_row_lock,
    range_row_lock,
)
from conversion_jobs.services.db_retry import db_retry
from conversion_jobs.services.dispatch import RangeRef, outbox_publish_after_commit
from conversion_jobs.services.heartbeat import Heartbeat
from conversion_jobs.services.leases import (
    HeartbeatResult,
    Lease,
    LeaseLost,
    RangeLease,
    job_state_under_lease,
    lease_ttl,
)
from conversion_jobs.states import LEASED_STATES, State

log = logging.getLogger(__name__)

#: A fanned-out job's ``worker_lease.expires_at``: its liveness is its ranges' leases, and the
#: job lease sweep (``expires_at < now``) leaves it alone until the join sets a real expiry.
FANNED_OUT_UNTIL = datetime(9999, 1, 1, tzinfo=UTC)

#: Host-local cache of sources fetched for ranges, under ``WORK_DIR`` (one fetch per job, source
#: and host; ``source_cache_remove_stale`` removes a finished job's entries).
SOURCE_CACHE = ".sources"


# --- planning ------------------------------------------------------------------------------


def fanout_kind(*, job: ConversionJob) -> str:
    """The key of ``FANOUT_MIN_PAGES`` a job's pages are counted against: its output, ``ocr`` for
    text from an image (docs/OPERABILITY.md "Fan-out thresholds")."""
    if job.output == "text" and job.source_media_type.startswith("image/"):
        return "ocr"
    return str(job.output)


def fanout_min_pages(*, job: ConversionJob) -> int:
    """Pages to convert above which ``job`` fans out: ``FANOUT_MIN_PAGES`` for its output (a
    mapping by :func:`fanout_kind`, or one number for every output)."""
    threshold = settings.QUIRE["FANOUT_MIN_PAGES"]
    if isinstance(threshold, dict):
        pages = threshold.get(fanout_kind(job=job), threshold.get("png"))
        return int(pages if pages is not None else 64)
    return int(threshold)


def fanout_wanted(*, job: ConversionJob, todo: list[int]) -> bool:
    """Whether an attempt with ``todo`` pages still to convert splits them into ranges."""
    return bool(settings.QUIRE["FANOUT"]) and len(todo) > fanout_min_pages(job=job)


def fanout_likely(job: ConversionJob) -> bool:
    """Whether the acceptance's page estimate (``dispatch_cost`` / the output's factor) says the
    job will fan out: its planner then asks its converter for no first pages (they would be
    converted again by the first range). A wrong guess costs nothing but that overlap."""
    if not settings.QUIRE["FANOUT"]:
        return False
    factor = fair.page_factor(
        media_type=job.source_media_type, output=job.output, options=job.options
    )
    return job.dispatch_cost // max(1, factor) > fanout_min_pages(job=job)


def range_size(page_count: int) -> int:
    """Pages per range for a document of ``page_count`` selected pages: four ranges per
    conversion slot (``FANOUT_SLOTS``: the tail of the last ranges spreads over every slot),
    bounded to [``FANOUT_RANGE_MIN_PAGES``, ``FANOUT_RANGE_MAX_PAGES``]
    (docs/ARCHITECTURE.md "Page ranges")."""
    quire = settings.QUIRE
    size = math.ceil(page_count / (4 * max(1, int(quire["FANOUT_SLOTS"]))))
    return max(
        int(quire["FANOUT_RANGE_MIN_PAGES"]), min(int(quire["FANOUT_RANGE_MAX_PAGES"]), size)
    )


def range_sizes(page_count: int) -> list[int]:
    """The sizes of the ranges of ``page_count`` selected pages, in page order. Without taper:
    ``range_size`` each (the last one shorter). With ``FANOUT_RANGE_TAPER``: a range never
    holds more than a quarter of the pages left per slot (``ceil(left / (2 x slots))``, guided
    self-scheduling), so the ranges shrink towards the end, down to ``FANOUT_RANGE_MIN_PAGES``,
    and the last ones, which decide when every slot is done, are short (docs/ARCHITECTURE.md
    "Page ranges"). A remainder shorter than the minimum joins the last range."""
    quire = settings.QUIRE
    size = range_size(page_count)
    if not quire.get("FANOUT_RANGE_TAPER"):
        return [min(size, page_count - start) for start in range(0, page_count, size)]
    low = int(quire["FANOUT_RANGE_MIN_PAGES"])
    slots = max(1, int(quire["FANOUT_SLOTS"]))
    sizes: list[int] = []
    left = page_count
    while left > 0:
        step = max(low, min(size, math.ceil(left / (2 * slots))))
        if left - step < low:
            step = left
        sizes.append(step)
        left -= step
    return sizes


def ranges_for(*, pages: list[int], todo: list[int]) -> list[tuple[int, int]]:
    """The ranges ``(first, last)`` of ``pages`` (the selected pages, contiguous) that hold a
    page of ``todo``; a resumed job's ranges keep the same boundaries (they depend on the
    selected pages only)."""
    wanted = set(todo)
    spans = []
    start = 0
    for size in range_sizes(len(pages)):
        chunk = pages[start : start + size]
        start += size
        if wanted.intersection(chunk):
            spans.append((chunk[0], chunk[-1]))
    return spans


def conversion_job_fan_out(
    claim: transitions.Claim,
    *,
    pages: list[int],
    todo: list[int],
    prepared: Prepared,
    heartbeat: Heartbeat,
    kept: list[RangeClaim] | None = None,
    worker: str = "",
) -> str:
    """The planner of the attempt ``claim`` (its page count recorded): an Office document's PDF
    stored once (every range splits it), then the ranges planned (``ranges_plan``). Returns
    ``fanned_out``; LeaseLost when the job was recovered or cancelled meanwhile (the runner
    stops). ``kept``: the planner goes on with the first range itself, in the slot it holds (no
    message, no wait for the relay): it is planned already claimed by the planner (``worker``:
    its identity), and its claim is appended to ``kept`` (with ``claim.source``, an inline
    source's bytes)."""
    lease, job = claim.lease, claim.job
    document_key = None
    if prepared.media_type == PDF and job.source_media_type != PDF:
        document_key = storage.page_key(
            job_id=lease.job_id, page=0, generation=lease.generation, ext="pdf"
        )
        sha, _size = storage.sha256_file(prepared.document)
        storage.put_file(document_key, prepared.document, sha256=sha)
    # No beat may follow the plan: one would give the job lease an expiry again.
    heartbeat.finish()
    if heartbeat.stop.is_set():
        raise converters.ConversionStopped()
    spans = ranges_for(pages=pages, todo=todo)
    first_token = uuid.uuid4() if kept is not None else None
    if not db_retry(
        ranges_plan,
        lease=lease,
        job=job,
        spans=spans,
        document_key=document_key,
        todo=len(todo),
        first_token=first_token,
        first_worker=worker,
    ):
        raise LeaseLost()
    if kept is not None and first_token is not None:
        row = JobRange.objects.get(job_id=lease.job_id, first_page=spans[0][0])
        kept.append(
            RangeClaim(
                range_lease=RangeLease(
                    row.id, lease.job_id, row.first_page, row.last_page, row.generation, first_token
                ),
                lease=dataclasses.replace(lease, started_at=None),
                job=job,
                document_key=document_key,
                source=claim.source if document_key is None else None,
            )
        )
    return "fanned_out"


def range_cost(*, job: ConversionJob, pages: int, document_key: str | None) -> int:
    """A range's dispatch cost (ADR 0021): its pages x the output's factor, the pages taken from
    the job's source or (an Office document) from its PDF."""
    return fair.dispatch_cost(
        media_type=PDF if document_key is not None else job.source_media_type,
        size=job.source_size,
        output=job.output,
        options=job.options,
        pages=pages,
    )


def ranges_plan(
    *,
    lease: Lease,
    job: ConversionJob,
    spans: list[tuple[int, int]],
    document_key: str | None,
    todo: int,
    first_token: uuid.UUID | None = None,
    first_worker: str = "",
) -> bool:
    """Fenced on the job lease, one transaction: an earlier generation's ranges go, one range
    row (``queued``, generation 1) and one outbox row per span, the job lease stops expiring,
    the audit event ``fanned_out``, the relay woken. ``first_token``: the first range is
    planned ``running`` under this lease token (the planner converts it; no outbox row: if the
    planner dies its lease expires and the range sweep requeues it). False: the job is no longer
    running under ``lease`` (nothing written)."""
    now = timezone.now()
    with transaction.atomic():
        if not job_row_lock(lease):
            metrics.FENCED_WRITES_REFUSED.labels(statement="job_pages").inc()
            return False
        JobRange.objects.filter(job_id=lease.job_id).delete()
        rows = [
            JobRange(
                job_id=lease.job_id,
                job_generation=lease.generation,
                first_page=first,
                last_page=last,
                document_key=document_key,
            )
            for first, last in spans
        ]
        if first_token is not None:
            kept = rows[0]
            kept.state = RangeState.RUNNING
            kept.lease_token = first_token
            kept.expires_at = now + lease_ttl()
            kept.attempts = 1
            kept.claimed_at = now
            kept.worker = first_worker[:128]
        JobRange.objects.bulk_create(rows)
        # No fast path: a worker may not publish (least privilege, deploy/rabbitmq/README.md);
        # the relay of the process that may (the sweeper) is woken by this transaction's
        # NOTIFY and picks the range rows with every other unit (ADR 0021 "Page ranges"), in
        # id order within the tenant, which is page order.
        ConversionOutbox.objects.bulk_create(
            [
                ConversionOutbox(
                    job_id=lease.job_id,
                    generation=lease.generation,
                    traceparent=job.traceparent,
                    range_first=first,
                    range_generation=1,
                    cost=range_cost(job=job, pages=last - first + 1, document_key=document_key),
                )
                for index, (first, last) in enumerate(spans)
                if index or first_token is None
            ]
        )
        fair.wake()
        WorkerLease.objects.filter(job_id=lease.job_id, token=lease.token).update(
            expires_at=FANNED_OUT_UNTIL
        )
        audit_event_append(
            job_id=lease.job_id,
            event_type="fanned_out",
            generation=lease.generation,
            attempt_id=lease.attempt_id,
            details={"ranges": len(spans), "pages": todo},
        )
        transaction.on_commit(lambda: metrics.RANGES_PLANNED.inc(len(spans)))
    return True


# --- a range's claim, heartbeat, end ---------------------------------------------------------


@dataclass(frozen=True)
class RangeClaim:
    """A won range claim: the range's lease, the job's lease (the planner's token), the job."""

    range_lease: RangeLease
    lease: Lease
    job: ConversionJob
    document_key: str | None
    #: an inline source's bytes, else None
    source: bytes | None = None


def range_claim(
    *, job_id: uuid.UUID, generation: int, first: int, range_generation: int, worker: str
) -> RangeClaim | None:
    """Range QUEUED -> RUNNING for this range generation while the job is RUNNING in the
    generation that planned it: attempts + 1, a new lease token and expiry. The guard is on the
    range row's own columns (a concurrent claim that waited for the row lock re-checks them and
    matches nothing). None: a duplicate or stale delivery (counted; the caller acks it)."""
    token = uuid.uuid4()
    now = timezone.now()
    with transaction.atomic():
        won = (
            JobRange.objects.filter(
                job_id=job_id,
                first_page=first,
                generation=range_generation,
                job_generation=generation,
                state=RangeState.QUEUED,
            )
            .filter(
                Exists(
                    ConversionJob.objects.filter(
                        id=OuterRef("job_id"), state=State.RUNNING, generation=generation
                    )
                )
            )
            .update(
                state=RangeState.RUNNING,
                lease_token=token,
                expires_at=now + lease_ttl(),
                attempts=F("attempts") + 1,
                worker=worker[:128],
                claimed_at=Now(),
                updated_at=Now(),
            )
        )
        if not won:
            metrics.DUPLICATE_DELIVERIES.labels(reason="duplicate").inc()
            return None
        row = JobRange.objects.get(job_id=job_id, first_page=first)
        job = ConversionJob.objects.get(id=job_id)
        attempt_id = (
            WorkerLease.objects.filter(job_id=job_id).values_list("attempt_id", flat=True).first()
        )
        source = None
        if storage.is_inline_source(job.source_key) and row.document_key is None:
            content = (
                InlineSource.objects.filter(job_id=job_id).values_list("content", flat=True).first()
            )
            source = None if content is None else bytes(content)
    if job.lease_token is None:  # cannot be: the job is running (checked by the claim)
        raise LeaseLost()
    metrics.CLAIMS.inc()
    return RangeClaim(
        range_lease=RangeLease(
            row.id, job_id, row.first_page, row.last_page, row.generation, token
        ),
        lease=Lease(job_id, generation, job.lease_token, attempt_id, job.attempts, None),
        job=job,
        document_key=row.document_key,
        source=source,
    )


def range_heartbeat(*, range_lease: RangeLease, lease: Lease) -> str:
    """Extend the range's lease if it is still ours and unexpired; then the job's state under
    its lease: OK, CANCELLING (stop, the job is being cancelled) or LOST."""
    now = timezone.now()
    extended = JobRange.objects.filter(
        id=range_lease.range_id,
        generation=range_lease.generation,
        lease_token=range_lease.token,
        state=RangeState.RUNNING,
        expires_at__gt=now,
    ).update(expires_at=now + lease_ttl())
    if not extended:
        metrics.FENCED_WRITES_REFUSED.labels(statement="range_heartbeat").inc()
        return HeartbeatResult.LOST
    state = job_state_under_lease(lease=lease)
    if state == State.RUNNING:
        return HeartbeatResult.OK
    if state == State.CANCELLING:
        return HeartbeatResult.CANCELLING
    return HeartbeatResult.LOST


def range_finish(*, range_lease: RangeLease, lease: Lease) -> bool:
    """Range RUNNING -> DONE (every page checkpointed), fenced on the job and the range. Under
    the job row's lock, the range that leaves none undone is the join: the job lease gets a
    real expiry again (heartbeated by this worker, the one finalizer; a crash from here on is
    the job lease sweep's, like any attempt's). True: this call is the join. LeaseLost: stale
    (nothing written)."""
    with transaction.atomic():
        if not (job_row_lock(lease) and range_row_lock(range_lease)):
            metrics.FENCED_WRITES_REFUSED.labels(statement="range_done").inc()
            raise LeaseLost()
        JobRange.objects.filter(id=range_lease.range_id).update(
            state=RangeState.DONE, lease_token=None, expires_at=None, updated_at=Now()
        )
        if JobRange.objects.filter(job_id=lease.job_id).exclude(state=RangeState.DONE).exists():
            return False
        WorkerLease.objects.filter(job_id=lease.job_id, token=lease.token).update(
            expires_at=timezone.now() + lease_ttl()
        )
        audit_event_append(
            job_id=lease.job_id,
            event_type="ranges_joined",
            generation=lease.generation,
            attempt_id=lease.attempt_id,
            details={"ranges": JobRange.objects.filter(job_id=lease.job_id).count()},
        )
    return True


def range_yield(*, range_lease: RangeLease, lease: Lease, pages_left: int) -> bool:
    """Range RUNNING -> QUEUED "yielded" (ADR 0021, "A range yields"): it used its fair slice
    while another tenant's unit waits with no free slot. Fenced on the job (running) and the
    range: range generation + 1, ``attempts`` back down (a yield is not an attempt), a new outbox
    row costing the ``pages_left``; the job stays RUNNING and its other ranges go on. The pages
    done so far are checkpointed (the caller flushed its batch): the next claim of the range
    skips them. False: lost, nothing written."""
    next_generation = range_lease.generation + 1
    with transaction.atomic():
        if not (job_row_lock(lease, State.RUNNING) and range_row_lock(range_lease)):
            metrics.FENCED_WRITES_REFUSED.labels(statement="range_yield").inc()
            return False
        JobRange.objects.filter(id=range_lease.range_id).update(
            state=RangeState.QUEUED,
            generation=next_generation,
            attempts=F("attempts") - 1,
            lease_token=None,
            expires_at=None,
            dispatched_at=None,
            worker="",
            updated_at=Now(),
        )
        cost = _range_outbox(
            lease=lease, first=range_lease.first_page, generation=next_generation, pages=pages_left
        )
        audit_event_append(
            job_id=lease.job_id,
            event_type="range_yielded",
            generation=lease.generation,
            attempt_id=lease.attempt_id,
            details={"first_page": range_lease.first_page, "cost": cost},
        )
        transaction.on_commit(metrics.FAIR_YIELDS.inc)
    return True


def range_stop(*, range_lease: RangeLease | None, lease: Lease) -> str:
    """A range's worker stops (its heartbeat or a fenced write said so). If the job is being
    cancelled: this range and every queued one end ``cancelled``, and the last range to stop
    moves the job CANCELLING -> CANCELLED (under the job row's lock). Returns ``cancelled`` or
    ``lost``."""
    with transaction.atomic():
        if not job_row_lock(lease, State.CANCELLING):
            return "lost"
        ranges = JobRange.objects.filter(job_id=lease.job_id)
        if range_lease is not None:
            ranges.filter(
                id=range_lease.range_id,
                generation=range_lease.generation,
                lease_token=range_lease.token,
            ).update(state=RangeState.CANCELLED, lease_token=None, expires_at=None)
        ranges.filter(state=RangeState.QUEUED).update(state=RangeState.CANCELLED)
        if not ranges.filter(state=RangeState.RUNNING).exists():
            transitions.chosen(transitions.finish_cancel(lease=lease))
    return "cancelled"


# --- the source, once per job and host --------------------------------------------------------


def source_fetch(*, job: ConversionJob, key: str | None, inline: bytes | None, dest: Path) -> None:
    """The range's copy of its document at ``dest``: an inline source's bytes, else a hard link
    to this host's cached copy (``WORK_DIR/.sources/<job>-<digest>``), fetched from the store by
    the first range of the job on this host (under a file lock: once per job, source and host)."""
    if key is None and storage.is_inline_source(job.source_key):
        if inline is None:
            raise SourceMissing()
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with open(fd, "wb") as fh:
            fh.write(inline)
        return
    store_key = key or job.source_key
    digest = job.source_sha256 if key is None else key.rsplit("/", 1)[-1].replace(".", "-")
    root = Path(settings.QUIRE["WORK_DIR"]) / SOURCE_CACHE
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    cached = root / f"{job.id}-{digest}"
    with open(root / f"{job.id}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not cached.exists():
            part = cached.with_name(f"{cached.name}.{uuid.uuid4().hex}.part")
            try:
                storage.download(store_key, part)
                os.chmod(part, 0o400)
                os.rename(part, cached)
            finally:
                part.unlink(missing_ok=True)
        else:
            os.utime(cached)  # in use: the stale-entry sweep measures age from here
    try:
        os.link(cached, dest)
    except OSError:
        shutil.copyfile(cached, dest)


def source_cache_remove_stale(*, older_than_s: float | None = None) -> int:
    """Remove cached range sources whose job is no longer running (``remove_stale_work_dirs``
    sweep), once untouched for 2 x ``LEASE_S``."""
    root = Path(settings.QUIRE["WORK_DIR"]) / SOURCE_CACHE
    if not root.is_dir():
        return 0
    older_than_s = older_than_s if older_than_s is not None else settings.QUIRE["LEASE_S"] * 2
    cutoff = time.time() - older_than_s
    entries: dict[uuid.UUID, list[Path]] = {}
    for entry in root.iterdir():
        with contextlib.suppress(ValueError, OSError):
            if entry.stat().st_mtime < cutoff:
                entries.setdefault(uuid.UUID(entry.name[:36]), []).append(entry)
    if not entries:
        return 0
    live = set(
        ConversionJob.objects.filter(id__in=entries, state__in=sorted(LEASED_STATES)).values_list(
            "id", flat=True
        )
    )
    removed = 0
    for job_id, paths in entries.items():
        if job_id in live:
            continue
        for path in paths:
            path.unlink(missing_ok=True)
            removed += 1
    return removed


# --- the range sweep -------------------------------------------------------------------------


def job_ranges_recover_if_lease_expired(*, batch: int | None = None) -> int:
    """Beat sweep (ADR 0023). A running range whose lease expired: requeued alone (range
    generation + 1, a new outbox row), or - its worker lost ``max_attempts`` times: a converter
    crash of the document - the job fails ``attempts_exhausted``; a range of a job being
    cancelled ends ``cancelled``; a range of a job that left its run ends ``cancelled`` too
    (``stale``). A cancelling fanned-out job with no running range ends CANCELLED. Queued
    ranges unclaimed past the dispatch timeout get a new outbox row."""
    batch = batch or settings.QUIRE["SWEEP_BATCH"]
    now = timezone.now()
    done = 0
    expired = list(
        JobRange.objects.filter(state=RangeState.RUNNING, expires_at__lt=now).values_list(
            "id", "job_id"
        )[:batch]
    )
    for range_id, job_id in expired:
        with transaction.atomic():
            result = _recover_range(range_id=range_id, job_id=job_id, now=now)
        if result is not None:
            metrics.RANGE_RECOVERIES.labels(result=result).inc()
            done += 1
    # fanned out in its current generation (an unsplit attempt after a fanned-out generation
    # ends its own cancel), no range of it running
    current = JobRange.objects.filter(job_id=OuterRef("id"), job_generation=OuterRef("generation"))
    idle = list(
        ConversionJob.objects.filter(state=State.CANCELLING)
        .filter(Exists(current))
        .exclude(Exists(current.filter(state=RangeState.RUNNING)))
        .values_list("id", flat=True)[:batch]
    )
    for job_id in idle:
        with transaction.atomic():
            lease = _held_lease(job_id)
            if lease is not None and range_stop(range_lease=None, lease=lease) == "cancelled":
                done += 1
    done += _ranges_republish_if_dispatch_stale(batch=batch)
    return done


def _held_lease(job_id: uuid.UUID) -> Lease | None:
    """The job's lease as a sweep acts on it (the job row locked first), or None."""
    held = transitions.job_lock_for_choice(job_id=job_id)
    if held is None or held.state not in LEASED_STATES or held.lease_token is None:
        return None
    attempt_id = (
        WorkerLease.objects.filter(job_id=job_id).values_list("attempt_id", flat=True).first()
    )
    return Lease(job_id, held.generation, held.lease_token, attempt_id, 0, None)


def _recover_range(*, range_id: int, job_id: uuid.UUID, now: datetime) -> str | None:
    """One expired range, the job row locked first, then the range (``SKIP LOCKED``: a range
    whose worker is writing a batch right now is left to the next sweep)."""
    lease = _held_lease(job_id)
    row = (
        JobRange.objects.select_for_update(skip_locked=True)
        .filter(id=range_id, state=RangeState.RUNNING, expires_at__lt=now)
        .values_list("first_page", "attempts", "generation", "job_generation")
        .first()
    )
    if row is None:
        return None
    first, attempts, generation, job_generation = row
    ranges = JobRange.objects.filter(job_id=job_id)
    if lease is None or lease.generation != job_generation:
        ranges.filter(id=range_id).update(
            state=RangeState.CANCELLED, lease_token=None, expires_at=None
        )
        return "stale"
    state = job_state_under_lease(lease=lease)
    if state == State.CANCELLING:
        ranges.filter(id=range_id).update(
            state=RangeState.CANCELLED, lease_token=None, expires_at=None
        )
        range_stop(range_lease=None, lease=lease)
        return "cancelled"
    max_attempts = ConversionJob.objects.filter(id=job_id).values_list("max_attempts", flat=True)[0]
    if attempts >= max_attempts:
        # A range whose worker keeps dying is the document crashing its converter.
        transitions.chosen(transitions.fail_lease_lost(lease=lease, range_first=first))
        return "exhausted"
    ranges.filter(id=range_id).update(
        state=RangeState.QUEUED,
        generation=generation + 1,
        lease_token=None,
        expires_at=None,
        dispatched_at=None,
        worker="",
        updated_at=Now(),
    )
    _range_outbox(lease=lease, first=first, generation=generation + 1)
    return "requeued"


def _range_outbox(*, lease: Lease, first: int, generation: int, pages: int | None = None) -> int:
    """A new outbox row for the range at ``first`` in range generation ``generation``, costing
    ``pages`` (default: the whole range), published after commit; returns its cost."""
    job = ConversionJob.objects.only(
        "traceparent", "source_media_type", "source_size", "output", "options"
    ).get(id=lease.job_id)
    span = (
        JobRange.objects.filter(job_id=lease.job_id, first_page=first)
        .values_list("last_page", "document_key")
        .first()
    )
    last, document_key = span if span is not None else (first, None)
    traceparent = job.traceparent
    cost = range_cost(
        job=job, pages=last - first + 1 if pages is None else pages, document_key=document_key
    )
    row = ConversionOutbox.objects.create(
        job_id=lease.job_id,
        generation=lease.generation,
        traceparent=traceparent,
        range_first=first,
        range_generation=generation,
        cost=cost,
    )
    outbox_publish_after_commit(
        outbox_id=row.id,
        job_id=lease.job_id,
        generation=lease.generation,
        traceparent=traceparent,
        page_range=RangeRef(first, generation),
    )
    return cost


def _ranges_republish_if_dispatch_stale(*, batch: int) -> int:
    """Queued ranges of running jobs unclaimed past ``DISPATCH_TIMEOUT_S``: a new outbox row for
    the same range generation (a duplicate message is harmless: the claim is a CAS). With fair
    dispatch a range waiting its turn (an unpublished outbox row of it) is not stale: a range
    sent and not claimed within ``QUIRE_FAIR_LOST_S`` (its message lost) is, and one with no
    row waiting past the dispatch timeout."""
    now = timezone.now()
    cutoff = now - timedelta(seconds=settings.QUIRE["DISPATCH_TIMEOUT_S"])
    stale_ranges = JobRange.objects.filter(
        state=RangeState.QUEUED, updated_at__lt=cutoff, job__state=State.RUNNING
    )
    if fair.enabled():
        lost = now - timedelta(seconds=settings.QUIRE["FAIR_LOST_S"])
        waiting = ConversionOutbox.objects.filter(
            job_id=OuterRef("job_id"),
            range_first=OuterRef("first_page"),
            range_generation=OuterRef("generation"),
            published_at__isnull=True,
        )
        stale_ranges = JobRange.objects.filter(
            state=RangeState.QUEUED, job__state=State.RUNNING
        ).filter(
            Q(dispatched_at__lt=lost)
            | Q(updated_at__lt=cutoff, dispatched_at__isnull=True) & ~Q(Exists(waiting))
        )
    count = 0
    with transaction.atomic():
        stale = list(
            stale_ranges.select_for_update(skip_locked=True, of=("self",)).values_list(
                "id", "job_id", "job_generation", "first_page", "generation"
            )[:batch]
        )
        for range_id, job_id, job_generation, first, generation in stale:
            JobRange.objects.filter(id=range_id).update(updated_at=Now(), dispatched_at=None)
            _range_outbox(
                lease=Lease(job_id, job_generation, uuid.UUID(int=0), None, 0, None),
                first=first,
                generation=generation,
            )
            count += 1
    return count
