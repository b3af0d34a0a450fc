"""Every beat sweep claims its rows with ``FOR UPDATE SKIP LOCKED``: a row that a second
connection holds (another beat mid-sweep) is skipped at once, never waited for and never moved
twice; once released, the next sweep moves it."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.utils import timezone

from conversion_jobs.models import ConversionJob, ConversionOutbox, WorkerLease
from conversion_jobs.services import dispatch, recovery, retention, transitions
from tests.integration.transitions.test_edges import second_connection

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

AGO = timezone.now() - timedelta(days=30)


def _outbox(make_job: Callable[..., ConversionJob]) -> tuple[str, Any, Callable[[], int]]:
    job = make_job()
    row = ConversionOutbox.objects.create(job=job, generation=1)
    ConversionOutbox.objects.filter(id=row.id).update(created_at=AGO)
    return (
        "SELECT 1 FROM conversion_outbox WHERE id = %s FOR UPDATE",
        row.id,
        lambda: dispatch.outbox_rows_publish_unpublished().published,
    )


def _stale_queued(make_job: Callable[..., ConversionJob]) -> tuple[str, Any, Callable[[], int]]:
    job = make_job(queued_at=AGO)
    return (
        "SELECT 1 FROM conversion_job WHERE id = %s FOR UPDATE",
        job.id,
        dispatch.conversion_jobs_republish_if_dispatch_stale,
    )


def _due_retry(make_job: Callable[..., ConversionJob]) -> tuple[str, Any, Callable[[], int]]:
    job = make_job(state="retry_wait", next_attempt_at=AGO)
    return (
        "SELECT 1 FROM conversion_job WHERE id = %s FOR UPDATE",
        job.id,
        recovery.conversion_jobs_requeue_if_retry_due,
    )


def _expired_lease(make_job: Callable[..., ConversionJob]) -> tuple[str, Any, Callable[[], int]]:
    job = make_job()
    assert transitions.claim(job_id=job.id, generation=1, worker="w")
    WorkerLease.objects.filter(job_id=job.id).update(expires_at=AGO)
    return (
        "SELECT 1 FROM worker_lease WHERE job_id = %s FOR UPDATE",
        job.id,
        recovery.conversion_jobs_recover_if_lease_expired,
    )


def _past_retention(make_job: Callable[..., ConversionJob]) -> tuple[str, Any, Callable[[], int]]:
    job = make_job(state="succeeded", finished_at=AGO)
    return (
        "SELECT 1 FROM conversion_job WHERE id = %s FOR UPDATE",
        job.id,
        lambda: retention.conversion_jobs_expire_if_past_retention(batch=10),
    )


SWEEPS = {
    "publish_outbox": _outbox,
    "republish_stale_queued": _stale_queued,
    "requeue_due_retries": _due_retry,
    "recover_expired_leases": _expired_lease,
    "expire_past_retention": _past_retention,
}


@pytest.mark.parametrize("sweep", list(SWEEPS))
def test_sweep__skips_a_row_another_connection_holds(sweep, make_job, no_broker_publish):
    lock_sql, key, run = SWEEPS[sweep](make_job)
    other = second_connection()
    try:
        other.execute(lock_sql, (key,))
        with connection.cursor() as cursor:  # a sweep that waited would fail here, not hang
            cursor.execute("SET statement_timeout = 5000")
        assert run() == 0
        other.rollback()
        assert run() == 1
        assert run() == 0
    finally:
        other.close()
        with connection.cursor() as cursor:
            cursor.execute("SET statement_timeout = 0")
