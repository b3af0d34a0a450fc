"""One entry per sweep: its task, interval and why.

``python manage.py install_beat_schedule`` writes these into django-celery-beat's tables (run by
the Procfile's ``release``); the ``beat`` process reads them with the ``DatabaseScheduler``.
Every sweep is idempotent and claims rows with ``FOR UPDATE SKIP LOCKED``, so two beats running
at once do no harm. Each message expires after a few intervals: a sweeper that was down does not
come back to a pile of identical sweeps.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured


@dataclass(frozen=True)
class Sweep:
    name: str
    task: str
    every_s: float
    why: str

    @property
    def key(self) -> str:
        """The short name in ``sweep_status`` and the metric's ``sweep`` label."""
        return self.task.rsplit(".", 1)[1]


def sweeps() -> list[Sweep]:
    """The schedule, each interval as ``QUIRE_SWEEP_INTERVALS_S`` may override it by short name
    (docs/OPERABILITY.md); a name the schedule does not have is a configuration error."""
    overrides: dict[str, float] = settings.QUIRE["SWEEP_INTERVALS_S"]
    schedule = _default_sweeps()
    unknown = sorted(set(overrides) - {s.key for s in schedule})
    if unknown:
        raise ImproperlyConfigured(f"QUIRE_SWEEP_INTERVALS_S names no sweep: {', '.join(unknown)}")
    return [replace(s, every_s=overrides.get(s.key, s.every_s)) for s in schedule]


def _default_sweeps() -> list[Sweep]:
    tick = settings.QUIRE["SWEEP_INTERVAL_S"]
    return [
        Sweep(
            "quire: publish outbox",
            "tasks.sweeps.publish_outbox",
            tick,
            "Backstop for the on_commit fast path: a crash or broker outage between commit and "
            "confirm leaves rows unpublished; this publishes them (docs/ARCHITECTURE.md §2).",
        ),
        Sweep(
            "quire: recover expired leases",
            "tasks.sweeps.recover_expired_leases",
            tick,
            "A dead or frozen worker's job runs again within lease TTL + one interval (§7.6).",
        ),
        Sweep(
            "quire: recover expired ranges",
            "tasks.sweeps.recover_expired_ranges",
            tick,
            "A dead or frozen worker's page range runs again, alone, within lease TTL + one "
            "interval; a cancelled fanned-out job with no running range ends (ADR 0023).",
        ),
        Sweep(
            "quire: requeue due retries",
            "tasks.sweeps.requeue_due_retries",
            tick,
            "Retry timers are Postgres timestamps; this turns due ones into new generations.",
        ),
        Sweep(
            "quire: republish stale queued jobs",
            "tasks.sweeps.republish_stale_queued",
            max(tick, 30.0),
            "A message lost inside the broker (dead-lettered, purged) must not strand a job; "
            "only jobs queued past QUIRE_DISPATCH_TIMEOUT_S are touched.",
        ),
        Sweep(
            "quire: repair leaseless jobs",
            "tasks.sweeps.repair_leaseless_jobs",
            60.0,
            "Defence in depth: a running or cancelling job with no lease row and no open "
            "attempt is in a state no edge leaves, so the lease sweep never sees it; repaired "
            "like an expired lease and counted (quire_jobs_repaired_total, expected to stay 0).",
        ),
        Sweep(
            "quire: remove stale work directories",
            "tasks.sweeps.remove_stale_work_dirs",
            60.0,
            "A killed worker cannot clean its attempt directory; no later attempt may read it.",
        ),
        Sweep(
            "quire: remove orphaned artifacts",
            "tasks.sweeps.remove_orphaned_artifacts",
            600.0,
            "A crash between storing an object and committing the row that names it leaves an "
            "object nobody names; deleted once older than QUIRE_ORPHAN_GRACE_S (both backends).",
        ),
        Sweep(
            "quire: apply retention",
            "tasks.sweeps.apply_retention",
            300.0,
            "Expire results and sources past QUIRE_RESULT_RETENTION_S (rows first, files "
            "second), prune published outbox rows, purge audit chains past their retention.",
        ),
    ]


def sweep_interval(key: str) -> float:
    """The interval of the sweep whose short name is ``key``."""
    return next(s.every_s for s in sweeps() if s.key == key)
