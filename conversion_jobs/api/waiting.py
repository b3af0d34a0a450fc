"""Waiting clients without threads (docs/API_CONTRACT.md §2.2, §2.8; ADR 0016).

One :class:`JobChangeListener` per web process holds one Postgres connection that ``LISTEN``s on
``quire_job_change``; migration 0005's trigger sends the job id there whenever a job's
``state_version`` or page counters change. A waiting request subscribes to its job id, reads
the job once, and sleeps on an :class:`asyncio.Event` on the event loop until a notification,
its deadline, or (only while the listener is down, or on SQLite) a short poll interval.

No job data travels in the notification: a woken waiter re-reads the job through the same
tenant-scoped selector as every other read, so tenancy rules stay in one place.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import psycopg
from asgiref.sync import sync_to_async
from django.conf import settings

from conversion_jobs import selectors
from conversion_jobs.representation import JobStatus
from conversion_jobs.store import notify

logger = logging.getLogger(__name__)

CHANNEL = "quire_job_change"
#: While the listener is connected, a waiter re-reads only when notified (or at its deadline).
#: Without notifications at all (SQLite, a request served outside the server's loop) waiters
#: poll every POLL_S; while a listener is reconnecting, a waiter that starts waiting polls every
#: OUTAGE_POLL_S (jittered): the database is probably restarting, and a thousand waiters
#: polling it fast would only queue on the web process's sync threads. The reconnect itself
#: wakes every waiter once.
POLL_S = 0.5
OUTAGE_POLL_S = 2.0
RECONNECT_MIN_S = 0.2
RECONNECT_MAX_S = 5.0


def _status_read(job_id: uuid.UUID, tenant: str) -> JobStatus | None:
    row = selectors.conversion_job_wait_status(job_id=job_id, tenant=tenant)
    return None if row is None else JobStatus(*row)


status_read = sync_to_async(_status_read, thread_sensitive=True)


class JobChangeListener:
    """The process's ``LISTEN quire_job_change`` connection and the waiters it wakes."""

    def __init__(self) -> None:
        self._waiters: dict[str, set[asyncio.Event]] = {}
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.listening = False
        #: Set by project.asgi: only a server's long-lived event loop keeps a listener. A
        #: request served through async_to_sync (WSGI, the test client) gets a loop that ends
        #: with it, so it polls instead.
        self.serving = False

    @property
    def enabled(self) -> bool:
        return self.serving and notify.notifies()

    def ensure_started(self) -> None:
        if not self.enabled:
            return
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done() or self._loop is not loop:
            self._loop = loop
            self.listening = False
            self._task = loop.create_task(self._run(), name="quire-job-change-listener")

    @contextlib.contextmanager
    def subscribe(self, job_id: uuid.UUID) -> Iterator[asyncio.Event]:
        self.ensure_started()
        event = asyncio.Event()
        key = str(job_id)
        self._waiters.setdefault(key, set()).add(event)
        try:
            yield event
        finally:
            waiters = self._waiters.get(key)
            if waiters is not None:
                waiters.discard(event)
                if not waiters:
                    del self._waiters[key]

    def poll_interval(self) -> float | None:
        """None while notifications are reliable; else how often waiters must re-read."""
        if not self.enabled:
            return POLL_S
        if self.listening:
            return None
        return OUTAGE_POLL_S * random.uniform(0.75, 1.25)  # noqa: S311 (not security)

    def _wake(self, key: str | None = None) -> None:
        groups = [self._waiters.get(key, set())] if key else list(self._waiters.values())
        for waiters in groups:
            for event in waiters:
                event.set()

    async def _run(self) -> None:
        delay = RECONNECT_MIN_S
        while True:
            try:
                conn = await psycopg.AsyncConnection.connect(_conninfo(), autocommit=True)
                async with conn:
                    await conn.execute(notify.listen_sql(CHANNEL))  # type: ignore[arg-type]
                    self.listening = True
                    delay = RECONNECT_MIN_S
                    logger.info("job change listener connected")
                    # Anything that changed while nobody listened: every waiter re-reads.
                    self._wake()
                    async for message in conn.notifies():
                        self._wake(message.payload)
            except asyncio.CancelledError:
                self.listening = False
                raise
            except Exception as exc:
                logger.warning(
                    "job change listener lost its connection; waiters poll until it is back",
                    extra={"error": type(exc).__name__},
                )
            self.listening = False
            await asyncio.sleep(delay)
            delay = min(delay * 2, RECONNECT_MAX_S)


def _conninfo() -> str:
    return notify.conninfo(
        connect_timeout=settings.DATABASES["default"].get("OPTIONS", {}).get("connect_timeout", 5),
        application_name="quire-web-listener",
        # A dead peer (host gone without a FIN) is noticed by TCP keep-alives.
        keepalives=1,
        keepalives_idle=10,
        keepalives_interval=5,
        keepalives_count=3,
    )


listener = JobChangeListener()


async def wait_for_change(
    *, job_id: uuid.UUID, tenant: str, known: frozenset[str], deadline: float
) -> JobStatus | None:
    """Sleep until the job's representation is none of ``known`` (ETags: a state change and
    page progress alike, docs/API_CONTRACT.md §2.2), the job is terminal, or ``deadline``
    (monotonic) passes. Returns the last status read (None: the job is gone)."""
    with listener.subscribe(job_id) as event:
        while True:
            status = await status_read(job_id, tenant)
            if status is None or status.etag not in known or status.terminal:
                return status
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return status
            await _sleep_on(event, remaining)


async def _sleep_on(event: asyncio.Event, remaining: float) -> None:
    interval = listener.poll_interval()
    timeout = remaining if interval is None else min(remaining, interval)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(event.wait(), timeout=timeout)
    event.clear()


def _sse(event: str, event_id: str, data: dict[str, Any]) -> bytes:
    body = json.dumps(data, separators=(",", ":"))
    return f"id: {event_id}\nevent: {event}\ndata: {body}\n\n".encode()


def _sse_data(job_id: uuid.UUID, status: JobStatus) -> dict[str, Any]:
    return {
        "id": str(job_id),
        "state": status.state,
        "state_version": status.state_version,
        "pages": {
            "total": status.pages_total,
            "done": status.pages_done,
            "failed": status.pages_failed,
        },
    }


async def event_stream(
    *, job_id: uuid.UUID, tenant: str, last_event_id: str | None
) -> AsyncIterator[bytes]:
    """Server-Sent Events for one job: ``state`` when ``state_version`` changes, ``progress``
    when only the page counters do; ``: heartbeat`` comments in between; the stream ends after
    a terminal state or after ``SSE_MAX_S`` (the client reconnects with ``Last-Event-ID``).

    Ids are snapshots (``state_version.total.done.failed``), not a log: resuming with the id
    of what the client last saw sends the current snapshot only if it differs."""
    quire = settings.QUIRE
    heartbeat_s = float(quire["SSE_HEARTBEAT_S"])
    ends_at = time.monotonic() + float(quire["SSE_MAX_S"])
    seen_version: int | None = None
    seen_id = last_event_id
    if last_event_id:
        head = last_event_id.split(".", 1)[0]
        seen_version = int(head) if head.isdigit() else None
    yield f"retry: {int(quire['SSE_RETRY_MS'])}\n\n".encode()
    next_beat = time.monotonic() + heartbeat_s
    with listener.subscribe(job_id) as event:
        while True:
            status = await status_read(job_id, tenant)
            if status is None:  # deleted by retention while streaming
                return
            if status.event_id != seen_id:
                kind = "state" if status.state_version != seen_version else "progress"
                yield _sse(kind, status.event_id, _sse_data(job_id, status))
                seen_id, seen_version = status.event_id, status.state_version
                next_beat = time.monotonic() + heartbeat_s
            if status.terminal:
                return
            now = time.monotonic()
            if now >= ends_at:
                return
            if now >= next_beat:
                yield b": heartbeat\n\n"
                next_beat = now + heartbeat_s
            await _sleep_on(event, min(next_beat, ends_at) - now)
