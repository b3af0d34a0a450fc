"""Page checkpoints of a running attempt (docs/ARCHITECTURE.md §5): the fenced writes and reads of
``page_checkpoint``, and the batch the runner fills page by page."""

from __future__ import annotations

import hashlib
import time
import uuid
from typing import Any

from django.db import transaction

from conversion_jobs import storage
from conversion_jobs.converters.assemble import join_text_pages
from conversion_jobs.models import PageCheckpoint, PageState
from conversion_jobs.observability import metrics
from conversion_jobs.services.audit import audit_event_append
from conversion_jobs.services.db_retry import db_retry
from conversion_jobs.services.leases import Lease, LeaseLost, RangeLease
from conversion_jobs.store import checkpoints as store
from conversion_jobs.store.leases import job_row_lock, range_row_lock

#: ``artifact_key`` prefix of a page whose artifact is the row's ``content`` (no file): the
#: store's one marker for bytes kept in Postgres.
INLINE_PREFIX = storage.INLINE_PREFIX


def inline_content(checkpoint: PageCheckpoint) -> bytes | None:
    """A page's artifact bytes when they are stored inline in its row, else None."""
    if (checkpoint.artifact_key or "").startswith(INLINE_PREFIX):
        return bytes(checkpoint.content or b"")
    return None


def is_inline_result(result_key: str | None) -> bool:
    """Whether a job's ``result_key`` names an inline text result: no stored object, the
    result is its done pages' inline bytes joined in page order (ADR 0017, inline results)."""
    return (result_key or "").startswith(INLINE_PREFIX)


def inline_result_read(*, job_id: uuid.UUID, result_key: str, sha256: str) -> bytes | None:
    """The bytes of an inline text result, or None when its rows no longer make up the result
    recorded with ``sha256`` (they were expired meanwhile)."""
    body = inline_result_bytes(job_id=job_id, result_key=result_key)
    if body is None or hashlib.sha256(body).hexdigest() != sha256:
        return None
    return body


def inline_result_bytes(*, job_id: uuid.UUID, result_key: str) -> bytes | None:
    """An inline text result's bytes, read in one statement (one snapshot) from the done
    checkpoints at or below the result's generation (a resumed attempt's result includes pages
    an earlier generation converted; no later generation writes a published job's pages):
    ``assemble_result``'s text, UTF-8 pages joined by form feed in page order. None if the key
    is not this job's inline result or a done page is not inline."""
    parsed = storage.parse_key(result_key.removeprefix(INLINE_PREFIX))
    if not is_inline_result(result_key) or parsed is None or parsed.job_id != job_id:
        return None
    rows = list(
        PageCheckpoint.objects.filter(
            job_id=job_id, state=PageState.DONE, generation__lte=parsed.generation
        ).values_list("page_number", "artifact_key", "content")
    )
    if any(not (key or "").startswith(INLINE_PREFIX) for _page, key, _content in rows):
        return None
    return b"".join(join_text_pages([(page, bytes(content or b"")) for page, _k, content in rows]))


def page_checkpoints_by_page(
    *, job_id: uuid.UUID, first: int | None = None, last: int | None = None
) -> dict[int, PageCheckpoint]:
    """Every checkpoint of the job (between pages ``first`` and ``last``, when given), by page
    number: a resumed attempt skips the done and failed ones and reads the tries already spent
    on a pending one."""
    rows = PageCheckpoint.objects.filter(job_id=job_id)
    if first is not None and last is not None:
        rows = rows.filter(page_number__gte=first, page_number__lte=last)
    return {p.page_number: p for p in rows}


def page_checkpoint_done(
    *,
    lease: Lease,
    page: int,
    attempts: int,
    artifact_key: str,
    artifact_sha256: str,
    artifact_size: int,
    media_type: str,
    content: bytes | None = None,
) -> PageCheckpoint:
    """An unsaved ``done`` checkpoint of this attempt for the runner's batch (one per page).
    Built from positional values, Django's fast path (``Model.from_db`` builds rows the same
    way): keyword construction costs ≈ 14 µs a page, this ≈ 4 µs."""
    values = (  # in store.checkpoints.CHECKPOINT_COLUMNS order
        None,  # id
        lease.job_id,
        page,
        PageState.DONE,
        attempts,
        artifact_key,
        artifact_sha256,
        artifact_size,
        media_type,
        None,  # error_code
        lease.generation,
        None,  # updated_at: set when written
        content,
    )
    # django-stubs' plugin checks positional model arguments against a field order of its own.
    return PageCheckpoint(*values)  # type: ignore[misc]


def page_checkpoints_record(
    *, lease: Lease, checkpoints: list[PageCheckpoint], range_lease: RangeLease | None = None
) -> None:
    """Fenced upsert of a batch of page checkpoints (``store.checkpoints.batch_record``: a batch
    of done pages on Postgres is one statement, one round trip; otherwise the guarded UPDATE on
    the job row, which takes the row lock first, so a recovery or a cancel that commits before
    us makes it match zero rows: LeaseLost, nothing written; the upsert; COMMIT). With
    ``range_lease`` (a page range of a fanned-out job): :func:`_range_record`."""
    if range_lease is not None:
        _range_record(lease, range_lease, checkpoints)
        return
    if not store.batch_record(lease, checkpoints, also=lambda: _failed_audit(lease, checkpoints)):
        metrics.FENCED_WRITES_REFUSED.labels(statement="job_pages").inc()
        raise LeaseLost()
    for checkpoint in checkpoints:
        metrics.PAGES.labels(outcome=checkpoint.state).inc()


def _range_record(lease: Lease, range_lease: RangeLease, checkpoints: list[PageCheckpoint]) -> None:
    """A checkpoint batch of a page range, fenced twice in one transaction: the job row
    (generation, token, running) is locked, then the range row (its generation, token,
    running). A range recovered (or a job recovered, failed or cancelled) before this commits
    makes a lock match nothing: LeaseLost, nothing written, counted in
    ``quire_fenced_writes_refused_total{statement="range_pages"}``. A range writes only its own
    pages. Under the locks, the unsplit path's batch (one statement for done pages on Postgres:
    an ORM bulk upsert of 250 pages cost ≈ 150 ms of worker CPU, that ≈ 5 ms)."""
    if any(
        not range_lease.first_page <= c.page_number <= range_lease.last_page for c in checkpoints
    ):
        raise ValueError("a page range checkpoints only its own pages")
    with transaction.atomic():
        if not (job_row_lock(lease) and range_row_lock(range_lease)):
            metrics.FENCED_WRITES_REFUSED.labels(statement="range_pages").inc()
            raise LeaseLost()
        if not store.batch_record(
            lease, checkpoints, also=lambda: _failed_audit(lease, checkpoints)
        ):
            raise LeaseLost()  # cannot happen: the job row is locked under the lease
    for checkpoint in checkpoints:
        metrics.PAGES.labels(outcome=checkpoint.state).inc()


def checkpoints_upsert(lease: Lease, checkpoints: list[PageCheckpoint]) -> None:
    """The upsert and the audit events of failed pages; the caller holds the fenced row."""
    store.upsert(checkpoints)
    _failed_audit(lease, checkpoints)


def _failed_audit(lease: Lease, checkpoints: list[PageCheckpoint]) -> None:
    for checkpoint in checkpoints:
        if checkpoint.state == PageState.FAILED:
            audit_event_append(
                job_id=lease.job_id,
                event_type="page_failed",
                generation=lease.generation,
                attempt_id=lease.attempt_id,
                details={"page": checkpoint.page_number, "code": checkpoint.error_code},
            )


class CheckpointBatch:
    """Finished pages waiting for their fenced checkpoint write. Writing one transaction per
    page made the commit (a WAL flush) the cost of a text page; a batch is written when it holds
    ``MAX_PAGES`` pages or its oldest page has waited ``MAX_WAIT_S``, always before a failed page
    or an error, and the last batch inside the publishing transaction. A crash loses at most one
    batch, which a resumed attempt converts again; a page is never skipped unless its checkpoint
    committed. Small text pages have no stored object: their bytes ride in the checkpoint row
    (``content``) and are durable exactly when it commits, so a page is never half there. Other
    page artifacts are stored without waiting (``storage.put_file(wait=False)``: on
    the filesystem renamed at once and ``fsync``ed on background threads, on S3 uploaded by
    background threads); every one of them is complete and durable before their checkpoints are
    written (``durable``). Artifacts of pages that never got their checkpoint are deleted on the
    way out, so nothing is orphaned."""

    MAX_PAGES = 256
    MAX_WAIT_S = 0.25

    def __init__(
        self, lease: Lease, checkpoints: dict[int, Any], range_lease: RangeLease | None = None
    ) -> None:
        self.lease, self.checkpoints, self.range_lease = lease, checkpoints, range_lease
        self.pending: list[PageCheckpoint] = []
        self.puts: list[storage.Put] = []
        self.since = 0.0

    def __enter__(self) -> CheckpointBatch:
        return self

    def __exit__(self, *exc: object) -> None:
        storage.abandon(self.puts)
        self.puts = []
        for checkpoint in self.pending:  # never recorded: leave no artifact behind
            if not (checkpoint.artifact_key or "").startswith(INLINE_PREFIX):
                storage.delete(checkpoint.artifact_key or "")
        self.pending = []

    def add(self, checkpoint: PageCheckpoint, put: storage.Put | None) -> None:
        """``checkpoint``'s artifact is being stored by ``put`` (not yet settled), or is inline
        (``put`` None: its bytes are in the checkpoint and commit with it)."""
        if not self.pending:
            self.since = time.monotonic()
        self.pending.append(checkpoint)
        if put is not None:
            self.puts.append(put)

    def durable(self) -> None:
        """Wait until every pending page artifact is complete and durable in the store (an
        OSError here is a storage error: nothing gets recorded)."""
        storage.settle(self.puts)  # on failure the puts stay, for __exit__ to abandon
        self.puts = []

    def flush_if_due(self) -> None:
        if len(self.pending) >= self.MAX_PAGES or (
            self.pending and time.monotonic() - self.since >= self.MAX_WAIT_S
        ):
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        self.durable()
        self._record(list(self.pending))
        self.written()

    def record(self, page: int, state: PageState, *, attempts: int, error_code: str) -> None:
        """Checkpoint a page not done (pending with tries left, or failed) at once, after the
        pages waiting: ``attempts``, the tries spent on it so far, and the last ``error_code``.
        (A done page is batched: ``add``.)"""
        self.flush()
        checkpoint = PageCheckpoint(
            job_id=self.lease.job_id,
            page_number=page,
            state=state,
            attempts=attempts,
            error_code=error_code,
            generation=self.lease.generation,
        )
        self._record([checkpoint])
        self.checkpoints[page] = checkpoint

    def _record(self, checkpoints: list[PageCheckpoint]) -> None:
        """The fenced write (on the range lease too, for a page range), retried."""
        db_retry(
            page_checkpoints_record,
            lease=self.lease,
            checkpoints=checkpoints,
            range_lease=self.range_lease,
        )

    def written(self) -> None:
        """The pending checkpoints committed (here or in the publishing transaction)."""
        for checkpoint in self.pending:
            self.checkpoints[checkpoint.page_number] = checkpoint
        self.pending = []
