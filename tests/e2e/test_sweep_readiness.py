"""Readiness tells the truth (issue 22 point 3, docs/OPERABILITY.md "Sweep health"): with every
sweep's interval shortened (``QUIRE_SWEEP_INTERVALS_S``, installed as the ``release`` step
installs it), real ``beat`` and ``sweeper`` processes run every sweep of the schedule, each
records its success, and once every overdue threshold has passed the real ``web`` process still
answers ``/health/ready`` 200. A sweep that never records a success (as
``remove_orphaned_artifacts`` once did: 503 about 101 minutes after every release with the
default intervals) shows up here within seconds.
"""

from __future__ import annotations

import io
import time

from django.core.management import call_command
from django.db import connection

from beat_schedules.schedule import sweeps
from conversion_jobs.models import SweepStatus
from tests.e2e import harness
from tests.e2e.conftest import role_env
from tests.e2e.webproc import start_web

#: every sweep's interval in this test; with the default factor (10) a sweep that stops is
#: overdue 10 s after its last success, and one that never succeeds GRACE_S later
INTERVAL_S = 1.0
GRACE_S = 2.0


def _db_seconds_since_install() -> float:
    """Seconds since the newest install, by the database's clock (as readiness counts)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT EXTRACT(EPOCH FROM now() - max(installed_at)) FROM sweep_status")
        return float(cursor.fetchone()[0])


def test_health_ready__still_200_once_every_sweep_ran_and_every_threshold_passed(
    cluster, start, settings
):
    keys = [s.key for s in sweeps()]  # the schedule itself: a new sweep is covered as well
    settings.QUIRE = {**settings.QUIRE, "SWEEP_INTERVALS_S": dict.fromkeys(keys, INTERVAL_S)}
    overrides = ",".join(f"{key}={INTERVAL_S:g}" for key in keys)
    env = {"QUIRE_SWEEP_INTERVALS_S": overrides, "QUIRE_SWEEP_STARTUP_GRACE_S": f"{GRACE_S:g}"}
    # the release step, with the shortened intervals (beat's tables and sweep_status rows)
    call_command("install_beat_schedule", stdout=io.StringIO())
    assert dict(SweepStatus.objects.values_list("name", "interval_s")) == dict.fromkeys(
        keys, INTERVAL_S
    )
    factor = float(settings.QUIRE["SWEEP_OVERDUE_FACTOR"])
    threshold_s = factor * INTERVAL_S + GRACE_S  # a sweep with no success is overdue past this

    start("sweeper", **env)
    start("beat", **env)
    web = start_web(cluster, **role_env("web"), **env)

    def never_succeeded() -> list[str]:
        return sorted(
            SweepStatus.objects.filter(last_success_at=None).values_list("name", flat=True)
        )

    try:
        harness.wait_until(
            lambda: not never_succeeded(),
            timeout=threshold_s + 10,
            what="every scheduled sweep to record a success",
        )
    except AssertionError as exc:
        raise AssertionError(f"{exc}; never succeeded: {never_succeeded()}") from None
    # Past every threshold (never-succeeded and since-last-success alike), by the DB's clock.
    time.sleep(max(0.0, threshold_s + 1 - _db_seconds_since_install()))
    assert _db_seconds_since_install() > threshold_s
    for _ in range(3):
        response = web.ready()
        body = response.json()
        assert response.status_code == 200, body
        assert body["checks"]["sweeps"] is True and "overdue_sweeps" not in body, body
        time.sleep(0.5)
