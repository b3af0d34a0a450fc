"""The slot clock behind a unit's fair slice (ADR 0021, "A range yields"): consecutive units of
one tenant in one slot share it; another tenant's unit, or a slot idle for a second, starts it
again."""

from __future__ import annotations

from typing import Any

import pytest

from conversion_jobs.services import runner


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(settings: Any, monkeypatch: pytest.MonkeyPatch) -> Clock:
    settings.QUIRE = {**settings.QUIRE, "FAIR_SLICE_S": 2.0, "FAIR_CHECK_S": 0.1}
    monkeypatch.setattr(runner.fair, "enabled", lambda: True)
    fake = Clock()
    monkeypatch.setattr(runner.time, "monotonic", fake)
    runner._slot.__dict__.clear()
    return fake


def run_unit(clock: Clock, tenant: str, seconds: float) -> runner._Slice:
    with runner._slot_held(tenant) as slice_:
        clock.now += seconds
        return slice_


def test_one_unit__due_once_its_slice_is_used_then_every_check_interval(clock: Clock) -> None:
    with runner._slot_held("a") as slice_:
        clock.now += 1.9
        assert not slice_.due()
        clock.now += 0.2
        assert slice_.due()
        assert not slice_.due()  # asked a moment ago
        clock.now += 0.1
        assert slice_.due()


def test_consecutive_units_of_one_tenant__share_the_clock(clock: Clock) -> None:
    run_unit(clock, "a", 1.5)
    clock.now += 0.01  # the next range's message
    with runner._slot_held("a") as slice_:
        clock.now += 0.5  # 2.01 s since the slot began running a's work
        assert slice_.due()


def test_another_tenants_unit__starts_the_clock_again(clock: Clock) -> None:
    run_unit(clock, "a", 1.5)
    run_unit(clock, "b", 0.1)
    with runner._slot_held("a") as slice_:
        clock.now += 1.0
        assert not slice_.due()


def test_an_idle_slot__starts_the_clock_again(clock: Clock) -> None:
    run_unit(clock, "a", 1.5)
    clock.now += runner.SLOT_IDLE_RESET_S
    with runner._slot_held("a") as slice_:
        clock.now += 1.0
        assert not slice_.due()


def test_slice_zero__never_due(clock: Clock, settings: Any) -> None:
    settings.QUIRE = {**settings.QUIRE, "FAIR_SLICE_S": 0.0}
    with runner._slot_held("a") as slice_:
        clock.now += 100
        assert not slice_.due()
