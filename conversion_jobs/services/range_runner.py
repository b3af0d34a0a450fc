"""A page range's worker (ADR 0023): claims a range of a fanned-out job, converts its pages with
the runner's page loop, marks it done, and - the last range done - joins the job with the
runner's fenced finalize. Planning, claims and sweeps are in ``fanout``; this module sits above
both it and ``runner`` (docs/ARCHITECTURE.md, "Import layers")."""

from __future__ import annotations

import functools
import logging
import uuid
from pathlib import Path

from django.conf import settings

from conversion_jobs import converters, storage
from conversion_jobs.converters import registry
from conversion_jobs.converters.base import PDF
from conversion_jobs.converters.engines import configure
from conversion_jobs.models import ConversionJob
from conversion_jobs.passwords import sealed_passwords_wipe
from conversion_jobs.pseudonym import pseudonym
from conversion_jobs.services import execution, fair, runner
from conversion_jobs.services.checkpoints import (
    CheckpointBatch,
    page_checkpoints_by_page,
)
from conversion_jobs.services.db_retry import (
    DB_ERRORS,
    connections_refresh,
    db_retry,
    db_retry_until,
)
from conversion_jobs.services.fanout import (
    RangeClaim,
    range_claim,
    range_finish,
    range_heartbeat,
    range_stop,
    source_fetch,
)
from conversion_jobs.services.heartbeat import Heartbeat
from conversion_jobs.services.leases import (
    LeaseLost,
)
from conversion_jobs.services.tidying import tidy_later, tidy_wait

log = logging.getLogger(__name__)


class _ConvertedOffice(registry.PdfConverter):
    """The PDF an Office document was converted to once, by the planner: its pages as the
    Office converter takes them from LibreOffice's PDF (``pdf_page``), any output."""

    name = "libreoffice"
    outputs = frozenset({"text", "png", "pdf"})

    def _page_args_for(self, output: str, options: dict | None, inline_max_bytes: int) -> dict:
        return {}  # as OfficeConverter: no password (the PDF has none), pages as files


class _Beats:
    """The heartbeat of whatever the worker holds now: its range, then (the join) the job."""

    def __init__(self, heartbeat: Heartbeat) -> None:
        self.current = heartbeat

    def switch(self, heartbeat: Heartbeat) -> None:
        self.current.finish()
        self.current = heartbeat
        heartbeat.start()


def conversion_execute(*, job_id: uuid.UUID, generation: int) -> str:
    """A job's message: its attempt (``runner.conversion_job_execute``); when the attempt fans
    the job out, the first range goes on in this slot at once (claimed by the plan itself: no
    message, no wait for the relay, ADR 0023)."""
    return runner.conversion_job_execute(
        job_id=job_id, generation=generation, then=_planned_range_execute
    )


def _planned_range_execute(claim: RangeClaim) -> str:
    lease = claim.range_lease
    return conversion_range_execute(
        job_id=lease.job_id,
        generation=claim.lease.generation,
        range_first=lease.first_page,
        range_generation=lease.generation,
        claim=claim,
    )


def conversion_range_execute(
    *,
    job_id: uuid.UUID,
    generation: int,
    range_first: int,
    range_generation: int,
    claim: RangeClaim | None = None,
) -> str:
    """Claim and run one page range of a fanned-out job (``claim``: already claimed, by its
    planner). Returns ``duplicate``, ``range_done`` (its pages are checkpointed, other ranges
    remain), the job's end when this range was the join (``succeeded``, ``partial``,
    ``failed``), ``retry_wait``, ``cancelled`` or ``lost``."""
    connections_refresh()
    converters.sandbox.configure(work_dir=settings.QUIRE["WORK_DIR"])
    if claim is None:
        claim = db_retry_until(
            runner.CLAIM_DEADLINE_S,
            range_claim,
            job_id=job_id,
            generation=generation,
            first=range_first,
            range_generation=range_generation,
            worker=runner.worker_identity(),
        )
    if claim is None:
        return "duplicate"
    beats = _Beats(
        Heartbeat(
            claim.lease,
            extend=functools.partial(
                range_heartbeat, range_lease=claim.range_lease, lease=claim.lease
            ),
        )
    )
    beats.current.start()
    tidy_wait()
    # Named after the planner's attempt (open for the whole fan-out): the stale work dir sweep
    # removes a killed range worker's directory once the job's attempt has ended.
    workdir = runner._workdir_make(
        Path(settings.QUIRE["WORK_DIR"])
        / f"{job_id}.{claim.lease.attempt_id}-{claim.range_lease.token.hex}"
    )
    converters.configure_reuse(runner.reuse_settings_from_settings())
    converters.begin_attempt(tenant=pseudonym("tenant", claim.job.tenant))
    outcome = "lost"
    try:
        outcome = _run_range(claim=claim, beats=beats, workdir=workdir)
        return outcome
    finally:
        beats.current.finish()
        if claim.job.password_sealed is not None and outcome in runner._TERMINAL_OUTCOMES:
            db_retry(sealed_passwords_wipe, job_id=job_id)
        converters.release(spare=False)
        converters.begin_attempt(tenant=None)
        tidy_later(functools.partial(runner._tidy, workdir))
        fair.slot_freed()


def _run_range(*, claim: RangeClaim, beats: _Beats, workdir: Path) -> str:
    """A range's errors are its job's: a retryable one sends the job to ``retry_wait`` (every
    other range then loses its fence and stops; the next generation plans again and skips the
    done pages), a terminal one fails the job (ADR 0023)."""
    lease = claim.lease
    try:
        return _convert_range(claim=claim, beats=beats, workdir=workdir)
    except (LeaseLost, converters.ConversionStopped):
        return db_retry(range_stop, range_lease=claim.range_lease, lease=lease)
    except converters.ConversionError as exc:
        if exc.retryable:
            state = db_retry(execution.conversion_job_retry_later, lease=lease, code=exc.code)
            return str(state) if state else db_retry(range_stop, range_lease=None, lease=lease)
        detail = exc.detail if exc.public else exc.code
        won = db_retry(execution.conversion_job_fail, lease=lease, code=exc.code, detail=detail)
        return "failed" if won else db_retry(range_stop, range_lease=None, lease=lease)
    except DB_ERRORS:
        return "lost"  # the range lease sweep requeues the range
    except OSError:
        log.warning("storage error during a page range", exc_info=False)
        state = db_retry(execution.conversion_job_retry_later, lease=lease, code="storage_error")
        return str(state) if state else db_retry(range_stop, range_lease=None, lease=lease)


def _convert_range(*, claim: RangeClaim, beats: _Beats, workdir: Path) -> str:
    lease, range_lease, job = claim.lease, claim.range_lease, claim.job
    options = runner._attempt_options(job, lease, password=claim.document_key is None)
    configure(runner.engine_settings_from_settings())
    converter: converters.Converter
    if claim.document_key is not None:
        media_type, converter = PDF, _ConvertedOffice()
        if job.output not in converter.outputs:
            raise converters.UnsupportedConversion(f"{job.source_media_type} -> {job.output}")
    else:
        media_type = job.source_media_type
        converter = converters.converter_for(media_type, job.output)
    source = workdir / "source"
    source_fetch(job=job, key=claim.document_key, inline=claim.source, dest=source)
    pages = list(range(range_lease.first_page, range_lease.last_page + 1))
    checkpoints = db_retry(
        page_checkpoints_by_page,
        job_id=lease.job_id,
        first=range_lease.first_page,
        last=range_lease.last_page,
    )
    todo = runner._unfinished(pages, checkpoints)
    ahead = todo[: 2 * converters.READ_AHEAD_PAGES]
    # A range opens only its own pages: pdfium loads a page when it is asked for.
    request = runner._prepared(
        converter,
        job=job,
        source=source,
        media_type=media_type,
        options=options,
        workdir=workdir,
        stop=beats.current.stop.is_set,
        first=ahead,
    )
    if todo and not request.prepared.first_requested:
        converter.request_pages(request, pages=ahead)
    return runner._convert_pages(
        runner.PageRun(
            batch=CheckpointBatch(lease, checkpoints, range_lease=range_lease),
            job=job,
            converter=converter,
            request=request,
            pages=pages,
            todo=todo,
            finish=functools.partial(
                _range_done, claim=claim, beats=beats, workdir=workdir, source=source
            ),
        )
    )


def _range_done(*, claim: RangeClaim, beats: _Beats, workdir: Path, source: Path) -> str:
    if not db_retry(range_finish, range_lease=claim.range_lease, lease=claim.lease):
        return "range_done"
    # The join: from here this worker holds the job lease, heartbeated as an attempt's.
    beats.switch(Heartbeat(claim.lease))
    converters.release(spare=False)
    return _join(claim=claim, workdir=workdir, source=source)


def _join(*, claim: RangeClaim, workdir: Path, source: Path) -> str:
    """The one finalizer: every selected page is checkpointed; the result is assembled from
    them in page order (absolute page numbers) and published by the job's fenced publish."""
    lease = claim.lease
    job = db_retry(ConversionJob.objects.get, id=lease.job_id)
    pages = runner._selected_pages(job.options, job.source_page_count or 0)
    checkpoints = db_retry(page_checkpoints_by_page, job_id=lease.job_id)
    missing = runner._unfinished(pages, checkpoints)
    if missing:  # a defect: every range was done
        raise RuntimeError(f"{len(missing)} selected page(s) have no final checkpoint")
    document = source
    if job.output == "pdf" and claim.document_key is not None:
        document = workdir / "document.pdf"
        if not document.exists():
            storage.download(claim.document_key, document)
    with CheckpointBatch(lease, checkpoints) as batch:
        return runner._finalize(
            batch=batch,
            job=job,
            pages=pages,
            document=document,
            workdir=workdir,
            local={},
            unrecorded={},
        )
