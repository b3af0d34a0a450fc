"""Converter reuse within a tenant (issue 12 point 4; converters/sessions.py) with real children:
a tenant change always gets a fresh process, an error recycles, N recycles, a memory mark
recycles, and nothing of one attempt is visible to the next."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from convhelpers import FAST, never

from conversion_jobs.converters import InvalidInput, PageRequest, PrepareRequest, sessions
from conversion_jobs.converters.registry import PdfConverter
from tests import testdocs

pytestmark = pytest.mark.usefixtures("no_children_left_behind")


@pytest.fixture
def reuse():
    sessions.configure_reuse(sessions.ReuseSettings(mode="tenant", max_attempts=3))
    yield sessions.configure_reuse
    sessions.configure_reuse(sessions.ReuseSettings())
    sessions.begin_attempt(tenant=None)


def _attempt(tmp_path: Path, name: str, *, tenant: str, options=None) -> dict:
    """One attempt as the runner makes it: name the tenant, prepare, convert its pages,
    release. Returns what the child looked like from inside at the end (probe)."""
    sessions.begin_attempt(tenant=tenant)
    workdir = tmp_path / name
    workdir.mkdir()
    source = testdocs.make_pdf(workdir / "in.pdf", pages=2, text_of=lambda n: f"{name} page {n}")
    converter = PdfConverter()
    prepared = converter.prepare(
        PrepareRequest(
            source=source,
            media_type="application/pdf",
            workdir=workdir,
            limits=FAST,
            should_stop=never,
        )
    )
    failure = None
    for page in (1, 2):
        try:
            converter.convert_page(
                PageRequest(
                    prepared=prepared,
                    output="text",
                    options=options or {},
                    dest_dir=workdir / "pages",
                    limits=FAST,
                    should_stop=never,
                ),
                page=page,
            )
        except InvalidInput as exc:
            failure = exc
    session = sessions.session_for(document=prepared.document, scratch_dir=workdir, limits=FAST)
    probe = session.call("probe", {}, timeout_s=10, should_stop=never)
    private, document, pid = session.private, session.document, session.pgid
    files = sorted(str(p.relative_to(private)) for p in private.rglob("*") if not p.is_dir())
    sessions.release()
    sessions.begin_attempt(tenant=None)
    # pid: as this host sees it (a sandboxed child has other pids inside)
    return {
        "pid": pid,
        "probe": probe,
        "private": private,
        "files": files,
        "document": document,
        "failure": failure,
    }


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] not in (b"Z", b"X")


def test_same_tenant_reuses__nothing_of_the_previous_attempt_is_visible(tmp_path, reuse):
    first = _attempt(tmp_path, "a1", tenant="tenant-pseudonym-a")
    second = _attempt(tmp_path, "a2", tenant="tenant-pseudonym-a")
    assert second["pid"] == first["pid"]
    # The earlier attempt's files are gone and the child never looks at them again: its
    # private directory was emptied when the child was kept and is taken again (ADR 0017,
    # session 7: no directory made and removed per attempt), the earlier document is closed.
    assert first["files"] == [first["document"].name]
    assert second["files"] == [second["document"].name]
    assert second["private"] == first["private"]
    assert second["probe"]["cwd"] == str(second["private"])
    assert second["probe"]["open_document"] == str(second["document"])
    assert not first["document"].exists()
    assert str(tmp_path / "a1") not in str(second["probe"])


def test_tenant_change_always_gets_a_fresh_process(tmp_path, reuse):
    first = _attempt(tmp_path, "a", tenant="tenant-pseudonym-a")
    other = _attempt(tmp_path, "b", tenant="tenant-pseudonym-b")
    assert other["pid"] != first["pid"]
    assert not _alive(first["pid"])  # the kept child of tenant a ended
    back = _attempt(tmp_path, "a-again", tenant="tenant-pseudonym-a")
    assert back["pid"] not in (first["pid"], other["pid"])


def test_error_recycles(tmp_path, reuse, faults_enabled):
    failed = _attempt(
        tmp_path, "f", tenant="t", options={"_test_fault": {"kind": "fail", "page": 2}}
    )
    assert failed["failure"] is not None
    after = _attempt(tmp_path, "g", tenant="t")
    assert after["pid"] != failed["pid"]
    assert not _alive(failed["pid"])


def test_recycled_after_n_attempts_and_above_memory_mark(tmp_path, reuse):
    pids = [_attempt(tmp_path, f"n{i}", tenant="t")["pid"] for i in range(4)]
    assert pids[0] == pids[1] == pids[2] != pids[3]  # max_attempts=3
    reuse(sessions.ReuseSettings(mode="tenant", max_attempts=3, max_rss_bytes=1))
    one = _attempt(tmp_path, "m1", tenant="t")["pid"]
    two = _attempt(tmp_path, "m2", tenant="t")["pid"]
    assert one != two


def test_attempt_mode_never_reuses(tmp_path, reuse):
    reuse(sessions.ReuseSettings(mode="attempt"))
    one = _attempt(tmp_path, "x1", tenant="t")["pid"]
    two = _attempt(tmp_path, "x2", tenant="t")["pid"]
    assert one != two
    assert not _alive(one)
    assert os.getpid() not in (one, two)


def test_kept_child__forgets_the_previous_attempt_in_its_next_setup(tmp_path, reuse):
    """The kept child's reset rides on the next attempt's setup (ADR 0017, session 4): by the
    time that setup has answered, before any document of the new attempt is opened, the
    earlier document is closed and the child works in its emptied directory."""
    first = _attempt(tmp_path, "k1", tenant="tenant-pseudonym-a")
    assert first["probe"]["open_document"] is not None
    sessions.begin_attempt(tenant="tenant-pseudonym-a")
    workdir = tmp_path / "k2"
    workdir.mkdir()
    source = testdocs.make_pdf(workdir / "in.pdf", pages=1, text_of=lambda n: "k2")
    session = sessions.open_session(document=source, scratch_dir=workdir, limits=FAST)
    try:
        probe = session.call("probe", {}, timeout_s=10, should_stop=never)
        assert session.pgid == first["pid"]  # the same child, reused
        assert probe["open_document"] is None
        assert probe["cwd"] == str(session.private)
        assert str(tmp_path / "k1") not in str(probe)
        # The reused private directory holds this attempt's document only.
        assert [p.name for p in session.private.iterdir()] == [session.document.name]
        assert not first["document"].exists()
    finally:
        sessions.release()
        sessions.begin_attempt(tenant=None)
