"""The claim's commit does not wait for its WAL flush (ADR 0017 session 5,
``QUIRE_CLAIM_ASYNC_COMMIT``), and a claim that a Postgres crash loses before that flush loses
nothing: the attempt's writes are fenced out and the dispatch-timeout sweep sends the job again."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection, transaction
from django.utils import timezone

from conversion_jobs.models import ConversionAttempt, ConversionJob, ConversionOutbox, WorkerLease
from conversion_jobs.services import dispatch, transitions
from conversion_jobs.store import outbox
from tests.integration.transitions.builders import text_result

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


def _commit_mode_of_a_claim(job: ConversionJob) -> str:
    """``synchronous_commit`` as the claim leaves it for the transaction it runs in."""
    with transaction.atomic():
        assert transitions.claim(job_id=job.id, generation=1, worker="w") is not None
        with connection.cursor() as cursor:
            cursor.execute("SHOW synchronous_commit")
            (mode,) = cursor.fetchone()
        transaction.set_rollback(True)
    return str(mode)


def test_claim__commits_without_waiting_for_the_flush(
    make_job: Callable[..., ConversionJob],
) -> None:
    assert _commit_mode_of_a_claim(make_job()) == "off"


def test_claim__waits_for_the_flush_when_turned_off(
    make_job: Callable[..., ConversionJob], settings: Any
) -> None:
    settings.QUIRE = {**settings.QUIRE, "CLAIM_ASYNC_COMMIT": False}
    assert _commit_mode_of_a_claim(make_job()) == "on"


def test_claim__a_lost_claim_never_publishes_and_is_dispatched_again(
    make_job: Callable[..., ConversionJob], settings: Any, no_broker_publish: list[Any]
) -> None:
    job = make_job(queued_at=timezone.now() - timedelta(hours=1))
    # A crash before the flush: the claim's transaction never happened.
    with transaction.atomic():
        lost = transitions.claim(job_id=job.id, generation=1, worker="w")
        assert lost is not None
        transaction.set_rollback(True)
    row = ConversionJob.objects.get(id=job.id)
    assert (row.state, row.generation, row.attempts, row.lease_token) == ("queued", 1, 0, None)
    assert not ConversionAttempt.objects.filter(job_id=job.id).exists()
    assert not WorkerLease.objects.filter(job_id=job.id).exists()
    result = text_result()
    assert transitions.publish_succeeded(lease=lost.lease, result=result) is False
    assert ConversionJob.objects.get(id=job.id).result_key is None
    settings.QUIRE = {**settings.QUIRE, "DISPATCH_TIMEOUT_S": 60.0}
    assert dispatch.conversion_jobs_republish_if_dispatch_stale() == 1
    assert ConversionOutbox.objects.filter(job_id=job.id, generation=1).exists()
    again = transitions.claim(job_id=job.id, generation=1, worker="w2")
    assert again is not None and again.lease.token != lost.lease.token
    assert transitions.publish_succeeded(lease=again.lease, result=result) is True


def _commit_mode_of_a_mark(ids: list[int]) -> str:
    """``synchronous_commit`` as the background publisher's mark leaves its transaction."""
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute(outbox.MARK_PUBLISHED, {"ids": ids})
            cursor.execute("SHOW synchronous_commit")
            (mode,) = cursor.fetchone()
        transaction.set_rollback(True)
    return str(mode)


def test_publisher_mark__commits_without_waiting_for_the_flush(
    make_job: Callable[..., ConversionJob],
) -> None:
    """A mark lost with a crash leaves the row to the outbox sweep (a duplicate message the
    claim's CAS ignores), so its commit need not wait; a mark that matches nothing changes
    nothing, not even the commit mode."""
    row = ConversionOutbox.objects.create(job=make_job(), generation=1)
    assert _commit_mode_of_a_mark([row.id]) == "off"
    assert _commit_mode_of_a_mark([-1]) == "on"
