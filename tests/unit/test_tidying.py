"""services/tidying.py: tasks run in order on one thread; ``tidy_wait`` is their barrier."""

from __future__ import annotations

import threading
import time

from conversion_jobs.services.tidying import tidy_later, tidy_wait


def test_tidy_wait__returns_after_every_task_handed_in_before_it() -> None:
    ran: list[int] = []
    gate = threading.Event()
    tidy_later(gate.wait)
    for n in range(3):
        tidy_later(lambda n=n: ran.append(n))
    waiter = threading.Thread(target=tidy_wait)
    waiter.start()
    time.sleep(0.2)
    assert waiter.is_alive() and ran == []
    gate.set()
    waiter.join(5)
    assert not waiter.is_alive()
    assert ran == [0, 1, 2]


def test_tidy_later__a_failing_task_is_logged_and_the_next_one_runs(caplog) -> None:
    ran: list[str] = []

    def boom() -> None:
        raise OSError("disk gone")

    tidy_later(boom)
    tidy_later(lambda: ran.append("after"))
    tidy_wait()
    assert ran == ["after"]
    assert "tidying after an attempt failed" in caplog.text


def test_tidy_wait__with_nothing_handed_in_returns_at_once() -> None:
    tidy_wait()
    started = time.monotonic()
    tidy_wait()
    assert time.monotonic() - started < 0.1
