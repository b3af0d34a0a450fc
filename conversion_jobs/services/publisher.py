"""The web's fast-path publisher, off the request thread (docs/ARCHITECTURE.md §2, ADR 0017
"2026-11-30 addendum: the fast path in the background").

A web process (``project.asgi`` / ``project.wsgi``) runs one :class:`BackgroundPublisher`: the
after-commit hook of an acceptance (or an operator retry) hands it the committed outbox row and
returns at once; its thread takes whatever is queued (up to ``QUIRE_PUBLISH_BATCH`` rows),
publishes the messages on one channel in confirm mode, waits for the broker's confirms of the
whole batch (bounded by ``QUIRE_PUBLISH_CONFIRM_TIMEOUT_S``), and marks the confirmed rows with
one statement. So a request never waits for a confirm, and the broker's fsync and the marking
UPDATE are shared by every job of the batch.

What does not change: a row is published at once after its commit (there is no timer: the
thread wakes on the hand-over); a failure, a timeout or a full queue (``QUIRE_PUBLISH_QUEUE_MAX``)
leaves rows unpublished, with the failure recorded, for the outbox sweep; a crash of the process
with rows in the queue leaves them for the sweep exactly as a crash between commit and confirm
always did. A duplicate (published, not yet marked, swept) is harmless: the claim is a CAS.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import time
import uuid
from typing import Any, NamedTuple

from amqp import spec
from django.conf import settings
from django.db import connection

from conversion_jobs import faults
from conversion_jobs.observability import metrics, tracing
from conversion_jobs.services import broker, fair
from conversion_jobs.store import outbox

log = logging.getLogger(__name__)


#: A connection unused for this long is replaced before the next batch (heartbeats are not
#: serviced between batches, so the broker may have dropped it).
IDLE_RECONNECT_S = 5.0


class Pending(NamedTuple):
    outbox_id: int
    job_id: uuid.UUID
    generation: int
    traceparent: str
    #: a page range's message (a fair pick may choose one, ADR 0023)
    page_range: broker.RangeRef | None = None
    #: the acceptance's statement marked the unit sent (``store.fair.ADMIT``): no pick for it
    sent: bool = False
    #: the acceptance's statement found no free credit: a pick for it would send nothing
    no_credit: bool = False


class ConfirmTimeout(TimeoutError):
    pass


class Nacked(Exception):
    pass


class BackgroundPublisher:
    """A bounded queue and one thread per process (started on first use, again after a fork)."""

    def __init__(self, *, max_queue: int, max_batch: int, confirm_timeout: float) -> None:
        self.max_queue, self.max_batch = max_queue, max_batch
        self.confirm_timeout = confirm_timeout
        self._queue: queue.Queue[Pending | None] = queue.Queue(maxsize=max_queue)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._pid = 0
        self._outstanding = 0  # rows handed over and not yet settled
        self._idle = threading.Condition(self._lock)
        # The thread's own broker connection and confirm-mode channel (AMQP only).
        self._conn: Any = None
        self._channel: Any = None
        self._unconfirmed: dict[int, int] = {}  # delivery tag -> index in the batch
        self._nacked: set[int] = set()
        self._next_tag = 1
        self._last_used = 0.0

    # --- the request side ------------------------------------------------------------------

    def submit(self, item: Pending) -> bool:
        """Hand a committed row over. Never blocks, never raises: a full queue leaves the row to
        the sweep."""
        try:
            self._ensure_thread()  # first: after a fork it resets the counts
        except Exception as exc:  # pragma: no cover - a thread that cannot start
            log.warning("outbox fast path unavailable", extra={"error": type(exc).__name__})
            return False
        with self._lock:
            self._outstanding += 1
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            with self._lock:
                self._outstanding -= 1
            metrics.OUTBOX_PUBLISH_FAILURES.labels(path="fast", code="queue_full").inc()
            log.warning(
                "outbox fast path queue full; the sweeper will publish",
                extra={"code": "queue_full"},
            )
            return False
        return True

    def depth(self) -> int:
        return self._outstanding

    def flush(self, timeout: float) -> bool:
        """Wait (at most ``timeout`` s) until everything handed over is settled: for a graceful
        stop and for tests. True when nothing is left."""
        deadline = time.monotonic() + timeout
        with self._idle:
            while self._outstanding > 0:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(min(left, 0.05))
        return True

    def _ensure_thread(self) -> None:
        if self._pid == os.getpid() and self._thread is not None and self._thread.is_alive():
            return
        with self._lock:
            if self._pid == os.getpid() and self._thread is not None and self._thread.is_alive():
                return
            if self._pid != os.getpid():  # forked: the parent's queue and connection are not ours
                self._queue = queue.Queue(maxsize=self.max_queue)
                self._conn = self._channel = None
                self._outstanding = 0
            self._pid = os.getpid()
            self._thread = threading.Thread(
                target=self._run, name="quire-outbox-publisher", daemon=True
            )
            self._thread.start()

    # --- the publisher thread --------------------------------------------------------------

    def stop(self, timeout: float) -> None:
        """Publish what is queued, then end the thread and close its connections (tests; a
        process that exits needs nothing: the thread is a daemon)."""
        thread = self._thread
        if thread is None or not thread.is_alive() or self._pid != os.getpid():
            return
        self._queue.put(None)
        thread.join(timeout)

    def _run(self) -> None:
        stopping = False
        while not stopping:
            first = self._queue.get()
            if first is None:
                break
            batch = [first]
            while len(batch) < self.max_batch:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    stopping = True
                    break
                batch.append(item)
            try:
                if fair.enabled():
                    self.publish_fair(batch)
                else:
                    self.publish_batch(batch)
            except Exception as exc:  # never let the thread die; the rows stay for the sweep
                log.warning("outbox fast path batch failed", extra={"error": type(exc).__name__})
            finally:
                with self._idle:
                    self._outstanding -= len(batch)
                    self._idle.notify_all()
        self._drop_connection()
        _reset_db()

    def publish_fair(self, handed: list[Pending]) -> None:
        """Fair dispatch (``fair.py``): the rows handed over only say "something was committed";
        what is sent is what a fair pick chooses now (on an idle system, those very rows). The
        broker channel comes first: a pick marks its units sent, so it is taken only when they
        can be published at once; a broker that refuses or hangs leaves the units waiting for
        the sweep's pick, and the failure is recorded on the rows handed over. The units the
        broker confirms are marked so (``fair.confirm``); a unit this process picked and never
        confirmed (killed before its publish) waits again after twice the confirm timeout.
        Rows their acceptance sent itself (``Pending.sent``: an idle system) are published as
        picked units, first; a pick follows only for the others, unless none of them found a
        free credit (``Pending.no_credit``: the relay's wake-up picks when a slot frees)."""
        sent = [
            fair.Unit.sent_at_acceptance(p.outbox_id, p.job_id, p.generation, p.traceparent)
            for p in handed
            if p.sent
        ]
        pick = any(not p.sent and not p.no_credit for p in handed)
        if not sent and not pick:
            return
        if settings.AMQP_BROKER:
            try:
                self._confirm_channel()
            except Exception as exc:
                self._drop_connection()
                code = broker.error_code(exc)
                log.warning(
                    "outbox fast path publish failed; the sweeper will retry",
                    extra={"code": code, "error": type(exc).__name__},
                )
                self._record_failure([p.outbox_id for p in handed if not p.sent], code)
                self._unsend(sent, code)
                metrics.OUTBOX_PUBLISH_FAILURES.labels(path="fast", code=code).inc(len(handed))
                return
        if sent:
            faults.hit("fair.after_pick")
            self.publish_batch([p for p in handed if p.sent], picked=sent)
        if not pick:
            return
        try:
            units = fair.pick(limit=self.max_batch)
        except Exception:
            _reset_db()
            raise
        if units:
            faults.hit("fair.after_pick")
            batch = [
                Pending(u.outbox_id, u.job_id, u.generation, u.traceparent, u.page_range)
                for u in units
            ]
            self.publish_batch(batch, picked=units)

    def publish_batch(self, batch: list[Pending], picked: list[fair.Unit] | None = None) -> None:
        """Publish ``batch`` and mark the confirmed rows; ``picked``: the rows were marked sent by
        a fair pick already, and the ones not confirmed go back to waiting."""
        confirmed: list[int] = []
        error: BaseException | None = None
        for _attempt in (0, 1):  # one immediate retry on a fresh connection (ADR 0015)
            try:
                confirmed = self._publish(batch)
                error = None
                break
            except Exception as exc:
                error = exc
                self._drop_connection()
                if not _retryable(exc):
                    break
        done = set(confirmed)
        failed = [p.outbox_id for p in batch if p.outbox_id not in done]
        if confirmed:
            if picked is None:
                self._mark_published(confirmed)
            else:  # the pick marked them sent; this says the broker has them (ADR 0021)
                fair.confirm(confirmed)
            metrics.OUTBOX_PUBLISHED.labels(path="fast").inc(len(confirmed))
        if failed:
            code = broker.error_code(error) if error is not None else "publish_failed"
            log.warning(
                "outbox fast path publish failed; the sweeper will retry",
                extra={"code": code, "error": type(error).__name__ if error else "Nacked"},
            )
            metrics.OUTBOX_PUBLISH_FAILURES.labels(path="fast", code=code).inc(len(failed))
            if picked is None:
                self._record_failure(failed, code)
            else:
                lost = set(failed)
                self._unsend([u for u in picked if u.outbox_id in lost], code)

    def _unsend(self, units: list[fair.Unit], code: str) -> None:
        """Units marked sent and not published: back to waiting (``fair.unsend``)."""
        try:
            fair.unsend(units, code=code)
        except Exception:  # the database is away: they count as unconfirmed, then are resent
            log.warning("could not return unpublished units", exc_info=False)
            _reset_db()

    def _publish(self, batch: list[Pending]) -> list[int]:
        """Publish ``batch``; the outbox ids the broker confirmed."""
        if not settings.AMQP_BROKER:  # the standalone profile's transport has no confirms
            for p in batch:
                broker.publish_conversion(
                    job_id=p.job_id,
                    generation=p.generation,
                    traceparent=p.traceparent,
                    page_range=p.page_range,
                )
            return [p.outbox_id for p in batch]
        channel = self._confirm_channel()
        exchange, routing_key = settings.CONVERSION_EXCHANGE, settings.CONVERSION_QUEUE
        self._unconfirmed.clear()
        self._nacked.clear()
        for index, p in enumerate(batch):
            with tracing.span_from_traceparent(
                "outbox.publish", p.traceparent, **{"quire.generation": p.generation}
            ):
                message = broker.conversion_message(
                    job_id=p.job_id,
                    generation=p.generation,
                    traceparent=p.traceparent,
                    page_range=p.page_range,
                )
                channel.basic_publish(message, exchange=exchange, routing_key=routing_key)
            self._unconfirmed[self._next_tag] = index
            self._next_tag += 1
        deadline = time.monotonic() + self.confirm_timeout
        while self._unconfirmed:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ConfirmTimeout("publisher confirms timed out")
            channel.wait([spec.Basic.Ack, spec.Basic.Nack], timeout=left)
        if self._nacked:
            lost = {batch[i].outbox_id for i in self._nacked}
            return [p.outbox_id for p in batch if p.outbox_id not in lost]
        return [p.outbox_id for p in batch]

    def _confirm_channel(self) -> Any:
        now = time.monotonic()
        if self._channel is not None and now - self._last_used > IDLE_RECONNECT_S:
            # Idle past the heartbeat: the broker may have closed it without our noticing.
            self._drop_connection()
        self._last_used = now
        if self._channel is not None:
            return self._channel
        conn = broker.celery_app().connection_for_write()
        conn.ensure_connection(max_retries=0)  # our caller retries once
        channel: Any = conn.default_channel
        # Confirm mode for the channel, but no per-message wait: the batch waits once.
        channel.basic_publish = channel._basic_publish
        channel.confirm_select()
        channel._confirm_selected = True
        channel.events["basic_ack"].add(self._on_ack)
        channel.events["basic_nack"].add(self._on_nack)
        self._next_tag = 1
        self._conn, self._channel = conn, channel
        return channel

    def _on_ack(self, tag: int, multiple: bool) -> None:
        self._settle(tag, multiple, nack=False)

    def _on_nack(self, tag: int, multiple: bool) -> None:
        self._settle(tag, multiple, nack=True)

    def _settle(self, tag: int, multiple: bool, *, nack: bool) -> None:
        tags = [t for t in self._unconfirmed if t <= tag] if multiple else [tag]
        for t in tags:
            index = self._unconfirmed.pop(t, None)
            if nack and index is not None:
                self._nacked.add(index)

    def _drop_connection(self) -> None:
        conn, self._conn, self._channel = self._conn, None, None
        if conn is not None:
            try:
                conn.release()
            except Exception:  # already gone
                log.debug("broker connection already gone")

    # --- the rows -------------------------------------------------------------------------

    def _mark_published(self, ids: list[int]) -> None:
        try:
            outbox.mark_published(ids)  # one statement, no ORM compile
        except Exception:  # published but not marked: the sweeper publishes harmless duplicates
            log.warning("published but could not mark the outbox rows", exc_info=False)
            _reset_db()

    def _record_failure(self, ids: list[int], code: str) -> None:
        try:
            outbox.failure_record(ids, code)
        except Exception:  # the database is down too: the rows are still there for the sweeper
            log.warning("could not record the publish failure", exc_info=False)
            _reset_db()


def _reset_db() -> None:
    try:
        connection.close()
    except Exception:
        log.debug("database connection already gone")


def _retryable(exc: BaseException) -> bool:
    """A dead pooled connection (broker restarted) is worth one immediate retry; a confirm
    timeout or a nack is not (the broker is there and slow: the sweep takes over)."""
    return not isinstance(exc, ConfirmTimeout | Nacked)


_publisher: BackgroundPublisher | None = None


def enable() -> BackgroundPublisher | None:
    """Called by the web entry points. ``QUIRE_FAST_PUBLISH=inline`` keeps the per-request
    publish (the behaviour before this addendum)."""
    global _publisher
    if settings.QUIRE["FAST_PUBLISH"] != "background":
        return None
    if _publisher is None:
        _publisher = BackgroundPublisher(
            max_queue=settings.QUIRE["PUBLISH_QUEUE_MAX"],
            max_batch=settings.QUIRE["PUBLISH_BATCH"],
            confirm_timeout=settings.QUIRE["PUBLISH_CONFIRM_TIMEOUT_S"],
        )
        # A graceful stop publishes what is queued (bounded); what is left is the sweep's.
        atexit.register(_publisher.flush, settings.QUIRE["PUBLISH_CONFIRM_TIMEOUT_S"] * 2)
    return _publisher


def disable() -> None:
    global _publisher
    _publisher = None


def current() -> BackgroundPublisher | None:
    return _publisher
