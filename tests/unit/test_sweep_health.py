"""The staleness rule of sweeps (conversion_jobs/services/sweep_health.py): overdue past
factor x interval after the last success; factor x interval + start-up grace after the install
while there has been none."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from conversion_jobs.services.sweep_health import sweep_late_by

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def late(*, at: float, last: float | None, interval: float = 1.0) -> float:
    return sweep_late_by(
        now=T0 + timedelta(seconds=at),
        interval_s=interval,
        installed_at=T0,
        last_success_at=None if last is None else T0 + timedelta(seconds=last),
        factor=10,
        startup_grace_s=60,
    )


def test_sweep_late_by__on_time_within_factor_times_interval():
    assert late(at=100, last=95) < 0
    assert late(at=100, last=90.5) < 0


def test_sweep_late_by__overdue_past_factor_times_interval():
    assert late(at=100, last=89) == 1.0
    assert late(at=1000, last=100, interval=30) > 0  # 900 s > 10 x 30 s
    assert late(at=1000, last=800, interval=30) < 0


def test_sweep_late_by__never_succeeded_gets_the_start_up_grace_from_the_install():
    assert late(at=69, last=None) < 0  # 10 x 1 s + 60 s grace
    assert late(at=71, last=None) == 1.0


def test_sweep_late_by__the_grace_ends_with_the_first_success():
    # Succeeded once at t=1, then nothing: overdue at t=12 although the grace has not run out.
    assert late(at=12, last=1) > 0


def test_env_seconds_by_name__parses_the_sweep_interval_overrides(monkeypatch):
    from project.settings import env_seconds_by_name

    monkeypatch.setenv("X_INTERVALS", " apply_retention=60, remove_orphaned_artifacts=0.5 ,")
    assert env_seconds_by_name("X_INTERVALS") == {
        "apply_retention": 60.0,
        "remove_orphaned_artifacts": 0.5,
    }
    monkeypatch.delenv("X_INTERVALS")
    assert env_seconds_by_name("X_INTERVALS") == {}


def test_env_seconds_by_name__refuses_what_is_not_a_positive_number_of_seconds(monkeypatch):
    import pytest
    from django.core.exceptions import ImproperlyConfigured

    from project.settings import env_seconds_by_name

    for bad in ("apply_retention", "apply_retention=", "=5", "a=0", "a=-1", "a=soon", "a=inf"):
        monkeypatch.setenv("X_INTERVALS", bad)
        with pytest.raises(ImproperlyConfigured, match="X_INTERVALS"):
            env_seconds_by_name("X_INTERVALS")
