"""Sweeps that tell on themselves (docs/OPERABILITY.md §7).

Every sweep writes its ``sweep_status`` row when it succeeds; ``install_beat_schedule`` writes
each sweep's interval and install time. A sweep is *overdue* when its last success is older
than ``SWEEP_OVERDUE_FACTOR`` x its interval; one that never succeeded gets
``SWEEP_STARTUP_GRACE_S`` on top, counted from the install (a deploy's ``release``), so a fresh
deployment is not unready while beat and the sweeper start. ``/health/ready`` answers 503 naming
the overdue sweeps, and ``quire_sweep_last_success_timestamp_seconds`` shows each last success.

Times are the database's (``now()``), never a web host's clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from django.conf import settings
from django.db import transaction
from django.db.models.functions import Now

from conversion_jobs.models import SweepStatus


@dataclass(frozen=True)
class OverdueSweep:
    sweep: str
    #: seconds since the last success (or since the install, for one that never succeeded)
    age_s: float
    #: the age past which it counts as overdue
    allowed_s: float


def sweep_late_by(
    *,
    now: datetime,
    interval_s: float,
    installed_at: datetime,
    last_success_at: datetime | None,
    factor: float,
    startup_grace_s: float,
) -> float:
    """Seconds past the allowed age (> 0: overdue). The allowed age is ``factor`` x the
    interval after the last success, plus the start-up grace while there has been none."""
    allowed = factor * interval_s
    if last_success_at is None:
        return (now - installed_at).total_seconds() - (allowed + startup_grace_s)
    return (now - last_success_at).total_seconds() - allowed


def sweep_succeeded(*, name: str, interval_s: float) -> None:
    """Record a success of sweep ``name`` (called by the sweep, after its own transaction)."""
    updated = SweepStatus.objects.filter(name=name).update(last_success_at=Now())
    if not updated:  # the schedule was installed by an older release: the sweep adds its row
        SweepStatus.objects.get_or_create(
            name=name,
            defaults={"interval_s": interval_s, "installed_at": Now(), "last_success_at": Now()},
        )


def sweep_statuses_install(*, intervals: dict[str, float]) -> None:
    """One row per sweep of the schedule, each with its interval and a fresh install time;
    rows of sweeps no longer scheduled are removed. Last successes are kept."""
    with transaction.atomic():
        for name, interval_s in intervals.items():
            SweepStatus.objects.update_or_create(
                name=name, defaults={"interval_s": interval_s, "installed_at": Now()}
            )
        SweepStatus.objects.exclude(name__in=list(intervals)).delete()


def sweeps_overdue() -> list[OverdueSweep]:
    """The installed sweeps that are overdue now, by the database's clock."""
    factor = settings.QUIRE["SWEEP_OVERDUE_FACTOR"]
    grace = settings.QUIRE["SWEEP_STARTUP_GRACE_S"]
    overdue = []
    rows = SweepStatus.objects.annotate(db_now=Now()).order_by("name")
    for row in rows:
        late = sweep_late_by(
            now=row.db_now,
            interval_s=row.interval_s,
            installed_at=row.installed_at,
            last_success_at=row.last_success_at,
            factor=factor,
            startup_grace_s=grace,
        )
        if late > 0:
            reference = row.last_success_at or row.installed_at
            overdue.append(
                OverdueSweep(
                    sweep=row.name,
                    age_s=round((row.db_now - reference).total_seconds(), 1),
                    allowed_s=factor * row.interval_s
                    + (grace if row.last_success_at is None else 0),
                )
            )
    return overdue
