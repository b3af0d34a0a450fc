"""``isolation.empty_directory``: what the next attempt of a process reuses holds nothing of
the last one (ADR 0017, session 7)."""

from __future__ import annotations

import os
from pathlib import Path

from conversion_jobs.converters.isolation import empty_directory


def test_empty_directory__removes_files_folders_and_links_keeps_the_directory(
    tmp_path: Path,
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "kept").write_bytes(b"not ours")
    work = tmp_path / "work"
    work.mkdir(mode=0o700)
    (work / "source").write_bytes(b"%PDF")
    (work / "pages" / "deep").mkdir(parents=True)
    (work / "pages" / "deep" / "1.txt").write_text("one")
    (work / ".hidden").write_text("x")
    os.symlink(outside, work / "link-to-dir")
    os.symlink(outside / "kept", work / "link-to-file")

    assert empty_directory(work) is True
    assert work.is_dir() and list(work.iterdir()) == []
    assert (work.stat().st_mode & 0o777) == 0o700
    assert (outside / "kept").read_bytes() == b"not ours"  # links removed, never followed


def test_empty_directory__false_when_missing(tmp_path: Path) -> None:
    assert empty_directory(tmp_path / "absent") is False
