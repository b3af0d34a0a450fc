"""e2e: fair dispatch (docs/ARCHITECTURE.md §2b) with real workers, sweeper, beat and RabbitMQ:
a second tenant is served during a first tenant's flood, and the messages in flight never
exceed the slots the workers announced."""

from __future__ import annotations

import threading
import time

import pytest
from django.db import connection, connections, transaction

from conversion_jobs.models import ConversionJob, WorkerSlot
from conversion_jobs.services import fair
from tests.e2e import harness

pytestmark = [pytest.mark.e2e, pytest.mark.fair_credits, pytest.mark.django_db(transaction=True)]

SLOW = {"_test_fault": {"kind": "slow", "seconds": 0.15}}


def _busy_in_one_snapshot() -> int:
    """The busy slots as one instant saw them: ``busy_by_tenant`` reads running jobs and sent
    ones in separate statements, so outside one snapshot a slot handed over between them (a job
    ends, the relay sends the next) counts twice. The pick counts in one statement."""
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        return sum(fair.busy_by_tenant().values())


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
                peaks.append(_busy_in_one_snapshot())
                # read live: list_queues' count of a quorum queue is up to 5 s old (it once
                # showed the 39 messages a purge had just removed); the messages held by the
                # two prefetch-1 pool processes are the busy slots sampled above
                peaks.append(harness.ready_now("conversion.v1"))
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
