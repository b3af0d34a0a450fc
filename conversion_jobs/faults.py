"""Named fault-injection points for tests of crash windows.

Production code calls :func:`hit` at the few places where a crash matters (between an insert
and its commit, between a commit and the response, between a fair pick and its publish).
Nothing is armed unless a test arms it: in the same process with :func:`armed`, or in a process
the test starts with ``QUIRE_TEST_FAULT_KILL=<point>[,<point>...]`` beside
``QUIRE_ENABLE_TEST_FAULTS=1`` (the converters' test-fault switch), which makes :func:`hit`
kill its own process with SIGKILL at that point: a real process dying in that window.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager

_armed: dict[str, type[BaseException]] = {}

#: The environment variables a test sets on a process it starts (both are needed).
KILL_ENV = "QUIRE_TEST_FAULT_KILL"
ENABLE_ENV = "QUIRE_ENABLE_TEST_FAULTS"


class InjectedFault(Exception):
    """A fault injected by a test."""


def _kill_points() -> frozenset[str]:
    if os.environ.get(ENABLE_ENV) != "1":
        return frozenset()
    return frozenset(p.strip() for p in os.environ.get(KILL_ENV, "").split(",") if p.strip())


_KILL_AT = _kill_points()


def hit(point: str) -> None:
    if _KILL_AT and point in _KILL_AT:
        os.kill(os.getpid(), signal.SIGKILL)
    exc = _armed.get(point)
    if exc is not None:
        raise exc(f"injected fault at {point}")


@contextmanager
def armed(point: str, exc: type[BaseException] = InjectedFault) -> Iterator[None]:
    _armed[point] = exc
    try:
        yield
    finally:
        _armed.pop(point, None)
