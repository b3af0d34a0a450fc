"""e2e: the broker and the database restart under load; every accepted job ends exactly once."""

from __future__ import annotations

import os

import pytest
from django.db import connection

from conversion_jobs.models import ConversionAttempt, ConversionJob, ExecutionAuditEvent
from tests.e2e import harness

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

TERMINAL = {"succeeded", "partial", "failed", "cancelled"}
SLOW = {"kind": "slow", "seconds": 0.4}


def _states(ids) -> dict:
    connection.close_if_unusable_or_obsolete()
    return dict(ConversionJob.objects.filter(id__in=ids).values_list("id", "state"))


@pytest.fixture
def services_restored(cluster):
    yield
    harness.rabbitmq_ensure_running()
    harness.postgres_ensure_running(os.environ["DATABASE_URL"].rsplit("/", 1)[0] + "/postgres")
    connection.close()


def test_restarts__rabbitmq_and_postgres_restarted_under_load_lose_and_duplicate_nothing(
    start, submit, services_restored
):
    start("worker")
    start("worker")
    start("sweeper")
    start("beat")
    jobs = [submit(pages=4, options={"_test_fault": SLOW}) for _ in range(6)]
    ids = [j.id for j in jobs]
    harness.wait_until(lambda: "running" in _states(ids).values(), timeout=30, what="a running job")
    harness.rabbitmq_restart()

    more = [submit(pages=4, options={"_test_fault": SLOW}) for _ in range(3)]
    ids += [j.id for j in more]
    harness.wait_until(
        lambda: "running" in _states(ids).values(), timeout=60, what="running after broker restart"
    )
    harness.postgres_restart()
    connection.close()

    harness.wait_until(
        lambda: set(_states(ids).values()) <= TERMINAL,
        timeout=150,
        interval=0.5,
        what="every job terminal",
    )
    states = _states(ids)
    assert set(states.values()) == {"succeeded"}, states
    for job_id in ids:
        assert (
            ExecutionAuditEvent.objects.filter(job_id=job_id, event_type="published").count() == 1
        )
        assert ConversionAttempt.objects.filter(job_id=job_id, outcome="succeeded").count() == 1
