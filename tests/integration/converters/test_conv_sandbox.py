"""The converter sandbox at the converter level (ADR 0013): its /tmp, the off switch, and a
sandbox that cannot be set up. The attacks through real jobs are in
tests/integration/execution/test_execution_sandbox.py."""

import os
import stat
from pathlib import Path

import pytest
from convhelpers import never

from conversion_jobs.converters import (
    ConversionError,
    Limits,
    SandboxUnavailable,
    converter_for,
    release,
    sandbox,
    sessions,
    zygote,
)
from conversion_jobs.converters.base import DOCX, PrepareRequest
from conversion_jobs.converters.isolation import ChildSession
from tests import testdocs

pytestmark = pytest.mark.usefixtures("no_children_left_behind")


@pytest.fixture
def fresh_probe():
    """Forget the cached probe before and after (the environment changes in these tests)."""
    sandbox._probe_cache = None
    sessions.release_all()
    yield
    sessions.release_all()
    sandbox._probe_cache = None


def test_libreoffice_killed_at_the_memory_limit__leaves_no_osl_pipe_on_the_host(tmp_path):
    """Unsandboxed, a LibreOffice that dies under RLIMIT_AS leaves /tmp/OSL_PIPE_<uid>_… behind
    (issue 10). Sandboxed it lands in the sandbox's own /tmp (never the host's: other
    processes on this shared host may create their own there), emptied when the attempt ends."""
    source = testdocs.make_docx(tmp_path / "in.docx", paragraphs=["memory"] * 50)
    root = zygote.zygote().root
    assert root is not None
    left: list[str] = []
    # Where exactly LibreOffice dies under the limit varies a little: a run that died before
    # creating its pipe proves nothing, so up to three limits are tried.
    for limit in (300_000_000, 350_000_000, 400_000_000):
        with pytest.raises(ConversionError):
            converter_for(DOCX, "text").prepare(
                PrepareRequest(
                    source=source,
                    media_type=DOCX,
                    workdir=tmp_path,
                    limits=Limits(memory_bytes=limit, prepare_timeout_s=60),
                    should_stop=never,
                )
            )
        left = [p.name for p in root.tmp.glob("OSL_PIPE_*")]
        if left:
            break
        release()
    assert left, "LibreOffice left no pipe behind: the memory limit did not kill it"
    assert not any(os.path.exists(f"/tmp/{name}") for name in left)
    release()
    assert list(root.tmp.glob("OSL_PIPE_*")) == []


def test_document__reaches_the_child_in_its_private_directory_read_only(tmp_path):
    """Handed in as a hard link to the attempt's copy (no second copy of the bytes), which the
    sandbox's uid can read and not change."""
    source = testdocs.make_pdf(tmp_path / "doc.pdf", pages=2)
    os.chmod(source, 0o600)  # as the worker downloads it
    session = sessions.open_session(document=source, scratch_dir=tmp_path, limits=Limits())
    assert session.document is not None and session.private is not None
    assert session.document.parent == session.private
    assert session.document.read_bytes() == source.read_bytes()
    root = session.proc.sandbox_root
    assert root is not None and session.private.parent == root.work
    handed = session.document.stat()
    assert handed.st_ino == source.stat().st_ino  # a link: the bytes were not copied again
    assert handed.st_uid == os.geteuid() != root.uid
    expected = 0o444 if os.geteuid() == 0 else 0o600  # a non-root sandbox runs as our uid
    assert stat.S_IMODE(handed.st_mode) == expected
    # The child reads it (it prepares the document from it).
    assert session.call(
        "pdf_prepare",
        {"path": str(session.document)},
        timeout_s=20,
        should_stop=never,
    ) == {"page_count": 2}


def test_off_switch__children_share_the_worker_namespaces(tmp_path, fresh_probe, monkeypatch):
    monkeypatch.setenv(sandbox.MODE_ENV, "off")
    assert sandbox.probe().as_dict() == {
        "mode": "off",
        "available": False,
        "reason": "turned off by QUIRE_SANDBOX=off",
    }
    with ChildSession() as session:
        session.setup(limits=Limits(), scratch_dir=tmp_path)
        pid = session.proc.pid
        assert session.proc.sandbox_root is None
        assert os.readlink(f"/proc/{pid}/ns/net") == os.readlink("/proc/self/ns/net")
        assert session.private is not None and session.private.parent == tmp_path


def test_unavailable__no_child_starts_and_the_error_is_retryable(
    tmp_path, fresh_probe, monkeypatch
):
    """A sandbox that cannot be set up (here: a uid of 0 configured) refuses to start any
    child: sandbox_unavailable, retryable, and the probe says why."""
    monkeypatch.setenv(sandbox.UID_ENV, "0")
    status = sandbox.probe()
    assert (status.enabled, status.available) == (True, False)
    assert "must not be 0" in (status.reason or "")
    with pytest.raises(SandboxUnavailable) as info:
        ChildSession()
    assert (info.value.code, info.value.retryable) == ("sandbox_unavailable", True)
    sessions.warm()  # the worker's background start-up does not fail, it just has no spare
    assert sessions._spare is None


def test_unavailable__without_bubblewrap(tmp_path, fresh_probe, monkeypatch):
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    status = sandbox.probe()
    assert not status.available and "bwrap" in (status.reason or "")


def test_stale_sandbox_directories_of_dead_processes_are_removed(tmp_path, fresh_probe):
    parent = sandbox.sandbox_dirs_parent()
    parent.mkdir(parents=True, exist_ok=True)
    dead = parent / "999999999-deadbeef0000"
    (dead / "work").mkdir(parents=True)
    mine = zygote.zygote().root
    assert mine is not None and mine.path.is_dir()
    sessions.release_all()
    zygote.zygote()
    assert not dead.exists()
    assert Path(parent).is_dir()


def test_sandbox__code_under_the_hosts_tmp_is_bound_over_its_own_tmp(monkeypatch):
    """A checkout or virtualenv under the host's /tmp (a CI clone, a newcomer's mktemp -d) is
    still visible inside: the sandbox's own /tmp is mounted first and the code bound on top,
    and emptying that /tmp keeps the mount points."""
    import subprocess
    import sys
    import tempfile

    code_dir = Path(tempfile.mkdtemp(dir="/tmp", prefix="quire-code-"))
    try:
        (code_dir / "hello.py").write_text("print('inside')\n")
        code_dir.chmod(0o755)
        (code_dir / "hello.py").chmod(0o644)
        real = sandbox._readonly_paths
        monkeypatch.setattr(sandbox, "_readonly_paths", lambda: [*real(), str(code_dir)])
        root = sandbox.SandboxRoot()
        try:
            run = [sys.executable, str(code_dir / "hello.py")]
            done = subprocess.run(sandbox.command(root, run), capture_output=True, check=False)
            assert done.returncode == 0, done.stderr.decode()
            assert done.stdout.decode().strip() == "inside"
            root.clear_tmp()
            again = subprocess.run(sandbox.command(root, run), capture_output=True, check=False)
            assert again.stdout.decode().strip() == "inside", again.stderr.decode()
        finally:
            root.remove()
    finally:
        import shutil

        shutil.rmtree(code_dir, ignore_errors=True)
