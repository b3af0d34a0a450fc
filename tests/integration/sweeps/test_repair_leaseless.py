"""The repair sweep (defence in depth, docs/OPERABILITY.md): a running or cancelling job with no
lease row and no open attempt is in a state no edge leaves, and the lease sweep (which starts
from lease rows) never sees it. The repair moves it through the lease-loss edges of
``transitions.py`` and counts it in ``quire_jobs_repaired_total``. Real database, the real sweep
task, the real /metrics view."""

from __future__ import annotations

import logging

import pytest

from conversion_jobs.models import (
    CancellationRequest,
    ConversionAttempt,
    ConversionJob,
    ConversionOutbox,
    SweepStatus,
    WorkerLease,
)
from conversion_jobs.services import recovery, transitions
from conversion_jobs.services.audit import audit_chain_verify
from conversion_jobs.states import State
from tasks import sweeps as sweep_tasks
from tests.integration.observability.test_metrics_script import metric, scrape

pytestmark = pytest.mark.django_db

REPAIRED = "quire_jobs_repaired_total"


def _stranded_by_the_old_recovery(make_job, *, cancelling: bool) -> ConversionJob:
    """What the lease sweep used to leave behind when a cancel fell between its tried edges:
    a real claim, then its attempt closed and its lease row deleted, the job still leased."""
    job = make_job(state=State.QUEUED)
    claim = transitions.claim(job_id=job.id, generation=1, worker="w")
    assert claim is not None
    if cancelling:
        assert transitions.cancel_running(job_id=job.id, tenant=job.tenant, actor="a")
        CancellationRequest.objects.create(
            job_id=job.id,
            tenant=job.tenant,
            actor="a",
            generation_seen=1,
            state_seen="running",
            outcome="cancelling",
        )
    transitions.attempt_close(lease=claim.lease, outcome="lease_lost", error_code="lease_lost")
    WorkerLease.objects.filter(job_id=job.id).delete()
    return ConversionJob.objects.get(id=job.id)


def test_repair__cancelling_job_without_a_lease_ends_cancelled_and_is_counted(
    make_job, client, no_broker_publish, caplog
):
    job = _stranded_by_the_old_recovery(make_job, cancelling=True)
    before = metric(scrape(), REPAIRED, result="cancelled")

    with caplog.at_level(logging.INFO, logger="conversion_jobs.services.recovery"):
        assert sweep_tasks.repair_leaseless_jobs() == 1

    after = ConversionJob.objects.get(id=job.id)
    assert (after.state, after.lease_token) == (State.CANCELLED, None)
    assert after.finished_at is not None
    request = CancellationRequest.objects.get(job_id=job.id)
    assert (request.outcome, request.resolved_at is not None) == ("cancelled", True)
    assert audit_chain_verify(job_id=job.id)[1] == []
    assert metric(scrape(), REPAIRED, result="cancelled") == before + 1
    assert SweepStatus.objects.get(name="repair_leaseless_jobs").last_success_at is not None
    lines = [r.getMessage() for r in caplog.records if "repaired" in r.getMessage()]
    assert lines == ["repaired leaseless jobs: requeued=0 exhausted=0 cancelled=1"]
    assert str(job.id) not in caplog.text  # counts only
    assert sweep_tasks.repair_leaseless_jobs() == 0


def test_repair__running_job_without_a_lease_runs_again_as_a_new_generation(
    make_job, client, no_broker_publish
):
    job = _stranded_by_the_old_recovery(make_job, cancelling=False)
    before = metric(scrape(), REPAIRED, result="requeued")

    assert recovery.conversion_jobs_repair_if_leaseless() == 1

    after = ConversionJob.objects.get(id=job.id)
    assert (after.state, after.generation, after.lease_token) == (State.QUEUED, 2, None)
    assert ConversionOutbox.objects.filter(job_id=job.id, generation=2).exists()
    assert audit_chain_verify(job_id=job.id)[1] == []
    assert metric(scrape(), REPAIRED, result="requeued") == before + 1


def test_repair__factory_job_with_its_budget_spent_fails_attempts_exhausted(
    make_job, client, no_broker_publish
):
    # The factory's running job has a lease token and no lease or attempt row at all.
    job = make_job(state=State.RUNNING, attempts=5, max_attempts=5)
    before = metric(scrape(), REPAIRED, result="exhausted")

    assert recovery.conversion_jobs_repair_if_leaseless() == 1

    after = ConversionJob.objects.get(id=job.id)
    assert (after.state, after.error_code, after.lease_token) == (
        State.FAILED,
        "attempts_exhausted",
        None,
    )
    assert audit_chain_verify(job_id=job.id)[1] == []
    assert metric(scrape(), REPAIRED, result="exhausted") == before + 1


def test_repair__leased_jobs_with_a_lease_or_an_open_attempt_are_left_alone(
    make_job, no_broker_publish
):
    healthy = make_job(state=State.QUEUED)
    assert transitions.claim(job_id=healthy.id, generation=1, worker="w")
    # an open attempt without its lease row: the lease sweep's and the worker's business
    half = make_job(state=State.QUEUED)
    assert transitions.claim(job_id=half.id, generation=1, worker="w")
    WorkerLease.objects.filter(job_id=half.id).delete()
    make_job(state=State.QUEUED)
    make_job(state=State.FAILED)

    assert recovery.conversion_jobs_repair_if_leaseless() == 0

    assert set(
        ConversionJob.objects.filter(id__in=[healthy.id, half.id]).values_list("state", flat=True)
    ) == {State.RUNNING}
    assert ConversionAttempt.objects.filter(job_id=half.id, finished_at=None).exists()


def test_repair__the_metric_is_exposed_at_zero_from_the_first_scrape():
    values = scrape()
    for result in ("requeued", "exhausted", "cancelled"):
        assert (REPAIRED, frozenset({("result", result)})) in values
