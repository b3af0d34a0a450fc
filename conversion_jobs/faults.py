"""Named fault-injection points for tests of crash windows.

Production code calls :func:`hit` at the few places where a crash matters (between an insert
and its commit, between a commit and the response). Nothing is armed unless a test arms it, in
the same process, with :func:`armed`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

_armed: dict[str, type[BaseException]] = {}


class InjectedFault(Exception):
    """A fault injected by a test."""


def hit(point: str) -> None:
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
