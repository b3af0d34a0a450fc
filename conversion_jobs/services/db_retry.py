"""Database calls of a running attempt that survive a Postgres restart: retried with backoff
until the lease would be gone anyway."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from django.conf import settings
from django.db import InterfaceError, OperationalError, connection, connections

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


def connections_refresh() -> None:
    """``close_old_connections()`` without its health-check ping: a connection past its
    ``CONN_MAX_AGE``, in a failed state or with errors is closed as before, but a healthy-looking
    one is not probed with a ``SELECT 1`` before the claim or the sweep (one round trip each). A
    connection that died meanwhile fails the next statement, which marks it, and the next call
    of this closes it: a worker's claim is retried on a new connection (``db_retry_until``), and
    a sweeper's next sweep runs on one (Celery's Django fix-up, with ``CELERY_DB_REUSE_MAX``,
    checks connections only every 2 x N tasks)."""
    for conn in connections.all(initialized_only=True):
        if conn.in_atomic_block:  # a transaction is using it: never closed under its feet
            continue
        conn.close_if_unusable_or_obsolete()
        if conn.connection is not None and not conn.errors_occurred:
            conn.health_check_done = True  # type: ignore[attr-defined]
