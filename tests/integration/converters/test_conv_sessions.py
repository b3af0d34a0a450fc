"""One long-lived converter child per document and attempt: reuse, respawn, release, spare."""

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from convhelpers import alive, never, prepare, private_dirs

from conversion_jobs.converters import (
    ConversionTimeout,
    ConverterCrashed,
    InvalidInput,
    Limits,
    PageRequest,
    process_group_members,
    release,
    sessions,
)
from tests import testdocs

LIMITS = Limits(page_timeout_s=10, prepare_timeout_s=20)


pytestmark = pytest.mark.usefixtures("no_children_left_behind")


@pytest.fixture
def doc(tmp_path):
    source = testdocs.make_pdf(tmp_path / "doc.pdf", pages=40)
    converter, prepared = prepare(source, tmp_path / "attempt", output="text", limits=LIMITS)
    return converter, prepared


def _convert(doc, tmp_path, page, *, output="text", fault=None, limits=LIMITS):
    converter, prepared = doc
    options = {"dpi": 72}
    if fault:
        options["_test_fault"] = fault
    return converter.convert_page(
        PageRequest(
            prepared=prepared,
            output=output,
            options=options,
            dest_dir=tmp_path / "attempt",
            limits=limits,
            should_stop=never,
        ),
        page=page,
    )


def _child(doc, tmp_path, limits=LIMITS):
    """The calling thread's session child for the document (a new one if there is none)."""
    _converter, prepared = doc
    return sessions.session_for(
        document=prepared.document,
        scratch_dir=tmp_path / "attempt",
        limits=limits,
    ).proc.pid


def _private_dirs(tmp_path):
    return private_dirs(tmp_path / "attempt")


def _written_bytes(pid):
    io = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
    return int(io["wchar"])


def test_session__prepare_and_pages_share_one_child(tmp_path, doc):
    pid = _child(doc, tmp_path)
    before = _written_bytes(pid)
    sizes = 0
    for page in (1, 2, 3):
        artifact = _convert(doc, tmp_path, page)
        assert artifact.path.read_text() == f"Page {page} of the Quire test document"
        sizes += artifact.path.stat().st_size
    assert _child(doc, tmp_path) == pid
    assert _written_bytes(pid) - before > sizes  # this child wrote the pages (and its answers)
    assert alive(pid)
    [private] = _private_dirs(tmp_path)
    assert os.readlink(f"/proc/{pid}/cwd") == str(private)


def test_session__child_is_isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("QUIRE_SECRET_FOR_TEST", "hunter2")
    sessions.warm()  # the spare is spawned now; prepare makes it the document's child
    limits = Limits(memory_bytes=700_000_000)
    source = testdocs.make_pdf(tmp_path / "doc.pdf", pages=2)
    _converter, prepared = prepare(source, tmp_path / "attempt", output="text", limits=limits)
    pid = _child((None, prepared), tmp_path, limits)
    assert os.getpgid(pid) == os.getsid(pid) == pid != os.getpgid(0)
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    assert not any(b"QUIRE_SECRET_FOR_TEST" in entry for entry in environ)
    limits_text = Path(f"/proc/{pid}/limits").read_text()
    assert any(
        line.startswith("Max address space") and "700000000" in line
        for line in limits_text.splitlines()
    )


def test_session__structured_error_keeps_the_child(tmp_path, doc, faults_enabled):
    pid = _child(doc, tmp_path)
    with pytest.raises(InvalidInput):
        _convert(doc, tmp_path, 7, fault={"kind": "fail", "page": 7})
    assert _convert(doc, tmp_path, 8).path.is_file()
    assert _child(doc, tmp_path) == pid


def test_session__crash_kills_group_and_next_page_gets_a_fresh_child(tmp_path, doc, faults_enabled):
    first = _child(doc, tmp_path)
    [first_private] = _private_dirs(tmp_path)
    with pytest.raises(ConverterCrashed):
        _convert(doc, tmp_path, 2, fault={"kind": "segv", "page": 2})
    assert process_group_members(first) == []
    assert not first_private.exists()
    assert not (tmp_path / "attempt" / "page-0002.txt").exists()
    artifact = _convert(doc, tmp_path, 3, fault={"kind": "segv", "page": 2})
    assert artifact.path.read_text() == "Page 3 of the Quire test document"
    second = _child(doc, tmp_path)
    assert second != first
    assert alive(second)


def test_session__timeout_then_the_next_page_converts(tmp_path, doc, faults_enabled):
    limits = Limits(page_timeout_s=1.5, prepare_timeout_s=20)
    with pytest.raises(ConversionTimeout):
        _convert(doc, tmp_path, 3, fault={"kind": "hang", "page": 3}, limits=limits)
    artifact = _convert(doc, tmp_path, 4, fault={"kind": "hang", "page": 3}, limits=limits)
    assert artifact.path.read_text() == "Page 4 of the Quire test document"


def test_release__kills_the_child_removes_its_dir_and_leaves_a_spare(tmp_path, doc):
    _converter, prepared = doc
    pid = _child(doc, tmp_path)
    _convert(doc, tmp_path, 1)
    release(prepared)
    assert process_group_members(pid) == []
    assert _private_dirs(tmp_path) == []
    spare = sessions._spare
    assert spare is not None and alive(spare.proc.pid)
    # The next attempt (fresh workdir) is served by the spare, never by the released child.
    _c, again = prepare(prepared.document, tmp_path / "attempt", output="text", limits=LIMITS)
    assert _child((None, again), tmp_path) == spare.proc.pid


def test_prepare__a_new_attempt_never_reuses_the_previous_child(tmp_path, doc):
    _converter, prepared = doc
    first = _child(doc, tmp_path)
    _c, again = prepare(prepared.document, tmp_path / "attempt", output="text", limits=LIMITS)
    assert again == prepared
    second = _child((None, again), tmp_path)
    assert second != first
    assert process_group_members(first) == []


def test_session__each_thread_has_its_own_child(tmp_path, doc):
    mine = _child(doc, tmp_path)
    theirs = []

    def work():
        _convert(doc, tmp_path, 5)
        theirs.append(_child(doc, tmp_path))
        release()

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert theirs and theirs[0] != mine
    assert process_group_members(theirs[0]) == []
    assert alive(mine)


def test_session__png_pages_keep_the_child_memory_flat(tmp_path, doc):
    def peak_kb(pid):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
        raise AssertionError("no VmHWM")

    pid = _child(doc, tmp_path)
    for page in range(1, 6):
        _convert(doc, tmp_path, page, output="png")
    early = peak_kb(pid)
    for page in range(6, 31):
        _convert(doc, tmp_path, page, output="png")
    assert _child(doc, tmp_path) == pid
    assert peak_kb(pid) - early < 15_000


def test_fork_server_killed__its_child_ends_itself_and_the_next_page_gets_a_new_one(tmp_path, doc):
    from conversion_jobs.converters import zygote

    pid = _child(doc, tmp_path)
    server = zygote.zygote()
    os.kill(server.pid, signal.SIGKILL)  # the fork server itself (sandboxed, server.proc is bwrap)
    server.proc.wait()
    deadline = time.monotonic() + 3
    # Sandboxed, the whole pid namespace dies with it; otherwise its watchdog sees it gone.
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(pid)
    artifact = _convert(doc, tmp_path, 2)
    assert artifact.path.read_text() == "Page 2 of the Quire test document"
    assert zygote.zygote() is not server
    assert _child(doc, tmp_path) != pid


def test_one_page_attempt__two_requests_and_the_setup_rides_on_the_first(tmp_path, monkeypatch):
    """A fresh child's setup (directory, limits) travels with the attempt's first request (ADR
    0017, session 5): a one-page text attempt writes the child two requests, prepare and the
    page, and the first one already runs in the private directory, under the limits."""
    from conversion_jobs.converters.isolation import ChildSession

    sent: list[bytes] = []
    real_send = ChildSession._send

    def counting_send(self, data: bytes) -> None:
        sent.append(data)
        real_send(self, data)

    monkeypatch.setattr(ChildSession, "_send", counting_send)
    source = testdocs.make_pdf(tmp_path / "doc.pdf", pages=1, text_of=lambda n: "one page")
    converter, prepared = prepare(source, tmp_path / "attempt", output="text", limits=LIMITS)
    artifact = converter.convert_page(
        PageRequest(
            prepared=prepared,
            output="text",
            options={},
            dest_dir=tmp_path / "attempt",
            limits=LIMITS,
            should_stop=never,
            inline_max_bytes=1024,
        ),
        page=1,
    )
    assert artifact.content == b"one page"
    requests = [json.loads(line) for line in sent]
    assert [r["op"] for r in requests] == ["pdf_prepare", "pages"]
    assert requests[0]["setup"]["limits"]["memory_bytes"] == LIMITS.memory_bytes
    assert "setup" not in requests[1]
    session = sessions.session_for(
        document=prepared.document, scratch_dir=tmp_path / "attempt", limits=LIMITS
    )
    probe = session.call("probe", {}, timeout_s=10, should_stop=never)
    assert probe["cwd"] == str(session.private) == requests[0]["setup"]["directory"]
    assert probe["rlimit_as"] == LIMITS.memory_bytes
    # The document and nothing else sits directly in the private directory (no in/ or out/).
    assert [p.name for p in session.private.iterdir()] == [session.document.name]
    release()


def test_setup__a_request_before_any_setup_is_refused_by_the_child(tmp_path):
    """Without a setup the child has no directory and no limits: its first operation must not
    run (it ends the session, reported as a crash)."""
    from conversion_jobs.converters.isolation import ChildSession

    with ChildSession() as session:
        with pytest.raises(ConverterCrashed, match="a request before setup"):  # its stderr
            session.call("probe", {}, timeout_s=10, should_stop=never)


def _pidfds() -> set[int]:
    found = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") == "anon_inode:[pidfd]":
                found.add(int(name))
        except OSError:
            pass
    return found


def test_child_exited__a_pidfd_sees_the_zombie_and_the_reap_closes_it(tmp_path):
    """``ForkedProcess.exited`` polls a pidfd instead of reading ``/proc`` (ADR 0017, session
    8): false while the child runs, true once it is killed and not yet reaped (a zombie of the
    zygote), and the pidfd is closed when the child is reaped."""
    from conversion_jobs.converters.isolation import ChildSession

    before = _pidfds()
    session = ChildSession()
    proc = session.proc
    pidfds = _pidfds() - before
    assert proc._ended is not None and len(pidfds) == 1  # this kernel has pidfds: under test
    assert not proc.exited()
    os.kill(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while not proc.exited() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert proc.exited()
    assert proc.returncode is None  # not reaped: the zygote still holds it as a zombie
    session.close()
    assert proc.returncode is not None
    assert proc._ended is None
    assert not pidfds & _pidfds()


def test_child_exited__without_a_pidfd_reads_proc(tmp_path, monkeypatch):
    """Where ``pidfd_open`` fails (an old kernel, a seccomp filter) ``exited`` reads
    ``/proc/<pid>/stat`` as before."""
    from conversion_jobs.converters import zygote
    from conversion_jobs.converters.isolation import ChildSession

    monkeypatch.setattr(zygote, "_pidfd", lambda pid: None)
    session = ChildSession()
    proc = session.proc
    assert proc._ended is None
    assert not proc.exited()
    os.kill(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while not proc.exited() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert proc.exited()
    session.close()


def _statm_fds(pid: int) -> set[int]:
    found = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") == f"/proc/{pid}/statm":
                found.add(int(name))
        except OSError:
            pass
    return found


def test_child_rss__read_from_one_open_statm_that_close_closes(tmp_path):
    """``ChildSession.rss_bytes`` opens the child's ``/proc/<pid>/statm`` once and reads it
    again after each attempt (ADR 0017, session 8): one file however often it is read, 0 once
    the child is gone, and ``close`` closes it."""
    from conversion_jobs.converters.isolation import ChildSession

    session = ChildSession()
    session.setup(limits=LIMITS, scratch_dir=tmp_path)
    pid = session.pgid
    first = session.rss_bytes()
    assert first > 1_000_000  # an interpreter with pypdfium2 loaded
    assert len(_statm_fds(pid)) == 1
    session.call(
        "probe", {}, timeout_s=10, should_stop=never
    )  # a request: the same file, read again
    assert session.rss_bytes() > 0
    assert len(_statm_fds(pid)) == 1
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while session.rss_bytes() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert session.rss_bytes() == 0
    session.close()
    assert _statm_fds(pid) == set()
