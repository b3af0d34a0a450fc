"""Database calls of a running attempt that survive a Postgres restart: retried with backoff
until the lease would be gone anyway."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from django.conf import settings
from django.db import InterfaceError, OperationalError, connection

T = TypeVar("T")

DB_ERRORS = (OperationalError, InterfaceError)


def db_retry(fn: Callable[[], T], *, deadline_s: float) -> T:
    """Run ``fn``; on a lost database connection reconnect and try again until the deadline
    (the lease TTL): a Postgres restart is a pause, not a failure."""
    deadline = time.monotonic() + deadline_s
    delay = 0.2
    while True:
        try:
            return fn()
        except DB_ERRORS:
            connection.close()
            if time.monotonic() + delay > deadline:
                raise
            time.sleep(delay)
            delay = min(delay * 2, 2.0)


def lease_ttl_s() -> float:
    return float(settings.QUIRE["LEASE_S"])
