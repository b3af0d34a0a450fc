"""Database calls of a running attempt that survive a Postgres restart: retried with backoff
until the lease would be gone anyway."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from django.conf import settings
from django.db import InterfaceError, OperationalError, connection

T = TypeVar("T")
P = ParamSpec("P")

DB_ERRORS = (OperationalError, InterfaceError)


def db_retry(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """``fn(*args, **kwargs)``; on a lost database connection reconnect and call it again until
    the lease TTL has passed: a Postgres restart is a pause, not a failure. Reads as the call it
    wraps: ``db_retry(execution.conversion_job_fail, lease=lease, code=code)``."""
    return db_retry_until(lease_ttl_s(), fn, *args, **kwargs)


def db_retry_until(deadline_s: float, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """``db_retry`` with its own deadline (the claim, which holds no lease yet)."""
    deadline = time.monotonic() + deadline_s
    delay = 0.2
    while True:
        try:
            return fn(*args, **kwargs)
        except DB_ERRORS:
            connection.close()
            if time.monotonic() + delay > deadline:
                raise
            time.sleep(delay)
            delay = min(delay * 2, 2.0)


def lease_ttl_s() -> float:
    return float(settings.QUIRE["LEASE_S"])
