"""The time limit of one LibreOffice conversion, and stepping aside (ADR 0022, "Stepping aside").

A conversion runs against ``Limits.prepare_timeout_s`` of wall clock per call. One that is still
running ``after_s`` into its preparation (the engine's start included: the slot is held all
along) may *step aside*: the worker asks (``StepAside.ask``, a fenced statement under the fair
relay's lock) to hand its slot back, so that the relay sends another unit to the worker's spare
pool process. If it may:

* the engine's whole process group moves to ``SCHED_IDLE``, and its members but the leader
  (the host, whose watchdog must stay awake) are *paused* (``SIGSTOP``) whenever other work
  waits for a slot (``StepAside.others_wait``, asked every ``check_s``), resumed
  (``SIGCONT``) when none does. ``SCHED_IDLE`` alone was not enough: a converting
  LibreOffice on the cores' idle time still halved the throughput of the one-page jobs beside
  it on a 2-core host (bench/JOURNAL.md, session 18), paused it costs them nothing;
* its limit becomes CPU time (read every ``check_s``): ``prepare_timeout_s`` CPU seconds of the
  group per call, so that the load does not time it out (and quarantine it). At a wall clock
  cap of ``wall_factor`` x the limit it ends ``ConversionStarved`` (the attempt yields: not a
  crash, not an attempt), unless it ran unpaused for a whole limit meanwhile: short of its CPU
  even so, it hangs, and ends ``ConversionTimeout`` (a crash, as before);
* the engine is recycled after the conversion (its threads keep their scheduling class).

A request without ``step_aside`` runs on the wall clock alone, as before.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

from .base import (
    PrepareRequest,
    process_group_cpu_s,
    process_group_idle,
    process_group_members,
)
from .errors import ConversionStarved, ConversionTimeout


@dataclass(frozen=True)
class AsideSettings:
    """``after_s``: seconds of preparation after which a conversion asks to step aside (0:
    never); ``wall_factor``: the wall clock cap of a conversion aside, in multiples of its
    limit; ``retry_s``: how often a conversion refused (no spare, nothing waiting) asks again;
    ``check_s``: how often a conversion aside asks whether other work waits (pause, resume)."""

    after_s: float = 0.0
    wall_factor: float = 4.0
    retry_s: float = 1.0
    check_s: float = 0.5


class ConversionClock:
    """``timeout_s`` and ``should_stop`` for the calls of one preparation in group ``pgid()``
    (the engine host's, or a fresh child's): the request's stop flag, each call's limit (wall
    clock, or CPU time once aside), the step aside, and the pause while others wait."""

    def __init__(
        self,
        request: PrepareRequest,
        settings: AsideSettings,
        *,
        pgid: Callable[[], int | None],
    ) -> None:
        self.limit_s = request.limits.prepare_timeout_s
        self._stop = request.should_stop
        self._aside = request.step_aside if settings.after_s > 0 else None
        self._settings = settings
        self._pgid = pgid
        self._next_ask = time.monotonic() + settings.after_s
        self._call_started = self._last_poll = time.monotonic()
        self._call_cpu_s = 0.0
        #: wall seconds of the current call aside and not paused
        self._running_s = 0.0
        #: the preparation stepped aside: its group runs at the lowest priority
        self.aside = False
        #: the group is stopped (SIGSTOP) while others wait
        self.paused = False

    def begin(self) -> float:
        """Start a call's limit now; returns the wall clock bound to hand to the call: the
        limit, or the cap of one that may step aside (``should_stop`` then keeps the limit)."""
        self._call_started = self._last_poll = time.monotonic()
        self._running_s = 0.0
        if self._aside is None:
            return self.limit_s
        self._call_cpu_s = self._group_cpu_s()  # a scan of /proc: only where it may be needed
        # just past the cap: should_stop ends the call there as starved, not timed out
        return self.limit_s * self._settings.wall_factor + 2 * self._settings.check_s

    def should_stop(self) -> bool:
        """Polled while a call waits (every ``isolation.POLL_MAX_S``): the request's stop flag;
        raises ConversionTimeout past the call's limit (wall clock, or CPU time once aside) and
        ConversionStarved at the wall clock cap of a call aside."""
        if self._stop():
            return True
        if self._aside is None:
            return False  # the call's own timeout is the limit
        now = time.monotonic()
        if self.aside:
            if not self.paused:
                self._running_s += now - self._last_poll
            self._last_poll = now
            if now - self._call_started >= self.limit_s * self._settings.wall_factor:
                if self._running_s >= self.limit_s:
                    # not paused for a whole limit and still short of its CPU: it does not
                    # convert (a hang), the load did not starve it
                    raise ConversionTimeout(
                        f"the converter did not finish within {self.limit_s:g} s of run time"
                    )
                raise ConversionStarved(
                    "the conversion stepped aside and was starved past its wall clock cap"
                )
            if now >= self._next_ask:  # the /proc scans and the question, every check_s
                self._next_ask = now + self._settings.check_s
                if self._group_cpu_s() - self._call_cpu_s >= self.limit_s:
                    raise ConversionTimeout(
                        f"the converter used {self.limit_s:g} s of CPU time without finishing"
                    )
                self._pause(self._aside.others_wait())
            return False
        if now - self._call_started >= self.limit_s:
            raise ConversionTimeout(f"the converter did not finish within {self.limit_s:g} s")
        if now >= self._next_ask:
            self._next_ask = now + self._settings.retry_s
            self._try_aside()
        return False

    def end(self) -> None:
        """The preparation is over (however it ended): a paused group is resumed, so that
        whoever comes next (a recycle, a kill) finds it running."""
        self._pause(False)

    def _try_aside(self) -> None:
        group = self._pgid()
        if group is None or self._aside is None or not self._aside.ask():
            return
        self.aside = True
        self._next_ask = time.monotonic()  # pause at once if others wait
        process_group_idle(group)

    def _pause(self, pause: bool) -> None:
        """Stop (or continue) every member of the group but its leader: the host (or fresh
        child) stays awake, so its watchdog still kills the whole group, stopped members
        included, when the worker dies. Stopping is repeated at each check while others wait
        (a member started meanwhile is caught); continuing is sent once."""
        group = self._pgid()
        if group is None or (not pause and not self.paused):
            return
        sent = signal.SIGSTOP if pause else signal.SIGCONT
        for pid in process_group_members(group):
            if pid != group:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sent)
        self.paused = pause

    def _group_cpu_s(self) -> float:
        group = self._pgid()
        return process_group_cpu_s(group) if group is not None else 0.0
