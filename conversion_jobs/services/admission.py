"""Admission control (DESIGN.md §5): live jobs per tenant and globally against capacities.

The count runs just before the acceptance transaction, so N concurrent submits can each see
room for one more: the overshoot is bounded by the number of acceptance transactions in flight
at once (web processes x WEB_THREADS sync threads, minus one).
``docs/adr/0004-admission-overshoot.md``.
"""

from __future__ import annotations

import math
from datetime import timedelta

from django.conf import settings
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
    """Raises TenantQuotaExceeded (429) or CapacityExceeded (503); writes nothing."""
    quota = settings.QUIRE["TENANT_QUOTA"]
    capacity = settings.QUIRE["GLOBAL_CAPACITY"]
    # One scan of the live set answers both counts (one round trip on the hot path).
    counts = ConversionJob.objects.live().aggregate(
        tenant_live=Count("id", filter=Q(tenant=tenant)), global_live=Count("id")
    )
    tenant_live, global_live = counts["tenant_live"], counts["global_live"]
    if tenant_live >= quota:
        raise TenantQuotaExceeded(retry_after=retry_after_s(excess=tenant_live - quota + 1))
    if global_live >= capacity:
        raise CapacityExceeded(retry_after=retry_after_s(excess=global_live - capacity + 1))
