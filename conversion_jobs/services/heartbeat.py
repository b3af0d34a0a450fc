"""Heartbeats of running attempts (docs/ARCHITECTURE.md §4): each attempt's lease is extended every
``HEARTBEAT_S``, and its stop flag is raised when the job is being cancelled or the lease is lost.

One heartbeat thread per worker process serves every attempt of the process (ADR 0017,
session 4): an attempt registers its ``Heartbeat`` with ``start()`` and withdraws it with
``finish()``; no thread is started or joined per attempt. An attempt's first beat is due
``HEARTBEAT_S`` after its ``start()``, so a one-page job that ends sooner never beats (as
before). ``finish()`` returns only once no beat of that attempt is in flight, and the thread
closes its database connection whenever it has no attempt left to serve, so nothing of an
attempt outlives it.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable

from django.conf import settings
from django.db import connection

from conversion_jobs.services.leases import HeartbeatResult, Lease, lease_heartbeat

log = logging.getLogger(__name__)


class StopReason:
    CANCELLED = "cancelled"
    LOST = "lost"


class Heartbeat:
    """One attempt's heartbeat; sets ``stop`` with a reason when the attempt must end."""

    def __init__(self, lease: Lease, extend: Callable[[], str] | None = None) -> None:
        """``extend``: what one beat does (default: extend ``lease``, ``lease_heartbeat``; a page
        range's worker extends its range's lease, ``fanout.range_heartbeat``)."""
        self.lease = lease
        self.extend = extend or functools.partial(lease_heartbeat, lease=lease)
        self.stop = threading.Event()
        self.reason: str | None = None
        self.interval = float(settings.QUIRE["HEARTBEAT_S"])
        self.lease_s = float(settings.QUIRE["LEASE_S"])
        self._last_ok = time.monotonic()
        self.due = self._last_ok + self.interval
        self._beater: _Beater | None = None

    def halt(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason
        self.stop.set()

    def start(self) -> None:
        self._last_ok = time.monotonic()
        self.due = self._last_ok + self.interval
        self._beater = _beater()
        self._beater.add(self)

    def finish(self) -> None:
        """Withdraw; returns once no beat of this attempt is in flight."""
        if self._beater is not None:
            self._beater.remove(self)

    def beat(self) -> bool:
        """Extend the lease once (on the heartbeat thread). True: stop beating (halted)."""
        try:
            result = self.extend()
        except Exception:
            # The database (or anything else) failed: we cannot prove the lease; past its TTL
            # it is gone. A new connection is opened for the next beat.
            connection.close()
            if time.monotonic() - self._last_ok > self.lease_s:
                self.halt(StopReason.LOST)
                return True
            return False
        self._last_ok = time.monotonic()
        if result == HeartbeatResult.CANCELLING:
            self.halt(StopReason.CANCELLED)
            return True
        if result == HeartbeatResult.LOST:
            self.halt(StopReason.LOST)
            return True
        return False


class _Beater(threading.Thread):
    """The process's heartbeat thread: beats the registered attempt whose beat is due next."""

    def __init__(self) -> None:
        super().__init__(name="quire-heartbeat", daemon=True)
        self.pid = os.getpid()
        self.cond = threading.Condition()
        self.beats: set[Heartbeat] = set()
        self.busy: Heartbeat | None = None
        #: whether this thread may hold a database connection (it beat since it last closed)
        self.connected = False
        #: when the thread wakes next at the latest (it is woken earlier only when needed)
        self.wake_at = 0.0

    def add(self, heartbeat: Heartbeat) -> None:
        with self.cond:
            self.beats.add(heartbeat)
            if heartbeat.due < self.wake_at:  # usually not: a short attempt wakes no thread
                self.cond.notify_all()

    def remove(self, heartbeat: Heartbeat) -> None:
        with self.cond:
            self.beats.discard(heartbeat)
            if not self.beats and self.connected:
                self.cond.notify_all()
            # No beat of it in flight, and the last one out waits for the connection to close.
            while self.busy is heartbeat or (not self.beats and self.connected):
                self.cond.wait()

    def _next_due(self) -> Heartbeat:
        """Wait (holding the condition) until a registered heartbeat is due; return it."""
        while True:
            if not self.beats and self.connected:
                connection.close()  # idle: hold no database connection
                self.connected = False
                self.cond.notify_all()
            now = time.monotonic()
            due = min(self.beats, key=lambda h: h.due, default=None)
            if due is not None and due.due <= now:
                return due
            self.wake_at = min(now + IDLE_WAKE_S, due.due if due is not None else now + 3600)
            self.cond.wait(self.wake_at - now)

    def run(self) -> None:
        while True:
            with self.cond:
                heartbeat = self.busy = self._next_due()
                self.connected = True
            done = True
            try:
                done = heartbeat.beat()
            except BaseException:  # never let the process's heartbeat thread die
                log.exception("heartbeat failed")
                done = False
            finally:
                with self.cond:
                    if done:
                        self.beats.discard(heartbeat)
                    else:
                        heartbeat.due = time.monotonic() + heartbeat.interval
                    self.busy = None
                    self.cond.notify_all()


#: the idle thread looks for due beats at least this often (an attempt registered meanwhile
#: with an earlier first beat wakes it at once)
IDLE_WAKE_S = 1.0

_lock = threading.Lock()
_current: _Beater | None = None


def _beater() -> _Beater:
    """This process's heartbeat thread, started on first use (and again after a fork)."""
    global _current
    with _lock:
        if _current is None or _current.pid != os.getpid() or not _current.is_alive():
            _current = _Beater()
            _current.start()
        return _current
