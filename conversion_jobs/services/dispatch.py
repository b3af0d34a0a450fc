"""Dispatch (docs/ARCHITECTURE.md §2): outbox rows -> RabbitMQ, with a fast path and a sweeper.

A message carries identifiers only: ``(job_id, generation)`` and the ``traceparent`` header.
A duplicate message is harmless (the claim is a compare-and-set), a lost one is recovered by
the sweeper, so every path here prefers "publish again" over "maybe never".
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Exists, F, OuterRef, Q
from django.db.models.functions import Now
from django.utils import timezone

from conversion_jobs.models import ConversionJob, ConversionOutbox
from conversion_jobs.observability import metrics
from conversion_jobs.services import broker, fair, publisher
from conversion_jobs.services.broker import RangeRef
from conversion_jobs.states import State
from conversion_jobs.store import outbox

log = logging.getLogger(__name__)

#: The sweeper leaves fresh rows to the fast path for this long, so both rarely publish one row.
FAST_PATH_GRACE = timedelta(seconds=2)


def outbox_publish_after_commit(
    *,
    outbox_id: int,
    job_id: uuid.UUID,
    generation: int,
    traceparent: str,
    page_range: RangeRef | None = None,
    sent: bool = False,
    no_credit: bool = False,
) -> None:
    """Register the fast path: publish right after the surrounding transaction commits. In a
    web process the row is handed to the background publisher (``services/publisher.py``),
    elsewhere it is published inline (a page range's row is always made by a worker or a
    sweep: inline). ``sent``: the acceptance's statement marked the unit sent itself (fair
    dispatch on an idle system, ``store.fair.ADMIT``): it is published without a pick.
    ``no_credit``: the statement found no free credit, so a pick could send nothing: none runs,
    and the unit goes with the pick that the next slot freed wakes (``relay_wake.py``)."""
    if sent:
        transaction.on_commit(lambda: metrics.FAIR_SENT_AT_ACCEPTANCE.inc())
    item = publisher.Pending(
        outbox_id, job_id, generation, traceparent, page_range, sent=sent, no_credit=no_credit
    )
    background = publisher.current() if page_range is None else None
    if background is not None:
        transaction.on_commit(lambda: background.submit(item))
        return
    transaction.on_commit(lambda: outbox_publish_fast(item))


def outbox_publish_fast(item: publisher.Pending) -> bool:
    """Publish one freshly committed row. Never raises: a failure leaves the row unpublished
    for the sweeper, so the request that committed it is never failed or delayed past the
    confirm timeout. With fair dispatch the commit runs a fair pick instead, which on an idle
    system sends this very row (``fair.py``), unless the acceptance sent it already (``sent``:
    published as the pick's units are) or found no free credit (``no_credit``: nothing)."""
    outbox_id, job_id, generation, traceparent, page_range, sent, no_credit = item
    if sent:
        unit = fair.Unit.sent_at_acceptance(outbox_id, job_id, generation, traceparent)
        return fair.publish_quietly([unit], path="fast") > 0
    if no_credit:
        return False
    if fair.enabled():
        return fair.relay_quietly(path="fast") > 0
    try:
        broker.publish_conversion(
            job_id=job_id, generation=generation, traceparent=traceparent, page_range=page_range
        )
    except Exception as exc:
        code = broker.error_code(exc)
        log.warning(
            "outbox fast path publish failed; the sweeper will retry",
            extra={"code": code, "error": type(exc).__name__},
        )
        metrics.OUTBOX_PUBLISH_FAILURES.labels(path="fast", code=code).inc()
        try:
            outbox.failure_record([outbox_id], code)
        except Exception:  # the database is down too: the row is still there for the sweeper
            log.warning("could not record the publish failure", exc_info=False)
        return False
    try:
        outbox.mark_published([outbox_id])  # on the web's hot path: one statement
    except Exception:  # published but not marked: the sweeper publishes a harmless duplicate
        log.warning("published but could not mark the outbox row", exc_info=False)
    metrics.OUTBOX_PUBLISHED.labels(path="fast").inc()
    return True


@dataclass(frozen=True)
class SweepResult:
    published: int = 0
    failed: int = 0


def outbox_rows_publish_unpublished(*, batch: int | None = None) -> SweepResult:
    """Backstop: claim unpublished rows older than the fast-path grace with
    ``FOR UPDATE SKIP LOCKED`` (two beats never take the same row), publish each with confirms,
    mark it. A failure stops the batch (the broker is likely down) and is recorded on the row."""
    batch = batch or settings.QUIRE["SWEEP_BATCH"]
    if fair.enabled():
        # The backstop of the fair relay: one pick, bounded by the free credits (page ranges
        # are units of the pick like jobs, ADR 0021 "Page ranges").
        fair.outbox_rows_retire_superseded(batch=batch)
        fair.slots_remove_stale()
        # Units picked and never confirmed (their picker died before its publish) wait again,
        # so this very pick can send them (ADR 0021, "A unit picked and lost").
        fair.units_return_unconfirmed(batch=batch)
        sent = fair.relay_if_waiting(limit=batch, path="sweep")
        return SweepResult(published=sent)
    return _rows_publish_in_order(batch=batch, ranges_only=False)


def outbox_rows_publish_woken(*, batch: int | None = None) -> int:
    """The relay woken (``NOTIFY quire_dispatch``, ``relay_wake.py``): ranges were planned or a
    slot was freed by a process that may not publish. With fair dispatch one pick; without it,
    the page ranges' rows at once, in id order (the others have their fast path). The count
    published."""
    batch = batch or settings.QUIRE["SWEEP_BATCH"]
    if fair.enabled():
        return fair.relay_if_waiting(limit=batch, path="wake")
    return _rows_publish_in_order(batch=batch, ranges_only=True).published


def _rows_publish_in_order(*, batch: int, ranges_only: bool) -> SweepResult:
    published = failed = 0
    unpublished = ConversionOutbox.objects.filter(published_at__isnull=True)
    if ranges_only:
        unpublished = unpublished.filter(range_first__isnull=False)
    with transaction.atomic():
        rows = list(
            unpublished.select_for_update(skip_locked=True)
            # A page range's row has no fast path when a worker wrote it (a worker may not
            # publish: deploy/rabbitmq/README.md), so the sweep takes it at once (ADR 0023).
            .filter(
                Q(created_at__lt=timezone.now() - FAST_PATH_GRACE) | Q(range_first__isnull=False)
            )
            .order_by("id")
            .values_list(
                "id", "job_id", "generation", "traceparent", "range_first", "range_generation"
            )[:batch]
        )
        done: list[int] = []
        for outbox_id, job_id, generation, traceparent, range_first, range_generation in rows:
            page_range = (
                RangeRef(range_first, range_generation)
                if range_first is not None and range_generation is not None
                else None
            )
            try:
                broker.publish_conversion(
                    job_id=job_id,
                    generation=generation,
                    traceparent=traceparent,
                    page_range=page_range,
                )
            except Exception as exc:
                code = broker.error_code(exc)
                outbox.failure_record([outbox_id], code)
                metrics.OUTBOX_PUBLISH_FAILURES.labels(
                    path="wake" if ranges_only else "sweep", code=code
                ).inc()
                failed += 1
                break
            done.append(outbox_id)
        if done:
            outbox.mark_published(done)
            published = len(done)
            metrics.OUTBOX_PUBLISHED.labels(path="wake" if ranges_only else "sweep").inc(published)
    return SweepResult(published=published, failed=failed)


def conversion_jobs_republish_if_dispatch_stale(*, batch: int | None = None) -> int:
    """QUEUED jobs unclaimed past the dispatch timeout get a new outbox row for the same
    generation (a duplicate message is harmless: the claim is a CAS). ``queued_at`` moves
    forward in the same guarded UPDATE, so the next sweep waits another full timeout."""
    batch = batch or settings.QUIRE["SWEEP_BATCH"]
    now = timezone.now()
    cutoff = now - timedelta(seconds=settings.QUIRE["DISPATCH_TIMEOUT_S"])
    stale_jobs = ConversionJob.objects.filter(state=State.QUEUED, queued_at__lt=cutoff)
    if fair.enabled():
        # A job waiting its turn in the fair order is not stale: only a unit sent and not
        # claimed within QUIRE_FAIR_LOST_S (its message lost), or a job with no unit waiting
        # past the dispatch timeout (sent before fair dispatch was on), is sent again.
        lost = now - timedelta(seconds=settings.QUIRE["FAIR_LOST_S"])
        waiting = ConversionOutbox.objects.filter(
            job_id=OuterRef("id"), generation=OuterRef("generation"), published_at__isnull=True
        )
        stale_jobs = ConversionJob.objects.filter(state=State.QUEUED).filter(
            Q(dispatched_generation=F("generation"), dispatched_at__lt=lost)
            | (
                Q(queued_at__lt=cutoff)
                & ~Q(dispatched_generation=F("generation"))
                & ~Exists(waiting)
            )
        )
    count = 0
    with transaction.atomic():
        stale = list(
            stale_jobs.select_for_update(skip_locked=True).values_list(
                "id", "generation", "traceparent"
            )[:batch]
        )
        for job_id, generation, traceparent in stale:
            moved = ConversionJob.objects.filter(
                id=job_id, state=State.QUEUED, generation=generation
            ).update(queued_at=Now(), dispatched_at=None)
            if moved:
                ConversionOutbox.objects.create(
                    job_id=job_id, generation=generation, traceparent=traceparent
                )
                count += 1
    if count:
        metrics.REDISPATCHES.labels(reason="dispatch_timeout").inc(count)
    return count
