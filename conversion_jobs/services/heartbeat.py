"""The heartbeat thread of a running attempt (DESIGN.md §7.3): extends the lease every
``HEARTBEAT_S`` and raises the stop flag when the job is being cancelled or the lease is lost."""

from __future__ import annotations

import threading
import time

from django.conf import settings
from django.db import connection

from conversion_jobs.services.db_retry import DB_ERRORS
from conversion_jobs.services.leases import HeartbeatResult, Lease, lease_heartbeat


class StopReason:
    CANCELLED = "cancelled"
    LOST = "lost"


class Heartbeat(threading.Thread):
    """Extends the lease; sets ``stop`` with a reason when it must end."""

    def __init__(self, lease: Lease) -> None:
        super().__init__(name=f"heartbeat-{lease.job_id}", daemon=True)
        self.lease = lease
        self.stop = threading.Event()
        self.reason: str | None = None
        self._done = threading.Event()
        self._last_ok = time.monotonic()

    def halt(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason
        self.stop.set()

    def run(self) -> None:
        interval = settings.QUIRE["HEARTBEAT_S"]
        try:
            while not self._done.wait(interval):
                try:
                    result = lease_heartbeat(lease=self.lease)
                except DB_ERRORS:
                    connection.close()
                    # Without the database we cannot prove the lease; past its TTL it is gone.
                    if time.monotonic() - self._last_ok > settings.QUIRE["LEASE_S"]:
                        self.halt(StopReason.LOST)
                        return
                    continue
                self._last_ok = time.monotonic()
                if result == HeartbeatResult.CANCELLING:
                    self.halt(StopReason.CANCELLED)
                    return
                if result == HeartbeatResult.LOST:
                    self.halt(StopReason.LOST)
                    return
        finally:
            connection.close()

    def finish(self) -> None:
        self._done.set()
        self.join(timeout=5)
