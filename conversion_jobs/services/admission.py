"""Admission control (ADR 0004): live jobs per tenant and globally against capacities.

Counting every live job on every request costs O(backlog) per acceptance (Postgres reads each
live row). Each process therefore keeps an **admission snapshot**: the live counts per tenant,
read with one grouped count at most every ``ADMISSION_SNAPSHOT_S`` (0.25 s), plus the jobs this
process accepted since. A request whose snapshot counts are more than ``ADMISSION_EXACT_WITHIN``
(10 %) of a limit below it is admitted on the snapshot; closer to a limit, and before every
refusal, the exact count runs (``admission_check``) and decides. So a refusal is always exact
(a snapshot never turns a job away), and near a limit the behaviour is the exact count's.

The overshoot (ADR 0004) is bounded by the acceptance transactions in flight at once (web
processes x WEB_THREADS sync threads, minus one), plus what other web processes accepted within
one snapshot period beyond the 10 % margin (none unless they accepted more than 10 % of the
limit within 0.25 s). ``docs/adr/0004-admission-overshoot.md``.
"""

from __future__ import annotations

import math
import threading
import time
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.core.signals import setting_changed
from django.db.models import Count, Q
from django.utils import timezone

from conversion_jobs.exceptions import CapacityExceeded, TenantQuotaExceeded
from conversion_jobs.models import ConversionJob

DRAIN_WINDOW = timedelta(seconds=60)


def drain_rate_per_s() -> float:
    """Jobs that reached a terminal state per second over the last minute (cluster-wide)."""
    since = timezone.now() - DRAIN_WINDOW
    finished = ConversionJob.objects.filter(finished_at__gte=since).count()
    return finished / DRAIN_WINDOW.total_seconds()


def retry_after_s(*, excess: int) -> int:
    """Seconds until ``excess`` jobs have drained at the measured rate, clamped."""
    low, high = settings.QUIRE["RETRY_AFTER_MIN_S"], settings.QUIRE["RETRY_AFTER_MAX_S"]
    rate = drain_rate_per_s()
    if rate <= 0:
        return high
    return max(low, min(high, math.ceil(excess / rate)))


def admission_check(*, tenant: str) -> None:
    """The exact count. Raises TenantQuotaExceeded (429) or CapacityExceeded (503); writes
    nothing."""
    # One scan of the live set answers both counts.
    counts = ConversionJob.objects.live().aggregate(
        tenant_live=Count("id", filter=Q(tenant=tenant)), global_live=Count("id")
    )
    admission_verdict(tenant_live=counts["tenant_live"], global_live=counts["global_live"])


def admission_verdict(*, tenant_live: int, global_live: int) -> None:
    """The admission decision on counts taken elsewhere. Raises TenantQuotaExceeded (429) or
    CapacityExceeded (503)."""
    quota = settings.QUIRE["TENANT_QUOTA"]
    capacity = settings.QUIRE["GLOBAL_CAPACITY"]
    if tenant_live >= quota:
        raise TenantQuotaExceeded(retry_after=retry_after_s(excess=tenant_live - quota + 1))
    if global_live >= capacity:
        raise CapacityExceeded(retry_after=retry_after_s(excess=global_live - capacity + 1))


class _Snapshot:
    """This process's live counts: one grouped count at most every ``ttl`` seconds, plus the
    jobs accepted here since. A job accepted here while the count runs is counted twice, or,
    when it committed after the count's snapshot, only from the next refresh: one of the
    acceptances in flight that ADR 0004's bound already allows for."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._taken = -math.inf
        self._tenants: dict[str, int] = {}
        self._global = 0
        self._refreshing = False

    def counts(self, *, tenant: str, ttl: float) -> tuple[int, int]:
        """(tenant's live jobs, all live jobs). One thread refreshes an expired snapshot; the
        others meanwhile answer from the one it replaces (at most one refresh period older)."""
        with self._lock:
            age = time.monotonic() - self._taken
            if age < ttl or (self._refreshing and age < 2 * ttl):
                return self._tenants.get(tenant, 0), self._global
            self._refreshing = True
        try:
            rows = ConversionJob.objects.live().values_list("tenant").annotate(n=Count("id"))
            tenants = dict(rows.order_by())
        finally:
            with self._lock:
                self._refreshing = False
        with self._lock:
            self._tenants, self._global = tenants, sum(tenants.values())
            self._taken = time.monotonic()
            return self._tenants.get(tenant, 0), self._global

    def accepted(self, *, tenant: str) -> None:
        with self._lock:
            self._tenants[tenant] = self._tenants.get(tenant, 0) + 1
            self._global += 1

    def reset(self) -> None:
        with self._lock:
            self._taken = -math.inf
            self._tenants, self._global = {}, 0


_SNAPSHOT = _Snapshot()


def _margin(limit: int) -> int:
    return max(1, math.ceil(limit * settings.QUIRE["ADMISSION_EXACT_WITHIN"]))


def admission_admit(*, tenant: str) -> None:
    """Admits a new job for ``tenant`` on this process's snapshot when it is well below both
    limits; otherwise the exact count decides. Raises TenantQuotaExceeded (429) or
    CapacityExceeded (503); writes nothing."""
    ttl = settings.QUIRE["ADMISSION_SNAPSHOT_S"]
    if ttl > 0 and _well_below(_SNAPSHOT.counts(tenant=tenant, ttl=ttl)):
        return
    admission_check(tenant=tenant)


def _well_below(counts: tuple[int, int] | None) -> bool:
    if counts is None:
        return False
    quota = settings.QUIRE["TENANT_QUOTA"]
    capacity = settings.QUIRE["GLOBAL_CAPACITY"]
    tenant_live, global_live = counts
    return tenant_live < quota - _margin(quota) and global_live < capacity - _margin(capacity)


def admission_accepted(*, tenant: str) -> None:
    """A new job of ``tenant`` committed in this process: the snapshot counts it at once."""
    _SNAPSHOT.accepted(tenant=tenant)


def admission_snapshot_reset() -> None:
    """The next admission reads the live counts afresh (tests, a settings change)."""
    _SNAPSHOT.reset()


def _settings_changed(*, setting: str, **_: Any) -> None:
    if setting == "QUIRE":
        _SNAPSHOT.reset()


setting_changed.connect(_settings_changed)
