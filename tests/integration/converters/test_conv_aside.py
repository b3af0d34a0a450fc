"""Stepping aside (ADR 0022): a long LibreOffice conversion hands its slot back and goes on at
the lowest CPU priority, its limit then CPU time. Real process groups and the real LibreOffice;
the slot's hand-back itself (a fenced statement) is the store's (test_statements.py) and the
whole path's with real workers (tests/e2e/test_step_aside_e2e.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from conversion_jobs.converters import ConversionStarved, ConversionTimeout, engines
from conversion_jobs.converters.aside import AsideSettings, ConversionClock
from conversion_jobs.converters.base import (
    DOCX,
    Limits,
    PrepareRequest,
    StepAside,
    process_group_cpu_s,
    process_group_members,
)
from conversion_jobs.converters.registry import OfficeConverter
from tests import testdocs

SPIN = "while True: pass"
SLEEP = "import time\ntime.sleep(120)"


@dataclass
class Group:
    leader: int  # = the process group (stays awake: never paused)
    member: int  # runs the code


def _state(pid: int) -> str:
    stat = Path(f"/proc/{pid}/stat").read_bytes()
    return stat[stat.rfind(b")") + 2 :].split()[0].decode()


@pytest.fixture
def group() -> Iterator[Callable[[str], Group]]:
    """``group(code)``: a process group whose leader (a session of its own, as a converter
    child) sleeps and whose other member runs ``code``, as an engine host and its soffice.
    Killed after the test."""
    procs: list[subprocess.Popen] = []

    def run(code: str) -> Group:
        leader_code = (
            "import subprocess, sys, time\n"
            f"p = subprocess.Popen([sys.executable, '-c', {code!r}])\n"
            "print(p.pid, flush=True)\n"
            "time.sleep(120)\n"
        )
        proc = subprocess.Popen(
            [sys.executable, "-c", leader_code], stdout=subprocess.PIPE, start_new_session=True
        )
        procs.append(proc)
        assert proc.stdout is not None
        member = int(proc.stdout.readline())
        return Group(leader=proc.pid, member=member)

    yield run
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


class Asks:
    """The worker's side: ``ask`` answers ``grant`` and counts the questions, ``others_wait``
    answers what the test sets."""

    def __init__(self, grant: bool, waiting: bool = False) -> None:
        self.grant, self.calls, self.waiting = grant, 0, waiting

    def __call__(self) -> bool:
        self.calls += 1
        return self.grant

    def aside(self) -> StepAside:
        return StepAside(ask=self, others_wait=lambda: self.waiting)


def _request(limit_s: float, asks: Asks | None, tmp_path: Path) -> PrepareRequest:
    return PrepareRequest(
        source=tmp_path / "x",
        media_type=DOCX,
        workdir=tmp_path,
        limits=Limits(prepare_timeout_s=limit_s),
        should_stop=lambda: False,
        step_aside=asks.aside() if asks is not None else None,
    )


def _poll_until(
    clock: ConversionClock, error: type[Exception], *, started: float, within_s: float
) -> tuple[float, str]:
    """Poll as a waiting call does until the clock raises ``error``: the wall seconds since
    ``started`` (taken before the call's ``begin``), and the error's message."""
    with pytest.raises(error) as raised:
        while time.monotonic() - started < within_s:
            assert clock.should_stop() is False
            time.sleep(0.02)
    return time.monotonic() - started, str(raised.value)


def test_group_cpu__counts_what_a_member_burns(group):
    g = group(SPIN)
    time.sleep(0.5)
    assert sorted(process_group_members(g.leader)) == sorted([g.leader, g.member])
    assert 0.2 <= process_group_cpu_s(g.leader) <= 5


def test_clock__aside_moves_the_group_to_sched_idle_and_limits_its_cpu(group, tmp_path):
    g = group(SPIN)
    asks = Asks(grant=True)
    clock = ConversionClock(
        _request(0.4, asks, tmp_path),
        AsideSettings(after_s=0.2, wall_factor=100),
        pgid=lambda: g.leader,
    )
    cpu_before, started = process_group_cpu_s(g.leader), time.monotonic()
    assert clock.begin() >= 40.0  # the wall clock cap; the limit is kept here
    took, message = _poll_until(clock, ConversionTimeout, started=started, within_s=40)
    assert asks.calls == 1 and clock.aside and not clock.paused
    assert os.sched_getscheduler(g.member) == os.SCHED_IDLE
    assert process_group_cpu_s(g.leader) - cpu_before >= 0.4
    assert "CPU time" in message and took < 40


def test_clock__aside_paused_while_others_wait_resumed_when_none_do(group, tmp_path):
    g = group(SPIN)
    asks = Asks(grant=True, waiting=True)
    clock = ConversionClock(
        _request(30, asks, tmp_path),
        AsideSettings(after_s=0.1, check_s=0.1),
        pgid=lambda: g.leader,
    )
    clock.begin()
    harness_poll(clock, until=lambda: clock.paused)
    assert _state(g.member) == "T" and _state(g.leader) != "T"  # the leader stays awake
    paused_cpu = process_group_cpu_s(g.leader)
    harness_poll(clock, for_s=0.5)
    assert process_group_cpu_s(g.leader) - paused_cpu < 0.05  # paused: no CPU
    asks.waiting = False
    harness_poll(clock, until=lambda: not clock.paused)
    assert _state(g.member) != "T"
    asks.waiting = True
    harness_poll(clock, until=lambda: clock.paused)
    clock.end()  # however the preparation ends, the group runs again
    assert not clock.paused and _state(g.member) != "T"


def test_clock__aside_a_starved_conversion_ends_starved_at_the_cap(group, tmp_path):
    g = group(SPIN)  # paused while others wait: starved
    clock = ConversionClock(
        _request(0.3, Asks(grant=True, waiting=True), tmp_path),
        AsideSettings(after_s=0.1, wall_factor=4),
        pgid=lambda: g.leader,
    )
    started = time.monotonic()
    assert 1.2 < clock.begin() < 2.5  # just past the cap: the clock ends it, as starved
    took, _ = _poll_until(clock, ConversionStarved, started=started, within_s=5)
    assert clock.aside and clock.paused and 1.2 <= took < 2.5  # past its limit, not timed out
    clock.end()


def test_clock__aside_a_hang_ends_timed_out_at_the_cap(group, tmp_path):
    g = group(SLEEP)  # uses no CPU, nothing waits: it hangs
    clock = ConversionClock(
        _request(0.3, Asks(grant=True), tmp_path),
        AsideSettings(after_s=0.1, wall_factor=4),
        pgid=lambda: g.leader,
    )
    started = time.monotonic()
    clock.begin()
    took, message = _poll_until(clock, ConversionTimeout, started=started, within_s=5)
    assert clock.aside and not clock.paused and 1.2 <= took < 2.5 and "run time" in message


def test_clock__refused_keeps_the_wall_limit_and_asks_again(group, tmp_path):
    g = group(SPIN)
    asks = Asks(grant=False)
    clock = ConversionClock(
        _request(0.6, asks, tmp_path),
        AsideSettings(after_s=0.1, wall_factor=4, retry_s=0.1),
        pgid=lambda: g.leader,
    )
    started = time.monotonic()
    clock.begin()
    took, message = _poll_until(clock, ConversionTimeout, started=started, within_s=5)
    assert 0.6 <= took < 1.5 and "within 0.6 s" in message
    assert asks.calls >= 3 and not clock.aside
    assert os.sched_getscheduler(g.member) == os.SCHED_OTHER


def test_clock__without_step_aside_the_call_keeps_its_own_limit(group, tmp_path):
    g = group(SPIN)
    for settings, asks in ((AsideSettings(after_s=0.1), None), (AsideSettings(), Asks(True))):
        clock = ConversionClock(_request(0.2, asks, tmp_path), settings, pgid=lambda: g.leader)
        assert clock.begin() == 0.2  # the call's timeout is the limit
        time.sleep(0.3)
        assert clock.should_stop() is False
    assert os.sched_getscheduler(g.member) == os.SCHED_OTHER


def harness_poll(
    clock: ConversionClock, *, until: Callable[[], bool] | None = None, for_s: float = 5.0
) -> None:
    """Poll the clock as a waiting call does, until ``until()`` (failing after 5 s) or for
    ``for_s`` seconds."""
    deadline = time.monotonic() + for_s
    while until is None or not until():
        if time.monotonic() >= deadline:
            assert until is None, "the clock did not get there"
            return
        assert clock.should_stop() is False
        time.sleep(0.02)


# --- with the real LibreOffice -------------------------------------------------------------------


@pytest.fixture
def aside_engine(tmp_path):
    root = tmp_path / "engines"
    engines.configure(
        engines.EngineSettings(
            scratch_dir=root, aside=AsideSettings(after_s=0.3, wall_factor=3, retry_s=0.2)
        )
    )
    yield root
    engines.stop("test")
    engines.configure(engines.EngineSettings())


def _prepare(source: Path, workdir: Path, *, limit_s: float, asks: Asks, **kwargs):
    workdir.mkdir(parents=True, exist_ok=True)
    return OfficeConverter().prepare(
        PrepareRequest(
            source=source,
            media_type=DOCX,
            workdir=workdir,
            limits=Limits(page_timeout_s=30, prepare_timeout_s=limit_s),
            should_stop=lambda: False,
            step_aside=asks.aside(),
            **kwargs,
        )
    )


def _idle_threads(pgid: int) -> tuple[int, int]:
    """(threads of the group, those under SCHED_IDLE)."""
    total = idle = 0
    for pid in process_group_members(pgid):
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                policy = os.sched_getscheduler(int(tid))
            except OSError:
                continue
            total += 1
            idle += policy == os.SCHED_IDLE
    return total, idle


def _ppid(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_bytes()
    return int(stat[stat.rfind(b")") + 2 :].split()[1])


def _soffice_group() -> int | None:
    """The process group of a soffice descended from this process (the engine's lock is held
    while it converts: ``engines.host_pgid`` would wait for the end)."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if b"soffice" not in Path(f"/proc/{entry.name}/comm").read_bytes():
                continue
            pid = int(entry.name)
            while pid > 1:
                pid = _ppid(pid)
                if pid == os.getpid():
                    return os.getpgid(int(entry.name))
        except (OSError, ValueError):
            continue
    return None


def _long_docx(path: Path, pages: int) -> Path:
    words = [f"Paragraph {i} " + "lorem ipsum dolor " * 40 for i in range(pages)]
    return testdocs.make_docx(path, paragraphs=words, page_break_after_each=True)


def test_engine__a_long_conversion_steps_aside_converts_and_its_engine_is_recycled(
    tmp_path, aside_engine
):
    source = _long_docx(tmp_path / "long.docx", 400)
    seen: list[tuple[int, int]] = []
    done = threading.Event()

    def watch() -> None:  # the engine's threads, from outside, while it converts
        while not done.wait(0.1):
            pgid = _soffice_group()
            if pgid is not None:
                seen.append(_idle_threads(pgid))

    watcher = threading.Thread(target=watch)
    watcher.start()
    asks = Asks(grant=True)
    try:
        prepared = _prepare(source, tmp_path / "w", limit_s=120, asks=asks)
    finally:
        done.set()
        watcher.join()
    assert prepared.page_count >= 400 and asks.calls == 1
    assert any(total > 3 and idle == total for total, idle in seen), seen[-5:]
    assert engines.host_pgid() is None  # recycled: its threads stay SCHED_IDLE otherwise


def test_engine__aside_a_hung_engine_ends_at_the_wall_clock_cap(
    tmp_path, aside_engine, faults_enabled
):
    source = testdocs.make_docx(tmp_path / "a.docx", paragraphs=["Hang here"])
    asks = Asks(grant=True)
    _prepare(source, tmp_path / "w0", limit_s=30, asks=Asks(grant=False))  # a warm engine
    pgid = engines.host_pgid()
    started = time.monotonic()
    with pytest.raises(ConversionTimeout):  # stopped: no CPU, unpaused (nothing waits): hung
        _prepare(
            source,
            tmp_path / "w1",
            limit_s=2,
            asks=asks,
            options={"_test_fault": {"kind": "hang"}},
        )
    took = time.monotonic() - started
    assert asks.calls == 1 and 6 <= took < 6 + 10  # the cap, not the 2 s limit
    assert process_group_members(pgid) == [] and engines.host_pgid() is None
