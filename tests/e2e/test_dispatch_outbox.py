"""e2e: dispatch through the outbox (issue 3 acceptance), real RabbitMQ and real processes."""

from __future__ import annotations

import time

import pytest

from conversion_jobs.models import (
    ConversionAttempt,
    ConversionJob,
    ConversionOutbox,
    ExecutionAuditEvent,
)
from tests.e2e import harness

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def test_outbox__crash_between_commit_and_publish_is_recovered_by_the_sweeper_exactly_once(
    start, submit
):
    worker = start("worker")
    with harness.broker_unreachable():
        job = submit(pages=3)
    row = ConversionOutbox.objects.get(job_id=job.id)
    assert row.published_at is None and row.publish_attempts == 1
    assert row.last_error_code == "broker_unreachable"
    time.sleep(1.5)
    # Nothing reached the broker: the worker is idle and the job still queued.
    assert ConversionJob.objects.get(id=job.id).state == "queued"
    assert not ConversionAttempt.objects.filter(job_id=job.id).exists()

    start("sweeper")
    start("beat")
    harness.wait_until(
        lambda: ConversionJob.objects.get(id=job.id).state == "succeeded",
        timeout=30,
        what="the job to succeed after the outbox sweep",
    )
    row.refresh_from_db()
    assert row.published_at is not None and row.publish_attempts == 2
    attempts = list(ConversionAttempt.objects.filter(job_id=job.id))
    assert [(a.generation, a.outcome) for a in attempts] == [(1, "succeeded")]
    assert ExecutionAuditEvent.objects.filter(job_id=job.id, event_type="published").count() == 1
    assert worker.popen.poll() is None


def test_delivery__five_copies_of_one_generation_raced_by_two_workers_run_once(start, submit):
    job = submit(pages=2, options={"_test_fault": {"kind": "slow", "seconds": 0.3}})
    # The fast path already published one copy; four more make five deliveries of (id, 1).
    harness.publish_task(job_id=job.id, generation=1, copies=4)
    start("worker")
    start("worker")
    harness.wait_until(
        lambda: ConversionJob.objects.get(id=job.id).state == "succeeded",
        timeout=30,
        what="success",
    )
    # Every copy is consumed (acked), none left in the queue or dead-lettered.
    harness.wait_until(
        lambda: harness.queue_depth(harness.CONVERSION_QUEUE) == 0, timeout=15, what="queue drained"
    )
    assert harness.queue_depth(harness.DEAD_QUEUE) == 0
    attempts = list(ConversionAttempt.objects.filter(job_id=job.id))
    assert [(a.generation, a.outcome) for a in attempts] == [(1, "succeeded")]
    events = list(
        ExecutionAuditEvent.objects.filter(job_id=job.id).values_list("event_type", flat=True)
    )
    assert events.count("claimed") == 1 and events.count("published") == 1
    assert ConversionJob.objects.get(id=job.id).generation == 1
