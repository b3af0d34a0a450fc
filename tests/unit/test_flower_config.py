"""deploy/flower/flowerconfig.py caps Flower's event-capture reconnect delay (Flower doubles it
without bound: after a long broker outage it would show nothing for many minutes)."""

from __future__ import annotations

import itertools
import runpy
from pathlib import Path

import pytest

CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "flower" / "flowerconfig.py"


@pytest.fixture
def flower_config(monkeypatch: pytest.MonkeyPatch) -> dict:
    monkeypatch.setenv("FLOWER_BASIC_AUTH", "operator:secret")
    monkeypatch.setenv("FLOWER_BROKER_API", "http://monitor:pw@127.0.0.1:15672/api/")
    monkeypatch.setenv("QUIRE_FLOWER_RECONNECT_MAX_S", "5")
    from flower import events

    monkeypatch.setattr(events.Events, "run", events.Events.run)  # restored afterwards
    return runpy.run_path(str(CONFIG))


def test_reconnect_delays__double_up_to_the_cap(flower_config: dict) -> None:
    delays = flower_config["_reconnect_delays"](5.0)
    assert list(itertools.islice(delays, 7)) == [2, 4, 5, 5, 5, 5, 5]


def test_flower_events_run__is_the_capped_capture(flower_config: dict) -> None:
    from flower import events

    assert getattr(events.Events.run, "__quire_cap__", None) == 5.0


class _Stop(Exception):
    pass


def test_flower_event_capture__waits_at_most_the_cap_between_reconnects(
    flower_config: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    import time

    from flower import events

    class Unreachable:
        """A Celery app whose broker refuses every connection."""

        def connection(self):  # type: ignore[no-untyped-def]
            raise ConnectionRefusedError("broker down")

    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        if len(slept) == 8:
            raise _Stop

    monkeypatch.setattr(time, "sleep", sleep)
    capture = type("Capture", (), {"capp": Unreachable(), "on_event": lambda self, e: None})()
    with pytest.raises(_Stop):
        events.Events.run(capture)
    assert slept == [2, 4, 5, 5, 5, 5, 5, 5]
