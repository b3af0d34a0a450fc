"""The child process boundary: faults, timeouts, stop requests, crashes, group kills."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from convhelpers import Stopwatch, alive, child_area, never, prepare, processes_mentioning

from conversion_jobs.converters import (
    TEST_FAULTS_ENV,
    ConversionStopped,
    ConversionTimeout,
    ConverterCrashed,
    InvalidInput,
    Limits,
    PageRequest,
    PrepareRequest,
    process_group_members,
    run_isolated,
    sandbox,
)
from conversion_jobs.converters.isolation import host_pid
from tests import testdocs

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def pdf_job(tmp_path):
    source = testdocs.make_pdf(tmp_path / "doc.pdf", pages=10)
    converter, prepared = prepare(source, tmp_path, output="text")
    return converter, prepared


def _page(pdf_job, tmp_path, page, *, fault=None, limits=None, should_stop=never):
    converter, prepared = pdf_job
    options = {"dpi": 72, "pages": None, "allow_partial": True}
    if fault:
        options["_test_fault"] = fault
    return converter.convert_page(
        PageRequest(
            prepared=prepared,
            output="text",
            options=options,
            dest_dir=tmp_path / "out",
            limits=limits or Limits(page_timeout_s=10),
            should_stop=should_stop,
        ),
        page=page,
    )


def _hang_record(tmp_path, page):
    record = json.loads((tmp_path / "out" / f"fault-hang-{page}.json").read_text())
    assert record["pgid"] and all(record["pids"])  # translated to our pids (host_pid)
    return record


def test_probe__own_group_limits_no_django_no_secrets(tmp_path, monkeypatch):
    monkeypatch.setenv("QUIRE_SECRET_FOR_TEST", "hunter2")
    limits = Limits(memory_bytes=700_000_000)
    info = run_isolated(op="probe", args={}, limits=limits, timeout_s=10, scratch_dir=tmp_path)
    assert info["pgid"] == info["pid"] == info["sid"] != os.getpgid(0)
    assert info["rlimit_as"] == 700_000_000
    assert info["rlimit_core"] == 0
    assert info["django_loaded"] is False
    assert "QUIRE_SECRET_FOR_TEST" not in info["environ"]
    assert list(tmp_path.iterdir()) == []
    assert process_group_members(info["pgid"]) == []


def test_fault_fail__only_that_page_fails_with_invalid_input(tmp_path, pdf_job, faults_enabled):
    fault = {"page": 7, "kind": "fail"}
    with pytest.raises(InvalidInput) as info:
        _page(pdf_job, tmp_path, 7, fault=fault)
    assert info.value.code == "invalid_input"
    assert not info.value.retryable
    artifact = _page(pdf_job, tmp_path, 6, fault=fault)
    assert artifact.path.read_text() == "Page 6 of the Quire test document"


def test_fault__ignored_without_env(tmp_path, pdf_job, monkeypatch):
    monkeypatch.delenv(TEST_FAULTS_ENV, raising=False)
    artifact = _page(pdf_job, tmp_path, 7, fault={"page": 7, "kind": "fail"})
    assert artifact.path.is_file()


def test_fault_slow__every_page_is_delayed(tmp_path, pdf_job, faults_enabled):
    with Stopwatch() as watch:
        _page(pdf_job, tmp_path, 1, fault={"kind": "slow", "seconds": 0.6})
        _page(pdf_job, tmp_path, 2, fault={"kind": "slow", "seconds": 0.6})
    assert watch.elapsed >= 1.2


def test_fault_hang__killed_at_timeout_with_its_grandchild(tmp_path, pdf_job, faults_enabled):
    limits = Limits(page_timeout_s=1.5)
    with Stopwatch() as watch, pytest.raises(ConversionTimeout) as info:
        _page(pdf_job, tmp_path, 3, fault={"page": 3, "kind": "hang"}, limits=limits)
    assert 1.5 <= watch.elapsed < 4
    assert info.value.code == "conversion_timeout"
    record = _hang_record(tmp_path, 3)
    assert len(record["pids"]) == 2  # the child and the grandchild it spawned
    assert process_group_members(record["pgid"]) == []
    assert not any(alive(pid) for pid in record["pids"])
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["fault-hang-3.json"]


def test_should_stop__kills_group_and_raises_stopped(tmp_path, pdf_job, faults_enabled):
    asked = time.monotonic() + 0.8
    with Stopwatch() as watch, pytest.raises(ConversionStopped) as info:
        _page(
            pdf_job,
            tmp_path,
            1,
            fault={"kind": "hang"},
            should_stop=lambda: time.monotonic() > asked,
        )
    assert watch.elapsed < 2.5
    assert info.value.code == "conversion_stopped"
    record = _hang_record(tmp_path, 1)
    assert process_group_members(record["pgid"]) == []
    assert not any(alive(pid) for pid in record["pids"])


def test_fault_segv__converter_crashed_retryable(tmp_path, pdf_job, faults_enabled):
    with pytest.raises(ConverterCrashed) as info:
        _page(pdf_job, tmp_path, 2, fault={"page": 2, "kind": "segv"})
    assert info.value.retryable
    assert "SIGSEGV" in info.value.detail


def test_fault_oom__rlimit_as_gives_converter_crashed(tmp_path, pdf_job, faults_enabled):
    # Documented choice: running out of memory under RLIMIT_AS is converter_crashed (retryable).
    limits = Limits(page_timeout_s=20, memory_bytes=400_000_000)
    with Stopwatch() as watch, pytest.raises(ConverterCrashed) as info:
        _page(pdf_job, tmp_path, 2, fault={"kind": "oom"}, limits=limits)
    assert "out of memory" in info.value.detail
    assert watch.elapsed < 10


def test_worker_killed__child_group_dies_with_it(tmp_path, faults_enabled):
    """A worker killed by SIGKILL leaves no converter behind: its fork server sees the socket
    close and exits, the child's watchdog sees its parent gone and kills its group."""
    source = testdocs.make_pdf(tmp_path / "doc.pdf", pages=2)
    script = f"""
from pathlib import Path
from conversion_jobs.converters import Limits, PageRequest, Prepared, converter_for
converter = converter_for("application/pdf", "text")
prepared = Prepared(document=Path({str(source)!r}), media_type="application/pdf", page_count=2)
converter.convert_page(PageRequest(prepared=prepared, output="text",
    options={{"_test_fault": {{"kind": "hang"}}}}, dest_dir=Path({str(tmp_path / "out")!r}),
    limits=Limits(page_timeout_s=600), should_stop=lambda: False), page=1)
"""
    worker = subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=REPO,
        env={
            **os.environ,
            "PYTHONPATH": str(REPO),
            sandbox.ROOT_ENV: str(sandbox.sandbox_dirs_parent().parent),
        },
    )
    # The worker is killed before it could hand the record out: read it where the child wrote
    # it (its private directory, in the worker's sandbox when sandboxed) and translate its pids.
    pattern = (
        "*/work/.isolated-*/fault-hang-1.json"
        if sandbox.enabled()
        else "out/.isolated-*/fault-hang-1.json"
    )
    base = sandbox.sandbox_dirs_parent() if sandbox.enabled() else tmp_path
    deadline = time.monotonic() + 15
    found: list[Path] = []
    while not found and time.monotonic() < deadline:
        found = [
            p for p in base.glob(pattern) if str(worker.pid) in str(p) or not sandbox.enabled()
        ]
        time.sleep(0.05)
    record = json.loads(found[0].read_text())
    record["pids"] = [host_pid(record["pidns"], pid) for pid in record["pids"]]
    record["pgid"] = host_pid(record["pidns"], record["pgid"])
    assert record["pgid"] and all(record["pids"])
    child_stat = Path(f"/proc/{record['pids'][0]}/stat").read_bytes()
    zygote = int(child_stat[child_stat.rfind(b")") + 2 :].split()[1])  # the child's parent
    assert Path(f"/proc/{zygote}/comm").read_text().strip() == "quire-zygote"
    worker.send_signal(signal.SIGKILL)
    worker.wait()
    deadline = time.monotonic() + 3
    while (
        process_group_members(record["pgid"]) or process_group_members(zygote)
    ) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert process_group_members(record["pgid"]) == []
    assert process_group_members(zygote) == []  # the fork server ends with its worker


def test_libreoffice__stop_kills_soffice_and_its_forks(tmp_path):
    """soffice.bin runs in the child's group; stopping mid-conversion leaves nothing behind."""
    from conversion_jobs.converters import converter_for

    source = testdocs.make_docx(tmp_path / "in.docx", paragraphs=["text"] * 200)
    seen: list[int] = []

    area = str(child_area(tmp_path) / ".isolated-")

    def should_stop():
        running = processes_mentioning(area)
        if any(
            b"soffice" in Path(f"/proc/{pid}/cmdline").read_bytes() for pid in running if alive(pid)
        ):
            seen.extend(running)
            return True
        return False

    converter = converter_for(
        "application/vnd.openxmlformats-officedocument.wordprocessingml.document", "pdf"
    )
    with pytest.raises(ConversionStopped):
        converter.prepare(
            PrepareRequest(
                source=source,
                media_type="application/vnd.openxmlformats-officedocument.wordprocessingml.document",
                workdir=tmp_path,
                limits=Limits(prepare_timeout_s=60),
                should_stop=should_stop,
            )
        )
    assert seen
    assert not any(alive(pid) for pid in seen)
    assert processes_mentioning(area) == []


def test_libreoffice__timeout_leaves_no_process(tmp_path):
    from conversion_jobs.converters import converter_for
    from conversion_jobs.converters.base import DOCX

    source = testdocs.make_docx(tmp_path / "in.docx", paragraphs=["text"])
    area = str(child_area(tmp_path) / ".isolated-")
    with pytest.raises(ConversionTimeout):
        converter_for(DOCX, "text").prepare(
            PrepareRequest(
                source=source,
                media_type=DOCX,
                workdir=tmp_path,
                limits=Limits(prepare_timeout_s=0.7),
                should_stop=never,
            )
        )
    assert processes_mentioning(area) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.docx"]


def test_fork_server__a_stuck_zygote_is_replaced(tmp_path, monkeypatch):
    """A fork server that stops answering must not hang an attempt: it is killed after
    ANSWER_TIMEOUT_S and the child comes from a new one."""
    from conversion_jobs.converters import zygote

    monkeypatch.setattr(zygote, "ANSWER_TIMEOUT_S", 1.0)
    zygote.stop_zygote()
    first = zygote.zygote()
    stuck = first.pid  # the fork server itself (sandboxed, first.proc is bwrap)
    os.kill(stuck, signal.SIGSTOP)
    try:
        started = time.monotonic()
        info = run_isolated(
            op="probe", args={}, limits=Limits(), timeout_s=10, scratch_dir=tmp_path
        )
        assert time.monotonic() - started < 6
    finally:
        if first.proc.poll() is None:
            os.kill(stuck, signal.SIGCONT)
    assert first.proc.poll() is not None  # the stuck one was killed
    second = zygote.zygote()
    assert second is not first and second.alive()
    assert info["pgid"] == info["pid"] != first.proc.pid
    zygote.stop_zygote()
