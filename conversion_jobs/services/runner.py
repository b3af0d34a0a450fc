"""Runs one claimed attempt page by page (docs/ARCHITECTURE.md §2 steps 4-9, §5).

The worker thread converts; a heartbeat thread (``heartbeat.py``) extends the lease and raises
the stop flag when the job is being cancelled or the lease is lost. Converters check the flag
while their child process runs and kill its process group when it is set. Finished pages go to
a ``CheckpointBatch`` (``checkpoints.py``); database calls are retried across a Postgres restart
(``db_retry.py``).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from django.conf import settings
from django.db import transaction

from conversion_jobs import converters, storage
from conversion_jobs.converters import (
    ConversionError,
    ConversionStarved,
    ConversionStopped,
    Limits,
)
from conversion_jobs.converters.aside import AsideSettings
from conversion_jobs.converters.base import PAGE_EXT, RESULT_EXT, ZIP, PageRequest
from conversion_jobs.converters.engines import EngineSettings, configure
from conversion_jobs.converters.errors import SourceMissing
from conversion_jobs.converters.isolation import empty_directory
from conversion_jobs.converters.registry import engine_label
from conversion_jobs.models import ConversionJob, PageState
from conversion_jobs.observability import metrics, tracing
from conversion_jobs.passwords import sealed_passwords_wipe, unseal
from conversion_jobs.pseudonym import pseudonym
from conversion_jobs.services import execution, fair, fanout, quarantine
from conversion_jobs.services.checkpoints import (
    INLINE_PREFIX,
    CheckpointBatch,
    inline_content,
    page_checkpoint_done,
    page_checkpoints_by_page,
)
from conversion_jobs.services.db_retry import (
    DB_ERRORS,
    connections_refresh,
    db_retry,
    db_retry_until,
)
from conversion_jobs.services.heartbeat import Heartbeat
from conversion_jobs.services.leases import Lease, LeaseLost, job_state_under_lease
from conversion_jobs.services.recovery import SPARE_WORKDIR_PREFIX
from conversion_jobs.services.tidying import tidy_later, tidy_wait
from conversion_jobs.services.zipresult import zip_result_digest, zip_result_key
from conversion_jobs.states import State

log = logging.getLogger(__name__)

#: How long a claim keeps retrying across a database outage (it holds no lease yet).
CLAIM_DEADLINE_S = 60


def worker_identity() -> str:
    """``<host>:<pid>``; the host is ``QUIRE_WORKER_HOST`` (the machine's name by default),
    which the quarantine counts hosts by (services/quarantine.py)."""
    return f"{settings.QUIRE['WORKER_HOST']}:{os.getpid()}"


def limits_from_settings() -> Limits:
    return Limits(**settings.QUIRE.get("CONVERTER_LIMITS", {}))


def reuse_settings_from_settings() -> converters.ReuseSettings:
    return converters.ReuseSettings(
        mode=settings.QUIRE["CONVERTER_REUSE"],
        max_attempts=settings.QUIRE["CONVERTER_REUSE_MAX_ATTEMPTS"],
        max_rss_bytes=settings.QUIRE["CONVERTER_REUSE_MAX_RSS_MB"] * 1024 * 1024,
    )


def engine_settings_from_settings() -> EngineSettings:
    return EngineSettings(
        mode=settings.QUIRE["OFFICE_ENGINE"],
        max_conversions=settings.QUIRE["OFFICE_ENGINE_MAX_CONVERSIONS"],
        max_rss_bytes=settings.QUIRE["OFFICE_ENGINE_MAX_RSS_MB"] * 1024 * 1024,
        scratch_dir=Path(settings.QUIRE["WORK_DIR"]) / ".engines",
        aside=AsideSettings(
            after_s=settings.QUIRE["STEP_ASIDE_AFTER_S"],
            wall_factor=settings.QUIRE["STEP_ASIDE_WALL_FACTOR"],
        ),
    )


def conversion_job_execute(
    *,
    job_id: uuid.UUID,
    generation: int,
    then: Callable[[fanout.RangeClaim], str] | None = None,
) -> str:
    """Claim and run one delivery. Returns what happened (for logs and tests): ``duplicate``,
    ``succeeded``, ``partial``, ``failed``, ``retry_wait``, ``cancelled``, ``lost`` or
    ``fanned_out``. ``then``: when the attempt fans the job out (ADR 0023), it keeps the first
    range, claimed in the plan, and ``then(claim)`` runs it in this slot once the attempt has
    ended (``range_runner``); without it every range waits for a message."""
    connections_refresh()
    converters.sandbox.configure(work_dir=settings.QUIRE["WORK_DIR"])
    claim = db_retry_until(
        CLAIM_DEADLINE_S,
        execution.conversion_job_claim,
        job_id=job_id,
        generation=generation,
        worker=worker_identity(),
    )
    if claim is None:
        return "duplicate"
    lease = claim.lease
    heartbeat = Heartbeat(lease)
    heartbeat.start()
    # The end of this process's previous attempt (its work dir's removal, the spare child) ran
    # while this claim did; it is over before this attempt has a file or a converter.
    tidy_wait()
    # One directory per attempt straight under WORK_DIR (no per-job parent: one mkdir and one
    # rmdir fewer per job; recovery.work_dirs_remove_stale reads the name).
    workdir = _workdir_make(
        Path(settings.QUIRE["WORK_DIR"]) / f"{job_id}.{lease.attempt_id}-{lease.token.hex}"
    )
    converters.configure_reuse(reuse_settings_from_settings())
    # The converter layer sees the tenant only as an opaque pseudonym (reuse within a tenant).
    converters.begin_attempt(tenant=pseudonym("tenant", claim.job.tenant))
    outcome = "lost"
    kept: list[fanout.RangeClaim] | None = [] if then is not None else None
    try:
        outcome = _run(claim, heartbeat=heartbeat, workdir=workdir, kept=kept)
    finally:
        heartbeat.finish()
        if claim.job.password_sealed is not None and outcome in _TERMINAL_OUTCOMES:
            db_retry(sealed_passwords_wipe, job_id=job_id)
        # This attempt's converter child and its process group end here (or, reused within a
        # tenant, it is kept reset); then its work dir goes and a spare child is started, after
        # the task returns (tidying.py: the next attempt of this process waits for them).
        converters.release(spare=False)
        converters.begin_attempt(tenant=None)
        tidy_later(functools.partial(_tidy, workdir))
        # The attempt's slot is free, or (fanned out) the ranges just planned wait for the other
        # slots: the relay picks now either way.
        fair.slot_freed()
    if kept and then is not None:
        return then(kept[0])
    return outcome


def _tidy(workdir: Path) -> None:
    """The end of an attempt that runs on the tidying thread: its work dir is emptied and
    renamed to a spare for this process's next attempt (or removed), then a spare converter
    child is started if there is none."""
    global _spare_workdir
    spare = workdir.with_name(f"{SPARE_WORKDIR_PREFIX}{uuid.uuid4().hex}")
    try:
        if not empty_directory(workdir):
            raise OSError("not emptied")
        os.rename(workdir, spare)
        _spare_workdir = (os.getpid(), spare)
    except OSError:
        shutil.rmtree(workdir, ignore_errors=True)
    converters.warm()


#: (pid, path): this process's spare work dir. Written by the tidying thread, taken after
#: ``tidy_wait()``; a forked process ignores its parent's.
_spare_workdir: tuple[int, Path] | None = None


def _workdir_make(workdir: Path) -> Path:
    """This attempt's work dir, empty and 0700: the process's spare renamed (on this machine's
    ext4 a directory made and removed per attempt cost ≈ 0.3 ms of kernel CPU in the inode
    allocator; a rename next to nothing: ADR 0017, session 7), else a new one. Its mtime is
    set now, as a new directory's would be: the stale-work-dir sweep leaves young directories
    alone."""
    global _spare_workdir
    spare, _spare_workdir = _spare_workdir, None
    if spare is not None and spare[0] == os.getpid():
        try:
            os.rename(spare[1], workdir)  # fails if the sweep removed it meanwhile
        except OSError:
            shutil.rmtree(spare[1], ignore_errors=True)
        else:
            os.utime(workdir)
            return workdir
    workdir.mkdir(parents=True, mode=0o700)
    return workdir


#: What ``_run`` returns when the job is now terminal (its sealed password is wiped at once).
_TERMINAL_OUTCOMES = frozenset({"succeeded", "partial", "failed", "cancelled"})


def _run(
    claim: execution.Claim,
    *,
    heartbeat: Heartbeat,
    workdir: Path,
    kept: list[fanout.RangeClaim] | None = None,
) -> str:
    lease, job = claim.lease, claim.job
    #: the page count prepare found, while it is still to be recorded (see _convert)
    unrecorded: dict[str, int] = {}
    try:
        return _convert(
            claim, heartbeat=heartbeat, workdir=workdir, unrecorded=unrecorded, kept=kept
        )
    except (LeaseLost, ConversionStopped):
        return _stopped(lease=lease)
    except _QuarantineFailed as ended:
        return ended.outcome if ended.outcome == "failed" else _stopped(lease=lease)
    except ConversionStarved as exc:
        # It stepped aside and the load starved it (ADR 0022): not a crash and not an attempt;
        # the job goes back into the fair order at its cost, and its next attempt keeps its
        # slot (store.fair.STEP_ASIDE reads the code on the attempt).
        if db_retry(
            execution.conversion_job_yield,
            lease=lease,
            traceparent=job.traceparent,
            cost=job.dispatch_cost,
            error_code=exc.code,
        ):
            return "yielded"
        return _stopped(lease=lease)
    except ConversionError as exc:
        code = exc.code
        if quarantine.is_crash(code):
            ended_as = db_retry(_crash_noted, lease=lease, job=job, code=code)
            if ended_as is not None:
                return ended_as if ended_as == "failed" else _stopped(lease=lease)
        if exc.retryable:
            state = db_retry(execution.conversion_job_retry_later, lease=lease, code=code)
            return str(state) if state else _stopped(lease=lease)
        try:
            execution.page_count_record_deferred(lease, unrecorded)
        except LeaseLost:
            return _stopped(lease=lease)
        # The detail is stored (and shown) only if it holds nothing of the document.
        detail = exc.detail if exc.public else code
        won = db_retry(execution.conversion_job_fail, lease=lease, code=code, detail=detail)
        return "failed" if won else _stopped(lease=lease)
    except DB_ERRORS:
        # The database stayed away longer than the lease: the sweep will recover the job.
        return "lost"
    except OSError:
        log.warning("storage error during conversion", exc_info=False)
        state = db_retry(execution.conversion_job_retry_later, lease=lease, code="storage_error")
        return str(state) if state else _stopped(lease=lease)


class _QuarantineFailed(Exception):
    """A page's converter crash quarantined the document: the job is failed (``outcome``
    "failed") or the fence was lost meanwhile ("lost")."""

    def __init__(self, outcome: str) -> None:
        super().__init__(outcome)
        self.outcome = outcome


def _crash_noted(*, lease: Lease, job: ConversionJob, code: str) -> str | None:
    """This attempt's converter crashed (``code``): record it against the document
    (``quarantine.document_crash_record``, the one decision; at most one crash per attempt)
    and, when the document is now quarantined, fail the job ``document_quarantined`` in the
    same transaction, fenced. None: not quarantined (the error takes its usual path);
    "failed"; or "lost" (the fence was lost: nothing but the crash row is written)."""
    with transaction.atomic():
        verdict = quarantine.document_crash_record(
            tenant=job.tenant,
            source_sha256=job.source_sha256,
            engine_version=converters.engine_version(job.source_media_type),
            job_id=lease.job_id,
            attempt_id=lease.attempt_id or 0,  # a worker's lease always has one
            worker=worker_identity(),
            code=code,
        )
        if not verdict.quarantined:
            return None
        won = execution.conversion_job_fail(
            lease=lease,
            code=quarantine.QUARANTINED,
            detail=f"the converter crashed on {verdict.crashes} attempts; the document is"
            " quarantined",
            event_type="document_quarantined",
            details={
                "code": quarantine.QUARANTINED,
                "crash": code,
                "crashes": verdict.crashes,
                "hosts": verdict.hosts,
            },
        )
    return "failed" if won else "lost"


def _stopped(*, lease: Lease) -> str:
    """The attempt stops: cancelled (we still hold the lease of a CANCELLING job) or lost."""
    state = db_retry(job_state_under_lease, lease=lease)
    if state == State.CANCELLING and db_retry(execution.conversion_job_finish_cancel, lease=lease):
        return "cancelled"
    db_retry(execution.attempt_record_lease_lost, lease=lease)
    return "lost"


def _selected_pages(options: dict[str, Any], page_count: int) -> list[int]:
    """The pages ``options.pages`` selects; a range that does not end within the document
    fails the job ``invalid_input`` (docs/API_CONTRACT.md §2.1), whatever the input type: every
    converter's page count (PDF pages, image frames, LibreOffice's PDF) is resolved here."""
    pages = options.get("pages")
    if not pages:
        return list(range(1, page_count + 1))
    first, last = pages
    if last > page_count:
        raise converters.InvalidInput(
            f"the requested page range {first}-{last} exceeds the page count ({page_count})",
            public=True,
        )
    return list(range(first, last + 1))


def _first_pages(options: dict[str, Any]) -> tuple[int, ...]:
    """The pages a first run asks for first, before the page count is known: its selected
    range's first ``2 * READ_AHEAD_PAGES`` (those beyond the document are dropped by the
    converter), which is what ``_convert`` would request once it knows the count."""
    first, last = options.get("pages") or (1, None)
    stop = first + 2 * converters.READ_AHEAD_PAGES
    return tuple(range(first, stop if last is None else min(last + 1, stop)))


def _options_for_attempt(options: dict[str, Any], lease: Lease) -> dict[str, Any]:
    """The options given to the converter. A test fault (honoured only with
    QUIRE_ENABLE_TEST_FAULTS=1, see converters/isolation.py) may say ``until_attempt`` or
    ``until_generation``: it then applies only while the job's durable attempt counter (or its
    generation) is at most N, so "fail three times, then succeed" lives in Postgres, not in any
    worker's memory."""
    fault = options.get("_test_fault")
    if not isinstance(fault, dict):
        return options
    over = ("until_attempt" in fault and lease.attempt_number > int(fault["until_attempt"])) or (
        "until_generation" in fault and lease.generation > int(fault["until_generation"])
    )
    if over:
        return {k: v for k, v in options.items() if k != "_test_fault"}
    return options


def _attempt_options(job: ConversionJob, lease: Lease, *, password: bool = True) -> dict[str, Any]:
    """The options this attempt gives its converter (``_options_for_attempt``), with the job's
    password unsealed into them (unless ``password`` is False: a page range of an Office
    document reads the PDF it was converted to, which has none)."""
    options = _options_for_attempt(job.options, lease)
    if password and job.password_sealed is not None:
        clear = unseal(job.password_sealed)
        if clear is None:  # the service key changed since acceptance
            raise converters.PasswordRequired()
        # In this attempt's memory only; the converter passes it to its child over a pipe.
        options = {**options, "password": clear}
    return options


def _convert(
    claim: execution.Claim,
    *,
    heartbeat: Heartbeat,
    workdir: Path,
    unrecorded: dict[str, int],
    kept: list[fanout.RangeClaim] | None = None,
) -> str:
    """``claim.job``: the row as the claim read it back (options, source, output never
    change); ``claim.source``: an inline source's bytes, as the claim read them with the row.
    ``unrecorded`` gets the page count when its recording is deferred to the publish."""
    lease, job, source_bytes = claim.lease, claim.job, claim.source
    options = _attempt_options(job, lease)
    configure(engine_settings_from_settings())
    converter = converters.converter_for(job.source_media_type, job.output)
    # The converter reads a copy in the attempt's work directory, never the store itself.
    source = workdir / "source"
    if storage.is_inline_source(job.source_key):
        if source_bytes is None:  # the row went with its job (retention) meanwhile
            raise SourceMissing()
        fd = os.open(source, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with open(fd, "wb") as fh:
            fh.write(source_bytes)
    else:
        storage.download(job.source_key, source)
    started = time.monotonic()
    request = _prepared(
        converter,
        job=job,
        source=source,
        media_type=job.source_media_type,
        options=options,
        workdir=workdir,
        stop=heartbeat.stop.is_set,
        step_aside=fair.step_aside_for(lease) if fair.enabled() else None,
        # A first run converts its selected pages from the first on: the prepare asks for them
        # in its own request (a resumed attempt first reads which pages are done, so it does
        # not; nor does a job its acceptance estimate says will fan out: its planner converts
        # no page).
        first=_first_pages(job.options)
        if lease.first_run and not fanout.fanout_likely(job)
        else (),
    )
    metrics.CONVERSION_DURATION.labels(
        input=job.source_media_type, engine=engine_label(converter)
    ).observe(time.monotonic() - started)
    prepared = request.prepared
    if job.source_page_count != prepared.page_count:
        unrecorded["page_count"] = prepared.page_count
    pages = _selected_pages(job.options, prepared.page_count)  # terminal errors record it (_run)
    checkpoints = {} if lease.first_run else db_retry(page_checkpoints_by_page, job_id=lease.job_id)
    todo = _unfinished(pages, checkpoints)  # a resumed job never redoes a finished page
    if fanout.fanout_wanted(job=job, todo=todo):
        # Long enough to split: the pages go to page ranges that any worker claims, and this
        # attempt ends here (ADR 0023). The ranges' progress needs the count first.
        execution.page_count_record_deferred(lease, unrecorded)
        return fanout.conversion_job_fan_out(
            claim,
            pages=pages,
            todo=todo,
            prepared=prepared,
            heartbeat=heartbeat,
            kept=kept,
            worker=worker_identity(),
        )
    if len(pages) != 1 and not prepared.first_requested:
        # The child starts on the first pages (exactly what the first page call would ask for)
        # while the count is recorded: that round trip no longer delays the pages.
        converter.request_pages(request, pages=todo[: 2 * converters.READ_AHEAD_PAGES])
    if len(pages) != 1:
        # Progress needs the count now. With one page to convert the publish records it (no
        # UPDATE of its own), or a terminal failure first.
        execution.page_count_record_deferred(lease, unrecorded)
    return _convert_pages(
        PageRun(
            batch=CheckpointBatch(lease, checkpoints),
            job=job,
            converter=converter,
            request=request,
            pages=pages,
            todo=todo,
            unrecorded=unrecorded,
        )
    )


def _prepared(
    converter: converters.Converter,
    *,
    job: ConversionJob,
    source: Path,
    media_type: str,
    options: dict[str, Any],
    workdir: Path,
    stop: Callable[[], bool],
    first: Sequence[int],
    step_aside: converters.StepAside | None = None,
) -> PageRequest:
    """The ``source`` document prepared (``first``: the pages to ask for with the prepare) and
    the request of its pages: this job's output and options, the work dir, the limits, the
    stop flag and, for a text job, the largest page that comes back from the child as bytes
    (it then rides in its checkpoint row)."""
    inline_max = settings.QUIRE["INLINE_PAGE_MAX_BYTES"] if job.output == "text" else 0
    first_pages = converters.FirstPages(
        pages=tuple(first), output=job.output, inline_max_bytes=inline_max
    )
    request = converters.PrepareRequest(
        source=source,
        media_type=media_type,
        workdir=workdir,
        limits=limits_from_settings(),
        should_stop=stop,
        options=options,
        first=first_pages,
        step_aside=step_aside,
    )
    prepared = converter.prepare(request)
    return request.pages(prepared, output=job.output, inline_max_bytes=inline_max)


def _unfinished(pages: list[int], checkpoints: dict[int, Any]) -> list[int]:
    """The pages of ``pages`` (in order) with no final (done or failed) checkpoint."""
    return [
        page
        for page in pages
        if checkpoints.get(page) is None
        or checkpoints[page].state not in (PageState.DONE, PageState.FAILED)
    ]


@dataclass(frozen=True)
class PageRun:
    """What ``_convert_pages`` works on: an attempt's pages, or a page range's (ADR 0023).
    ``batch``: the checkpoint batch the pages go to, not entered yet; it holds the lease its
    writes are fenced on (and a page range's ``range_lease``: every checkpoint is fenced on it
    too) and the pages' checkpoints as read (a page that fails is added). ``request``: the
    converter's page request (its ``dest_dir`` is the work dir, its ``inline_max_bytes`` the
    largest text page that rides in its checkpoint row, 0: none). ``todo``: the pages of
    ``pages`` still to convert, in order. ``unrecorded``: the page count while it is still to
    be recorded (``_convert``; a page range's never is). A page range passes ``finish``
    (called once its last batch is written, instead of ``_finalize``)."""

    batch: CheckpointBatch
    job: ConversionJob
    converter: converters.Converter
    request: PageRequest
    pages: list[int]
    todo: list[int]
    unrecorded: dict[str, int] = field(default_factory=dict)
    finish: Callable[[], str] | None = None


def _convert_pages(run: PageRun) -> str:
    """Convert ``run.todo`` page by page (each page up to ``PAGE_MAX_ATTEMPTS`` tries) into
    the run's checkpoint batch, yield the worker at a page boundary past the fair slice, then
    finalize (or ``run.finish``)."""
    with run.batch as batch, _slot_held(run.job.tenant) as slice_:
        local: dict[int, Path] = {}  # pages of this attempt: where their bytes are on this host
        page_budget = settings.QUIRE["PAGE_MAX_ATTEMPTS"]
        for index, page in enumerate(run.todo):
            if run.request.should_stop():  # the heartbeat's stop flag
                raise ConversionStopped()
            batch.flush_if_due()
            # A unit converts a page before it may yield (the fair order just gave it the
            # slot), and one with a page left finishes it: a one- or two-page job never asks.
            # A page range yields alone: its job and its other ranges go on (ADR 0021).
            left = len(run.todo) - index
            if (
                index > 0
                and left > 1
                and slice_.due()
                and _yield_if_others_wait(job=run.job, batch=batch, left=left)
            ):
                return "yielded"
            lookahead = run.todo[index + 1 : index + 2 * converters.READ_AHEAD_PAGES]
            artifact, tries = _page_converted(run, page, lookahead=lookahead, budget=page_budget)
            if artifact is not None:
                _page_stored(run, page, artifact=artifact, tries=tries, local=local)
        if run.finish is not None:
            batch.flush()
            return run.finish()
        return _finalize(
            batch=batch,
            job=run.job,
            pages=run.pages,
            document=run.request.prepared.document,
            workdir=run.request.dest_dir,
            local=local,
            unrecorded=run.unrecorded,
        )


def _page_converted(
    run: PageRun, page: int, *, lookahead: list[int], budget: int
) -> tuple[Any, int]:
    """``page`` converted, tried again after an error until ``budget`` tries (counting those
    of earlier attempts); the artifact and the tries before it. ``(None, tries)``: the page
    failed for good (checkpointed failed). A retryable error within the budget is
    checkpointed pending and raised: the job tries again later."""
    batch = run.batch
    done = batch.checkpoints.get(page)
    tries = done.attempts if done is not None else 0
    while True:
        try:
            with tracing.page_span(page):
                artifact = run.converter.convert_page(run.request, page=page, lookahead=lookahead)
            return artifact, tries
        except ConversionStopped:
            raise
        except ConversionError as exc:
            tries += 1
            exhausted = tries >= budget or exc.code in ("conversion_timeout", "input_too_large")
            batch.flush()
            if exc.retryable and not exhausted:
                batch.record(page, PageState.PENDING, attempts=tries, error_code=exc.code)
                raise
            if exhausted:
                _page_failed(run, page, tries=tries, exc=exc)
                return None, tries


def _page_failed(run: PageRun, page: int, *, tries: int, exc: ConversionError) -> None:
    """``page`` failed for good: a crash counts against the document (it may quarantine it and
    end the job), then the page is checkpointed failed."""
    if quarantine.is_crash(exc.code):
        # A crash that fails only its page still counts against the document.
        ended_as = db_retry(_crash_noted, lease=run.batch.lease, job=run.job, code=exc.code)
        if ended_as is not None:
            raise _QuarantineFailed(ended_as) from exc
    run.batch.record(page, PageState.FAILED, attempts=tries, error_code=exc.code)


def _page_stored(
    run: PageRun, page: int, *, artifact: Any, tries: int, local: dict[int, Path]
) -> None:
    """A converted page goes to the batch: a small text page in its checkpoint row, any other
    stored as an object (``local`` notes where its bytes are on this host)."""
    batch, job = run.batch, run.job
    lease = batch.lease
    key = storage.page_key(
        job_id=lease.job_id, page=page, generation=lease.generation, ext=PAGE_EXT[job.output]
    )
    if artifact.content is not None:
        sha, size = hashlib.sha256(artifact.content).hexdigest(), len(artifact.content)
    else:
        sha, size = storage.sha256_file(_path(artifact))
    done = functools.partial(
        page_checkpoint_done,
        lease=lease,
        page=page,
        attempts=tries + 1,
        artifact_sha256=sha,
        artifact_size=size,
        media_type=artifact.media_type,
    )
    if job.output == "text" and size <= run.request.inline_max_bytes:
        # A small text page rides in its checkpoint row: durable when the batch commits.
        content = artifact.content if artifact.content is not None else _path(artifact).read_bytes()
        batch.add(done(artifact_key=INLINE_PREFIX + key, content=content), None)
    else:
        put = storage.put_file(key, _path(artifact), wait=False, sha256=sha)
        local[page] = put.local
        batch.add(done(artifact_key=key), put)


#: The slot clock (ADR 0021, "A range yields") of the slot this thread is (a pool process, or a
#: thread of a threads pool): the tenant whose work it runs, since when without a break, and
#: when its last unit ended (None: a unit is running).
_slot = threading.local()

#: A slot idle this long between two units of one tenant held nothing in between: the clock
#: starts again.
SLOT_IDLE_RESET_S = 1.0


class _Slice:
    """When a unit (an attempt, a page range) may give its worker back: ``QUIRE_FAIR_SLICE_S``
    after ``since``, when its slot began running this tenant's work without a break (0 or fair
    dispatch off: never). Past the slice, it asks every ``QUIRE_FAIR_CHECK_S`` whether another
    tenant waits."""

    def __init__(self, since: float) -> None:
        q = settings.QUIRE
        self.seconds = q["FAIR_SLICE_S"] if fair.enabled() else 0.0
        self.check_s = q["FAIR_CHECK_S"]
        self.next_check = since + self.seconds

    def due(self) -> bool:
        if self.seconds <= 0:
            return False
        now = time.monotonic()
        if now < self.next_check:
            return False
        self.next_check = now + self.check_s
        return True


@contextlib.contextmanager
def _slot_held(tenant: str) -> Iterator[_Slice]:
    """A unit of ``tenant`` runs in this slot while the block runs; its slice counts on the
    slot's clock. Consecutive units of one tenant share the clock (a fanned-out job's ranges,
    each shorter than the slice, add up like one long attempt); another tenant's unit, or the
    slot idle for ``SLOT_IDLE_RESET_S``, starts it again."""
    now = time.monotonic()
    ended = getattr(_slot, "ended", None)
    held = (
        getattr(_slot, "tenant", None) == tenant
        and ended is not None
        and now - ended < SLOT_IDLE_RESET_S
    )
    _slot.tenant, _slot.since, _slot.ended = tenant, _slot.since if held else now, None
    try:
        yield _Slice(_slot.since)
    finally:
        _slot.ended = time.monotonic()


def _yield_if_others_wait(*, job: ConversionJob, batch: CheckpointBatch, left: int) -> bool:
    """At a page boundary past the slice: when another tenant's work waits with no free slot,
    checkpoint the pages done so far and end the attempt ``yielded`` (docs/ARCHITECTURE.md
    §2b); the job is queued again at the cost of its ``left`` pages. A page range yields alone
    (``fanout.range_yield``). False: keep converting. A yield that loses its fence (a cancel, a
    lost lease) raises ``LeaseLost``."""
    if not db_retry(fair.others_waiting, tenant=job.tenant):
        return False
    batch.flush()  # the next attempt skips every page done so far
    if batch.range_lease is not None:
        if db_retry(
            fanout.range_yield, range_lease=batch.range_lease, lease=batch.lease, pages_left=left
        ):
            return True
        raise LeaseLost()
    cost = fair.dispatch_cost(
        media_type=job.source_media_type,
        size=job.source_size,
        output=job.output,
        options=job.options,
        pages=left,
    )
    if db_retry(
        execution.conversion_job_yield, lease=batch.lease, traceparent=job.traceparent, cost=cost
    ):
        return True
    raise LeaseLost()


def _path(artifact: Any) -> Path:
    """The file of a page artifact that is not inline (a converter bug otherwise)."""
    if artifact.path is None:
        raise RuntimeError("an inline page artifact where a file was expected")
    return Path(artifact.path)


def _page_source(checkpoint: Any, local: dict[int, Any], workdir: Path) -> Path | bytes:
    """A done page's artifact for assembly: its bytes when inline in its row, else the local
    file this attempt stored, else a copy fetched from the artifact store."""
    content = inline_content(checkpoint)
    if content is not None:
        return content
    return local.get(checkpoint.page_number) or _fetch(checkpoint.artifact_key, workdir)


def _fetch(key: str, workdir: Path) -> Path:
    folder = workdir / "stored-pages"
    folder.mkdir(mode=0o700, exist_ok=True)
    dest = folder / key.rsplit("/", 1)[-1]
    storage.download(key, dest)
    return dest


def _finalize(
    *,
    batch: CheckpointBatch,
    job: ConversionJob,
    pages: list[int],
    document: Path,
    workdir: Path,
    local: dict[int, Path],
    unrecorded: dict[str, int],
) -> str:
    """Assemble the result from page artifacts (``document``: the prepared document, a pdf
    job's source of LibreOffice's own PDF) and publish it with one fenced CAS (on
    ``batch.lease``); the pages still waiting in ``batch`` are checkpointed in that same
    transaction. Pages an earlier attempt converted are fetched from the store into the work
    directory first."""
    lease, checkpoints = batch.lease, batch.checkpoints
    pending = {c.page_number: c for c in batch.pending}
    outcome = {**checkpoints, **pending}
    done_pages = [p for p in pages if outcome[p].state == PageState.DONE]
    failed = [p for p in pages if outcome[p].state == PageState.FAILED]
    if failed and (not done_pages or not job.options.get("allow_partial", True)):
        return _finalize_failed(
            lease=lease,
            batch=batch,
            unrecorded=unrecorded,
            code=checkpoints[failed[0]].error_code or "page_failed",
            failed=len(failed),
        )
    result = _assembled(
        lease=lease,
        job=job,
        done=[(p, outcome[p]) for p in done_pages],
        document=document,
        workdir=workdir,
        local=local,
    )
    batch.durable()  # the last pages are checkpointed by the publishing transaction
    state = State.PARTIAL if failed else State.SUCCEEDED
    won = db_retry(
        execution.conversion_job_publish,
        lease=lease,
        state=state,
        result=execution.Result(
            key=result.key,
            sha256=result.sha256,
            size=result.size,
            media_type=result.media_type,
            pages_done=len(done_pages),
            pages_failed=len(failed),
            page_count=unrecorded.get("page_count"),
        ),
        checkpoints=list(pending.values()),
    )
    if not won:
        return _publish_refused(lease=lease, result=result)
    batch.written()
    return state.value


def _finalize_failed(
    *,
    lease: Lease,
    batch: CheckpointBatch,
    unrecorded: dict[str, int],
    code: str,
    failed: int,
) -> str:
    """Every selected page failed (or one did and the job does not allow a partial result):
    the job fails with the first failed page's ``code``."""
    batch.flush()
    execution.page_count_record_deferred(lease, unrecorded)
    won = db_retry(
        execution.conversion_job_fail, lease=lease, code=code, detail=f"{failed} page(s) failed"
    )
    return "failed" if won else _stopped(lease=lease)


class _Assembled(NamedTuple):
    """A result ready to publish; ``stored``: an object of its own in the artifact store
    (else it is made of page artifacts or checkpoint rows, and nothing is to delete)."""

    key: str
    sha256: str
    size: int
    media_type: str
    stored: bool


def _assembled(
    *,
    lease: Lease,
    job: ConversionJob,
    done: list[tuple[int, Any]],
    document: Path,
    workdir: Path,
    local: dict[int, Path],
) -> _Assembled:
    """The result of the ``done`` pages (page, checkpoint): a PNG job's ZIP (hashed here,
    streamed by the web, never stored: zipresult), a text job's checkpoint rows when every page
    is inline and they are small enough, else a file assembled and stored."""
    if job.output == "png":
        key = zip_result_key(job_id=lease.job_id, generation=lease.generation)
        with tracing.tracer.start_as_current_span("conversion.finalize"):
            sha, size = zip_result_digest(done=done, local=local)
        return _Assembled(key, sha, size, ZIP, stored=False)
    sources = [(p, _page_source(checkpoint, local, workdir)) for p, checkpoint in done]
    key = storage.result_key(
        job_id=lease.job_id, generation=lease.generation, ext=RESULT_EXT[job.output]
    )
    inline_pages = [(page, source) for page, source in sources if isinstance(source, bytes)]
    with tracing.tracer.start_as_current_span("conversion.finalize"):
        inline_size = sum(len(body) for _page, body in inline_pages) + len(sources)
        if (
            job.output == "text"
            and len(inline_pages) == len(sources)
            and inline_size <= settings.QUIRE["INLINE_RESULT_MAX_BYTES"]
        ):
            # Every page is in its checkpoint row: the result is those rows, joined when read
            # (ADR 0017, "inline text results"). No file, no fsync; durable with the publish.
            media_type, sha, size = converters.inline_text_result(pages=inline_pages)
            return _Assembled(INLINE_PREFIX + key, sha, size, media_type, stored=False)
        assembled = workdir / "result.out"
        media_type = converters.assemble_result(
            output=job.output,
            pages=sources,
            dest=assembled,
            prepared_document=document,
        )
        sha, size = storage.sha256_file(assembled)
        storage.put_file(key, assembled, sha256=sha)
    return _Assembled(key, sha, size, media_type, stored=True)


def _publish_refused(*, lease: Lease, result: _Assembled) -> str:
    """The fenced publish lost: a cancelled or recovered job never shows this attempt's result;
    a finalizer that ran twice finds its own result already published under the same key and
    keeps it."""
    metrics.FENCED_WRITES_REFUSED.labels(statement="job_publish").inc()
    published = ConversionJob.objects.filter(id=lease.job_id, result_key=result.key).exists()
    if result.stored and not published:
        storage.delete(result.key)
    return _stopped(lease=lease)
