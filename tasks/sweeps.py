"""Beat sweeps: each task calls one service and, when it returns, records the sweep's success
(``sweep_status``, docs/OPERABILITY.md §7). Every sweep is safe when two beats run at once."""

from __future__ import annotations

import logging
from collections.abc import Callable

from celery import Task, shared_task

from beat_schedules.schedule import sweep_interval
from conversion_jobs.passwords import sealed_passwords_wipe
from conversion_jobs.services import dispatch, recovery, sweep_health
from conversion_jobs.services.artifacts import artifacts_remove_orphans
from conversion_jobs.services.db_retry import connections_refresh
from conversion_jobs.services.fanout import (
    job_ranges_recover_if_lease_expired,
    source_cache_remove_stale,
)
from conversion_jobs.services.retention import retention_apply

log = logging.getLogger("quire.sweeps")


def _sweep(name: str, run: Callable[[], int]) -> int:
    """Run one sweep; only a sweep that finished records a success. A sweep that moved
    anything says so at INFO (its name and count only), so what the sweeper did can be read
    from its log after the fact (docs/OPERABILITY.md, "Sweeps"). A connection a failed sweep
    left broken (a database outage) is replaced first."""
    connections_refresh()
    done = run()
    sweep_health.sweep_succeeded(name=name, interval_s=sweep_interval(name))
    if done:
        log.info("sweep %s: %d", name, done)
    return done


def _sweep_task(name: str, run: Callable[[], int]) -> Task[[], int]:
    """The beat task ``tasks.sweeps.<name>`` (beat_schedules/schedule.py names it): ``run``
    through ``_sweep``."""

    @shared_task(name=f"tasks.sweeps.{name}", ignore_result=True)
    def sweep() -> int:
        return _sweep(name, run)

    return sweep


def _publish_outbox() -> int:
    return dispatch.outbox_rows_publish_unpublished().published


def _remove_stale_work_dirs() -> int:
    sealed_passwords_wipe()  # a terminal job's document password goes with its leftovers
    source_cache_remove_stale()  # range sources cached for jobs that ended (ADR 0023)
    return recovery.work_dirs_remove_stale()


def _apply_retention() -> int:
    result = retention_apply()
    return result.jobs_expired + result.jobs_purged


# A module's service is looked up when the sweep runs, not at import (a test replaces one).
publish_outbox = _sweep_task("publish_outbox", _publish_outbox)
republish_stale_queued = _sweep_task(
    "republish_stale_queued", lambda: dispatch.conversion_jobs_republish_if_dispatch_stale()
)
requeue_due_retries = _sweep_task(
    "requeue_due_retries", lambda: recovery.conversion_jobs_requeue_if_retry_due()
)
recover_expired_leases = _sweep_task(
    "recover_expired_leases", lambda: recovery.conversion_jobs_recover_if_lease_expired()
)
recover_expired_ranges = _sweep_task("recover_expired_ranges", job_ranges_recover_if_lease_expired)
repair_leaseless_jobs = _sweep_task(
    "repair_leaseless_jobs", lambda: recovery.conversion_jobs_repair_if_leaseless()
)
remove_stale_work_dirs = _sweep_task("remove_stale_work_dirs", _remove_stale_work_dirs)
remove_orphaned_artifacts = _sweep_task("remove_orphaned_artifacts", artifacts_remove_orphans)
apply_retention = _sweep_task("apply_retention", _apply_retention)
