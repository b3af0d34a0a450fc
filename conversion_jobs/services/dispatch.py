"""Dispatch (docs/ARCHITECTURE.md §2): outbox rows -> RabbitMQ, with a fast path and a sweeper.

A message carries identifiers only: ``(job_id, generation)`` and the ``traceparent`` header.
A duplicate message is harmless (the claim is a compare-and-set), a lost one is recovered by
the sweeper, so every path here prefers "publish again" over "maybe never".
"""

from __future__ import annotations

import json
import logging
import os
import socket
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Exists, F, OuterRef, Q
from django.db.models.functions import Now
from django.utils import timezone

from conversion_jobs.models import ConversionJob, ConversionOutbox
from conversion_jobs.observability import metrics, tracing
from conversion_jobs.services import fair
from conversion_jobs.states import State

log = logging.getLogger(__name__)

TASK_NAME = "tasks.conversion.run_conversion"
#: The sweeper leaves fresh rows to the fast path for this long, so both rarely publish one row.
FAST_PATH_GRACE = timedelta(seconds=2)


def publish_conversion(*, job_id: uuid.UUID, generation: int, traceparent: str) -> None:
    """One persistent message on ``conversion.v1``, confirmed by the broker or an exception."""
    from project.celery import app

    headers = {"traceparent": traceparent} if traceparent else {}
    with tracing.span_from_traceparent(
        "outbox.publish", traceparent, **{"quire.generation": generation}
    ):
        _send(app, job_id=job_id, generation=generation, headers=headers)


_ORIGIN = f"gen{os.getpid()}@{socket.gethostname()}"


def conversion_message(*, job_id: uuid.UUID, generation: int, traceparent: str) -> Any:
    """The message :func:`publish_conversion` sends, built directly (Celery task protocol 2,
    what ``app.send_task`` produces for ``run_conversion``: the same headers, properties and
    body; ``tests/unit/test_dispatch_message.py`` holds the two together). For the background
    publisher, which publishes batches on its own confirm-mode channel: ``send_task``'s routing,
    signals and serializer lookups were two thirds of its CPU."""
    import amqp

    task_id = str(uuid.uuid4())
    args = [str(job_id), generation]
    headers: dict[str, Any] = {
        "lang": "py",
        "task": TASK_NAME,
        "id": task_id,
        "shadow": None,
        "eta": None,
        "expires": None,
        "group": None,
        "group_index": None,
        "retries": 0,
        "timelimit": [None, None],
        "root_id": task_id,
        "parent_id": None,
        "argsrepr": repr(args),
        "kwargsrepr": "{}",
        "origin": _ORIGIN,
        "ignore_result": True,
        "replaced_task_nesting": 0,
        "stamped_headers": None,
        "stamps": {},
    }
    if traceparent:
        headers["traceparent"] = traceparent
    body = json.dumps(
        [args, {}, {"callbacks": None, "errbacks": None, "chain": None, "chord": None}]
    )
    return amqp.Message(
        body.encode(),
        content_type="application/json",
        content_encoding="utf-8",
        application_headers=headers,
        delivery_mode=2,
        correlation_id=task_id,
        reply_to="",
        priority=0,
    )


def _send(app: Any, *, job_id: uuid.UUID, generation: int, headers: dict[str, str]) -> None:
    app.send_task(
        TASK_NAME,
        args=[str(job_id), generation],
        queue=settings.CONVERSION_QUEUE,
        # Explicit: for a direct exchange Celery otherwise falls back to the default exchange,
        # where the least-privilege publisher may not write.
        exchange=settings.CONVERSION_EXCHANGE,
        routing_key=settings.CONVERSION_QUEUE,
        headers=headers,
        # retry / retry_policy: the app's (CELERY_TASK_PUBLISH_RETRY_POLICY), one immediate
        # retry on a fresh connection: a pooled connection that died with a broker restart must
        # not push every first publish afterwards onto the sweeper. Anything more is the
        # sweeper's job, so a request is never held up for long.
        confirm_timeout=settings.QUIRE["PUBLISH_CONFIRM_TIMEOUT_S"],
        ignore_result=True,
    )


def _error_code(exc: BaseException) -> str:
    from kombu.exceptions import OperationalError as BrokerOperationalError

    name = type(exc).__name__
    if "Timeout" in name or isinstance(exc, TimeoutError):
        return "broker_timeout"
    # kombu wraps a refused or reset connection in its OperationalError.
    if isinstance(exc, OSError | BrokerOperationalError) or "Connection" in name:
        return "broker_unreachable"
    return "publish_failed"


def outbox_publish_after_commit(
    *, outbox_id: int, job_id: uuid.UUID, generation: int, traceparent: str
) -> None:
    """Register the fast path: publish right after the surrounding transaction commits. In a
    web process the row is handed to the background publisher (``services/publisher.py``),
    elsewhere it is published inline."""
    from conversion_jobs.services import publisher

    background = publisher.current()
    if background is not None:
        item = publisher.Pending(outbox_id, job_id, generation, traceparent)
        transaction.on_commit(lambda: background.submit(item))
        return
    transaction.on_commit(
        lambda: outbox_publish_fast(
            outbox_id=outbox_id, job_id=job_id, generation=generation, traceparent=traceparent
        )
    )


def outbox_publish_committed_in_background(
    *, outbox_id: int, job_id: uuid.UUID, generation: int, traceparent: str
) -> None:
    """The fast path for a row already committed outside Django's transactions (the
    acceptance on the event loop): handed to the web's background publisher, as
    :func:`outbox_publish_after_commit` hands it after a commit. Never blocks; a full queue or
    no publisher leaves the row to the outbox sweep (the caller checks ``publisher.current()``
    before it writes, so the latter does not happen in a serving web)."""
    from conversion_jobs.services import publisher

    background = publisher.current()
    if background is not None:
        background.submit(publisher.Pending(outbox_id, job_id, generation, traceparent))


_MARK_PUBLISHED_SQL = (
    "UPDATE conversion_outbox SET published_at = CURRENT_TIMESTAMP,"
    " publish_attempts = publish_attempts + 1 WHERE id = %s AND published_at IS NULL"
)


def outbox_publish_fast(
    *, outbox_id: int, job_id: uuid.UUID, generation: int, traceparent: str
) -> bool:
    """Publish one freshly committed row. Never raises: a failure leaves the row unpublished
    for the sweeper, so the request that committed it is never failed or delayed past the
    confirm timeout. With fair dispatch the commit runs a fair pick instead, which on an idle
    system sends this very row (``fair.py``)."""
    if fair.enabled():
        return fair.relay_quietly(path="fast") > 0
    try:
        publish_conversion(job_id=job_id, generation=generation, traceparent=traceparent)
    except Exception as exc:
        code = _error_code(exc)
        log.warning(
            "outbox fast path publish failed; the sweeper will retry",
            extra={"code": code, "error": type(exc).__name__},
        )
        metrics.OUTBOX_PUBLISH_FAILURES.labels(path="fast", code=code).inc()
        try:
            ConversionOutbox.objects.filter(id=outbox_id, published_at__isnull=True).update(
                publish_attempts=F("publish_attempts") + 1, last_error_code=code
            )
        except Exception:  # the database is down too: the row is still there for the sweeper
            log.warning("could not record the publish failure", exc_info=False)
        return False
    try:
        # On the web's hot path: one statement, no ORM compile.
        with connection.cursor() as cursor:
            cursor.execute(_MARK_PUBLISHED_SQL, [outbox_id])
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
        # The backstop of the fair relay: one pick, bounded by the free credits.
        fair.outbox_rows_retire_superseded(batch=batch)
        fair.slots_remove_stale()
        sent = fair.relay(limit=batch, path="sweep")
        return SweepResult(published=sent)
    published = failed = 0
    with transaction.atomic():
        rows = list(
            ConversionOutbox.objects.select_for_update(skip_locked=True)
            .filter(published_at__isnull=True, created_at__lt=timezone.now() - FAST_PATH_GRACE)
            .order_by("id")
            .values_list("id", "job_id", "generation", "traceparent")[:batch]
        )
        done: list[int] = []
        for outbox_id, job_id, generation, traceparent in rows:
            try:
                publish_conversion(job_id=job_id, generation=generation, traceparent=traceparent)
            except Exception as exc:
                code = _error_code(exc)
                ConversionOutbox.objects.filter(id=outbox_id).update(
                    publish_attempts=F("publish_attempts") + 1, last_error_code=code
                )
                metrics.OUTBOX_PUBLISH_FAILURES.labels(path="sweep", code=code).inc()
                failed += 1
                break
            done.append(outbox_id)
        if done:
            ConversionOutbox.objects.filter(id__in=done).update(
                published_at=Now(), publish_attempts=F("publish_attempts") + 1
            )
            published = len(done)
            metrics.OUTBOX_PUBLISHED.labels(path="sweep").inc(published)
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
