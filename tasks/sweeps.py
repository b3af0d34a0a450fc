"""Beat sweeps: each task calls one service and, when it returns, records the sweep's success
(``sweep_status``, docs/OPERABILITY.md §7). Every sweep is safe when two beats run at once."""

from __future__ import annotations

import logging
from collections.abc import Callable

from celery import shared_task

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


@shared_task(name="tasks.sweeps.publish_outbox", ignore_result=True)
def publish_outbox() -> int:
    return _sweep("publish_outbox", lambda: dispatch.outbox_rows_publish_unpublished().published)


@shared_task(name="tasks.sweeps.republish_stale_queued", ignore_result=True)
def republish_stale_queued() -> int:
    return _sweep("republish_stale_queued", dispatch.conversion_jobs_republish_if_dispatch_stale)


@shared_task(name="tasks.sweeps.requeue_due_retries", ignore_result=True)
def requeue_due_retries() -> int:
    return _sweep("requeue_due_retries", recovery.conversion_jobs_requeue_if_retry_due)


@shared_task(name="tasks.sweeps.recover_expired_leases", ignore_result=True)
def recover_expired_leases() -> int:
    return _sweep("recover_expired_leases", recovery.conversion_jobs_recover_if_lease_expired)


@shared_task(name="tasks.sweeps.recover_expired_ranges", ignore_result=True)
def recover_expired_ranges() -> int:
    return _sweep("recover_expired_ranges", job_ranges_recover_if_lease_expired)


@shared_task(name="tasks.sweeps.repair_leaseless_jobs", ignore_result=True)
def repair_leaseless_jobs() -> int:
    return _sweep("repair_leaseless_jobs", recovery.conversion_jobs_repair_if_leaseless)


@shared_task(name="tasks.sweeps.remove_stale_work_dirs", ignore_result=True)
def remove_stale_work_dirs() -> int:
    return _sweep("remove_stale_work_dirs", _remove_stale_work_dirs)


def _remove_stale_work_dirs() -> int:
    sealed_passwords_wipe()  # a terminal job's document password goes with its leftovers
    source_cache_remove_stale()  # range sources cached for jobs that ended (ADR 0023)
    return recovery.work_dirs_remove_stale()


@shared_task(name="tasks.sweeps.remove_orphaned_artifacts", ignore_result=True)
def remove_orphaned_artifacts() -> int:
    return _sweep("remove_orphaned_artifacts", artifacts_remove_orphans)


@shared_task(name="tasks.sweeps.apply_retention", ignore_result=True)
def apply_retention() -> int:
    def run() -> int:
        result = retention_apply()
        return result.jobs_expired + result.jobs_purged

    return _sweep("apply_retention", run)
