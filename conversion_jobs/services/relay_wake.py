"""The relay's wake-up (ADR 0021 §5, ADR 0023 "Dispatch"): in the process whose broker user may
publish (the sweeper), a thread ``LISTEN``s on ``quire_dispatch`` and, woken, runs the relay at
once (``dispatch.outbox_rows_publish_woken``): a fair pick, or the page ranges' rows with fair
dispatch off.

Who wakes it (``fair.wake``): a planner's transaction (its ranges' rows, which a worker may not
publish: deploy/rabbitmq/README.md), the range sweep's requeue, and every worker slot freed in
production (an attempt or a range ended: the fair order fills the slot now). Without it those
waited for the outbox sweep's tick (``QUIRE_SWEEP_INTERVAL_S``), which stays the backstop: a
notification lost with the listening connection costs at most one tick. Notifications that
arrive while a relay runs are folded into the next one (one pick answers them all).
"""

from __future__ import annotations

import contextlib
import logging
import select
import threading
from typing import Any

from django.db import close_old_connections

from conversion_jobs.services import dispatch, fair
from conversion_jobs.store import notify

log = logging.getLogger(__name__)

#: The longest the loop sleeps without a notification before it checks ``stop`` again.
IDLE_S = 5.0

_started: threading.Thread | None = None
_lock = threading.Lock()


def start() -> threading.Thread | None:
    """Start the listening thread once per process (Postgres only: SQLite has no NOTIFY, and a
    standalone worker relays itself). Returns the thread, or None."""
    global _started
    if not notify.notifies():
        return None
    with _lock:
        if _started is None or not _started.is_alive():
            _started = threading.Thread(
                target=run, args=(threading.Event(),), name="quire-relay-wake", daemon=True
            )
            _started.start()
        return _started


def run(stop: threading.Event) -> None:
    """Listen and relay until ``stop`` is set. A lost connection (the database restarted) is
    opened again after a second; meanwhile the outbox sweep's tick publishes."""
    conn: Any = None
    while not stop.is_set():
        try:
            if conn is None:
                conn = notify.listen_connection(fair.CHANNEL)
                woken = True  # anything written while nobody listened
            else:
                readable, _, _ = select.select([conn.fileno()], [], [], IDLE_S)
                woken = bool(readable)
                if woken:
                    for _ in conn.notifies(timeout=0.0):
                        pass
            if woken:
                dispatch.outbox_rows_publish_woken()
        except Exception as exc:
            log.warning("relay wake-up loop failed; retrying", extra={"error": type(exc).__name__})
            close_old_connections()
            if conn is not None:
                with contextlib.suppress(Exception):
                    conn.close()
                conn = None
            stop.wait(1.0)
    if conn is not None:
        conn.close()
