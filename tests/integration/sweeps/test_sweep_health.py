"""Sweeps that tell on themselves (docs/OPERABILITY.md §7): each sweep task records its success in
``sweep_status``; /health/ready names overdue sweeps with a 503; the metric shows each last
success. Real database, real sweep tasks (run in-process), real HTTP views."""

from __future__ import annotations

import io
from datetime import timedelta

import pytest
from django.core.management import call_command
from django.utils import timezone

from beat_schedules.schedule import sweeps
from conversion_jobs.models import SweepStatus
from tasks import sweeps as sweep_tasks
from tests.integration.observability.test_metrics_script import metric, scrape

pytestmark = pytest.mark.django_db


@pytest.fixture
def installed(settings):
    settings.QUIRE = {**settings.QUIRE, "SWEEP_OVERDUE_FACTOR": 10, "SWEEP_STARTUP_GRACE_S": 60}
    call_command("install_beat_schedule", stdout=io.StringIO())
    return {s.key: s.every_s for s in sweeps()}


def ready(client):
    response = client.get("/health/ready")
    return response.status_code, response.json()


def backdate(name: str, seconds: float, *, field: str = "last_success_at") -> None:
    SweepStatus.objects.filter(name=name).update(
        **{field: timezone.now() - timedelta(seconds=seconds)}
    )


def test_install_beat_schedule__one_status_row_per_sweep_with_its_interval(installed):
    rows = dict(SweepStatus.objects.values_list("name", "interval_s"))
    assert rows == installed
    assert set(SweepStatus.objects.values_list("last_success_at", flat=True)) == {None}


def test_sweep_task__records_its_success_when_it_finishes(installed):
    before = timezone.now()
    sweep_tasks.requeue_due_retries()
    row = SweepStatus.objects.get(name="requeue_due_retries")
    assert row.last_success_at is not None and row.last_success_at >= before - timedelta(seconds=1)
    assert SweepStatus.objects.get(name="publish_outbox").last_success_at is None


def test_sweep_task__a_failing_sweep_records_nothing(installed, monkeypatch):
    from conversion_jobs.services import recovery

    def broken() -> int:
        raise RuntimeError("sweep failed")

    monkeypatch.setattr(recovery, "conversion_jobs_requeue_if_retry_due", broken)
    with pytest.raises(RuntimeError):
        sweep_tasks.requeue_due_retries()
    assert SweepStatus.objects.get(name="requeue_due_retries").last_success_at is None


def test_health_ready__fresh_install_is_ready_within_the_start_up_grace(installed, client):
    status, body = ready(client)
    assert status == 200, body
    assert body["checks"]["sweeps"] is True


def test_health_ready__503_names_a_sweep_that_never_ran_past_the_grace(installed, client):
    SweepStatus.objects.update(last_success_at=timezone.now())
    backdate("publish_outbox", 10 * installed["publish_outbox"] + 61, field="installed_at")
    SweepStatus.objects.filter(name="publish_outbox").update(last_success_at=None)
    status, body = ready(client)
    assert status == 503
    assert body["checks"]["sweeps"] is False
    assert [o["sweep"] for o in body["overdue_sweeps"]] == ["publish_outbox"]


def test_health_ready__503_names_each_sweep_late_past_factor_times_interval(installed, client):
    SweepStatus.objects.update(last_success_at=timezone.now())
    backdate("recover_expired_leases", 10 * installed["recover_expired_leases"] + 2)
    backdate("apply_retention", 10 * installed["apply_retention"] - 5)  # late, not overdue
    status, body = ready(client)
    assert status == 503
    assert [o["sweep"] for o in body["overdue_sweeps"]] == ["recover_expired_leases"]
    overdue = body["overdue_sweeps"][0]
    assert overdue["allowed_s"] == 10 * installed["recover_expired_leases"]
    assert overdue["age_s"] >= overdue["allowed_s"]


def run_sweep(sweep) -> None:
    """The scheduled task itself, as the sweeper runs it (by its registered name)."""
    from project.celery import app

    app.tasks[sweep.task]()


def test_health_ready__back_to_200_when_the_overdue_sweep_runs_again(installed, client):
    SweepStatus.objects.update(last_success_at=timezone.now() - timedelta(days=1))
    assert ready(client)[0] == 503
    for sweep in sweeps():
        run_sweep(sweep)
    status, body = ready(client)
    assert status == 200, body


def test_every_scheduled_sweep__writes_its_own_sweep_status_row(installed, client):
    """Issue 22 point 3: every task of the schedule (read from it, so a new sweep is covered
    without touching this test) records its success under its own key, and afterwards
    /health/ready's sweep check holds even long past every start-up grace."""
    SweepStatus.objects.update(installed_at=timezone.now() - timedelta(days=1))
    status, body = ready(client)
    assert status == 503 and {o["sweep"] for o in body["overdue_sweeps"]} == set(installed)
    for sweep in sweeps():
        before = dict(SweepStatus.objects.values_list("name", "last_success_at"))
        run_sweep(sweep)
        after = dict(SweepStatus.objects.values_list("name", "last_success_at"))
        assert before[sweep.key] is None and after[sweep.key] is not None, sweep.task
        assert {k for k in after if after[k] != before.get(k)} == {sweep.key}, sweep.task
    status, body = ready(client)
    assert status == 200, body
    assert body["checks"]["sweeps"] is True and "overdue_sweeps" not in body


def test_health_ready__the_factor_is_a_setting(installed, client, settings):
    SweepStatus.objects.update(last_success_at=timezone.now())
    backdate("publish_outbox", 5 * installed["publish_outbox"] + 1)
    assert ready(client)[0] == 200
    settings.QUIRE = {**settings.QUIRE, "SWEEP_OVERDUE_FACTOR": 5}
    assert ready(client)[0] == 503


def test_metrics__last_success_timestamp_per_sweep_from_the_database(installed):
    values = scrape()
    for key in installed:
        assert ("quire_sweep_last_success_timestamp_seconds", frozenset({("sweep", key)})) in values
        assert metric(values, "quire_sweep_last_success_timestamp_seconds", sweep=key) == 0.0
    sweep_tasks.publish_outbox()
    at = SweepStatus.objects.get(name="publish_outbox").last_success_at
    values = scrape()
    got = metric(values, "quire_sweep_last_success_timestamp_seconds", sweep="publish_outbox")
    assert got == pytest.approx(at.timestamp(), abs=0.01)


def test_sweep_succeeded__adds_its_row_when_the_schedule_predates_it(client):
    assert not SweepStatus.objects.exists()
    sweep_tasks.remove_stale_work_dirs()
    row = SweepStatus.objects.get(name="remove_stale_work_dirs")
    assert row.last_success_at is not None and row.interval_s == 60.0


def test_sweeps__intervals_setting_overrides_each_named_sweep(settings):
    settings.QUIRE = {
        **settings.QUIRE,
        "SWEEP_INTERVALS_S": {"remove_orphaned_artifacts": 2.5, "apply_retention": 0.5},
    }
    intervals = {s.key: s.every_s for s in sweeps()}
    assert intervals["remove_orphaned_artifacts"] == 2.5
    assert intervals["apply_retention"] == 0.5
    assert intervals["remove_stale_work_dirs"] == 60.0  # not named: its own interval


def test_sweeps__intervals_setting_naming_no_sweep_is_refused(settings):
    from django.core.exceptions import ImproperlyConfigured

    settings.QUIRE = {**settings.QUIRE, "SWEEP_INTERVALS_S": {"remove_orphans": 5.0}}
    with pytest.raises(ImproperlyConfigured, match="remove_orphans"):
        sweeps()


def test_install_beat_schedule__writes_the_overridden_intervals(settings):
    from django_celery_beat.models import PeriodicTask

    keys = [s.key for s in sweeps()]
    settings.QUIRE = {**settings.QUIRE, "SWEEP_INTERVALS_S": dict.fromkeys(keys, 0.25)}
    call_command("install_beat_schedule", stdout=io.StringIO())
    assert set(SweepStatus.objects.values_list("interval_s", flat=True)) == {0.25}
    tasks = PeriodicTask.objects.filter(name__startswith="quire: ")
    assert tasks.count() == len(keys)
    assert {(t.interval.every, t.interval.period) for t in tasks} == {(250_000, "microseconds")}
