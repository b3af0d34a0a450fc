"""e2e: fair dispatch (docs/ARCHITECTURE.md §2b) with real workers, sweeper, beat and RabbitMQ:
a second tenant is served during a first tenant's flood, the messages in flight never exceed
the slots the workers announced, and a tenant that was idle takes one running job's slot at a
page boundary."""

from __future__ import annotations

import threading
import time

import pytest
from django.db import connections

from conversion_jobs.models import ConversionAttempt, ConversionJob, PageCheckpoint, WorkerSlot
from conversion_jobs.services import fair
from tests.e2e import harness

pytestmark = [pytest.mark.e2e, pytest.mark.fair_credits, pytest.mark.django_db(transaction=True)]

SLOW = {"_test_fault": {"kind": "slow", "seconds": 0.15}}


def test_fair__a_second_tenant_is_served_during_a_flood_within_the_credits(start, submit):
    start("worker", WORKER_CONCURRENCY="2", QUIRE_FAIR_CAPACITY="0")
    start("sweeper", QUIRE_FAIR_CAPACITY="0")
    start("beat", QUIRE_FAIR_CAPACITY="0")
    harness.wait_until(
        lambda: fair.capacity() == 2, timeout=20, what="the worker's two slots announced"
    )
    flood = [submit(pages=2, options=SLOW, tenant="tenant-a") for _ in range(30)]
    # Sample what is in flight while the flood runs: never more than the two slots.
    peaks: list[int] = []
    stop = threading.Event()

    def sample() -> None:
        try:
            while not stop.is_set():
                peaks.append(sum(fair.busy_by_tenant().values()))
                peaks.append(harness.queue_depth("conversion.v1"))
                time.sleep(0.05)
        finally:
            connections.close_all()

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    time.sleep(1.0)
    late = [submit(pages=1, tenant="tenant-b") for _ in range(3)]
    harness.wait_until(
        lambda: all(ConversionJob.objects.get(id=j.id).state == "succeeded" for j in late),
        timeout=60,
        what="tenant b's jobs to succeed",
    )
    # b did not wait for a's backlog: most of a's flood has not even started yet
    unstarted = ConversionJob.objects.filter(
        id__in=[j.id for j in flood], state="queued", attempts=0
    ).count()
    assert unstarted >= 15, unstarted
    harness.wait_until(
        lambda: (
            ConversionJob.objects.filter(id__in=[j.id for j in flood], state="succeeded").count()
            == len(flood)
        ),
        timeout=120,
        what="the flood to drain",
    )
    stop.set()
    sampler.join(5)
    assert peaks and max(peaks) <= 2, max(peaks)
    assert WorkerSlot.objects.count() == 2


def test_fair__a_tenant_that_was_idle_preempts_one_running_job(start, submit):
    """Two worker processes busy with a's slow jobs; b submits one job. One of a's running
    attempts gives its slot back at a page boundary (ADR 0021, "A tenant with nothing
    running"), never both; b runs before either of them could have finished; every one of a's
    pages is converted once."""
    env = {"QUIRE_FAIR_CAPACITY": "0", "QUIRE_FAIR_SLICE_S": "3600"}
    start("worker", WORKER_CONCURRENCY="2", **env)
    start("sweeper", **env)
    start("beat", **env)
    harness.wait_until(
        lambda: fair.capacity() == 2, timeout=20, what="the worker's two slots announced"
    )
    flood = [submit(pages=8, options=SLOW, tenant="tenant-a") for _ in range(6)]
    harness.wait_until(
        lambda: ConversionAttempt.objects.filter(finished_at__isnull=True).count() == 2,
        timeout=30,
        what="two of a's attempts running",
    )
    running = list(ConversionAttempt.objects.filter(finished_at__isnull=True))
    late = submit(pages=1, tenant="tenant-b")
    harness.wait_until(
        lambda: ConversionJob.objects.get(id=late.id).state == "succeeded",
        timeout=60,
        what="tenant b's job to succeed",
    )
    b_started = ConversionAttempt.objects.get(job_id=late.id).started_at
    ends = []
    for attempt in running:
        attempt.refresh_from_db()
        ends.append(attempt.finished_at)
    # b did not wait for a running job's end: one of them yielded for it
    assert any(end is not None and end <= b_started for end in ends)
    yielded = ConversionAttempt.objects.filter(job__tenant="tenant-a", outcome="yielded")
    assert yielded.count() == 1, list(yielded.values_list("job_id", "pages_converted"))
    harness.wait_until(
        lambda: (
            ConversionJob.objects.filter(id__in=[j.id for j in flood], state="succeeded").count()
            == len(flood)
        ),
        timeout=120,
        what="the flood to drain",
    )
    for job in flood:
        per_generation = ConversionAttempt.objects.filter(job_id=job.id).values_list(
            "pages_converted", flat=True
        )
        assert sum(per_generation) == 8
        assert PageCheckpoint.objects.filter(job_id=job.id, state="done").count() == 8
