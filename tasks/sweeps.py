"""Beat sweeps: each task calls one service. Every sweep is safe when two beats run at once."""

from __future__ import annotations

from celery import shared_task

from conversion_jobs.services import dispatch, recovery


@shared_task(name="tasks.sweeps.publish_outbox", ignore_result=True)
def publish_outbox() -> int:
    return dispatch.outbox_rows_publish_unpublished().published


@shared_task(name="tasks.sweeps.republish_stale_queued", ignore_result=True)
def republish_stale_queued() -> int:
    return dispatch.conversion_jobs_republish_if_dispatch_stale()


@shared_task(name="tasks.sweeps.requeue_due_retries", ignore_result=True)
def requeue_due_retries() -> int:
    return recovery.conversion_jobs_requeue_if_retry_due()


@shared_task(name="tasks.sweeps.recover_expired_leases", ignore_result=True)
def recover_expired_leases() -> int:
    return recovery.conversion_jobs_recover_if_lease_expired()


@shared_task(name="tasks.sweeps.remove_stale_work_dirs", ignore_result=True)
def remove_stale_work_dirs() -> int:
    from conversion_jobs.passwords import sealed_passwords_wipe

    sealed_passwords_wipe()  # a terminal job's document password goes with its leftovers
    return recovery.work_dirs_remove_stale()


@shared_task(name="tasks.sweeps.remove_orphaned_artifacts", ignore_result=True)
def remove_orphaned_artifacts() -> int:
    from conversion_jobs.services.artifacts import artifacts_remove_orphans

    return artifacts_remove_orphans()


@shared_task(name="tasks.sweeps.apply_retention", ignore_result=True)
def apply_retention() -> int:
    from conversion_jobs.services.retention import retention_apply

    result = retention_apply()
    return result.jobs_expired + result.jobs_purged
