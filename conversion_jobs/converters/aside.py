"""The time limit of one LibreOffice conversion, and stepping aside (ADR 0022, "Stepping aside").

A conversion runs against ``Limits.prepare_timeout_s`` of wall clock. One that is still running
after ``after_s`` may *step aside*: the worker asks (``PrepareRequest.step_aside``, a fenced
statement under the fair relay's lock) to hand its slot back, so that the relay sends another
unit to the worker's spare pool process. If it may, the engine's whole process group moves to
``SCHED_IDLE`` (it then runs on what the other conversions leave of the cores) and the limit
becomes the group's CPU time: ``prepare_timeout_s`` CPU seconds since the conversion began, so
that a document starved by the load is not timed out (and quarantined) by the load, with a wall
clock cap of ``wall_factor`` x the limit. The engine is recycled after such a conversion (its
threads keep their scheduling class). A request without ``step_aside`` runs on the wall clock
alone, as before.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from .base import PrepareRequest, process_group_cpu_s, process_group_idle
from .errors import ConversionTimeout


@dataclass(frozen=True)
class AsideSettings:
    #: seconds of conversion after which a conversion asks to step aside; 0: never
    after_s: float = 0.0
    #: the wall clock cap of a conversion that stepped aside, in multiples of its limit
    wall_factor: float = 4.0
    #: how often a conversion whose request was refused (no spare, nothing waiting) asks again
    retry_s: float = 1.0


class ConversionClock:
    """``timeout_s`` and ``should_stop`` for the calls of one preparation in group ``pgid()``
    (the engine host's, or a fresh child's): the request's stop flag, each call's limit (wall
    clock, or CPU time once aside), and the step aside itself, asked for once the preparation
    (the engine's start included: the slot is held all along) has run ``after_s``."""

    def __init__(
        self,
        request: PrepareRequest,
        settings: AsideSettings,
        *,
        pgid: Callable[[], int | None],
    ) -> None:
        self.limit_s = request.limits.prepare_timeout_s
        self._stop = request.should_stop
        self._step_aside = request.step_aside if settings.after_s > 0 else None
        self._settings = settings
        self._pgid = pgid
        self._next_ask = time.monotonic() + settings.after_s
        self._call_started = time.monotonic()
        self._call_cpu_s = 0.0
        #: the preparation stepped aside: its group runs at the lowest priority
        self.aside = False

    def begin(self) -> float:
        """Start a call's limit now; returns the wall clock bound to hand to the call: the
        limit, or the cap of one that may step aside (``should_stop`` then keeps the limit)."""
        self._call_started = time.monotonic()
        self._call_cpu_s = self._group_cpu_s()
        if self._step_aside is None:
            return self.limit_s
        return self.limit_s * self._settings.wall_factor

    def should_stop(self) -> bool:
        """Polled while a call waits (every ``isolation.POLL_MAX_S``): the request's stop flag;
        raises ConversionTimeout past the call's limit (wall clock, or CPU time once aside)."""
        if self._stop():
            return True
        if self._step_aside is None:
            return False  # the call's own timeout is the limit
        if self.aside:
            if self._group_cpu_s() - self._call_cpu_s >= self.limit_s:
                raise ConversionTimeout(
                    f"the converter used {self.limit_s:g} s of CPU time without finishing"
                )
            return False
        now = time.monotonic()
        if now - self._call_started >= self.limit_s:
            raise ConversionTimeout(f"the converter did not finish within {self.limit_s:g} s")
        if now >= self._next_ask:
            self._next_ask = now + self._settings.retry_s
            self._try_aside()
        return False

    def _try_aside(self) -> None:
        group = self._pgid()
        if group is None or self._step_aside is None or not self._step_aside():
            return
        self.aside = True
        process_group_idle(group)

    def _group_cpu_s(self) -> float:
        group = self._pgid()
        return process_group_cpu_s(group) if group is not None else 0.0
