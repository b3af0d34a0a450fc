"""Shared helpers for the converter integration tests (real child processes, real files)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from conversion_jobs.converters import (
    Limits,
    PageRequest,
    PrepareRequest,
    converter_for,
    sniff_media_type,
)

FAST = Limits(page_timeout_s=20, prepare_timeout_s=60)


def never() -> bool:
    return False


def prepare(source: Path, workdir: Path, *, output: str, limits: Limits = FAST, media_type=None):
    media_type = media_type or sniff_media_type(source)
    converter = converter_for(media_type, output)
    prepared = converter.prepare(
        PrepareRequest(
            source=source, media_type=media_type, workdir=workdir, limits=limits, should_stop=never
        )
    )
    return converter, prepared


def convert_all(source: Path, workdir: Path, *, output: str, options=None, limits: Limits = FAST):
    converter, prepared = prepare(source, workdir, output=output, limits=limits)
    artifacts = [
        converter.convert_page(
            PageRequest(
                prepared=prepared,
                output=output,
                options=options or {"dpi": 150},
                dest_dir=workdir / "pages",
                limits=limits,
                should_stop=never,
            ),
            page=n,
        )
        for n in range(1, prepared.page_count + 1)
    ]
    return prepared, artifacts


def child_area(scratch: Path) -> Path:
    """Where this process's converter children keep their private directories: the sandbox's
    writable area (sandboxed) or ``scratch`` (sandbox off). Their command lines mention it."""
    from conversion_jobs.converters import zygote

    root = zygote.zygote().root
    return root.work if root is not None else scratch


def private_dirs(scratch: Path) -> list[Path]:
    """The converter children's private directories (see ``child_area``)."""
    return sorted(child_area(scratch).glob(".isolated-*"))


def processes_mentioning(needle: str) -> list[int]:
    """Live processes whose command line contains ``needle``."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{entry.name}/cmdline").read_bytes().replace(b"\0", b" ")
            state = Path(f"/proc/{entry.name}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if needle.encode() in cmdline and state not in (b"Z", b"X"):
            found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in (b"Z", b"X")


class Stopwatch:
    def __enter__(self):
        self.start = time.monotonic()
        return self

    def __exit__(self, *exc):
        self.elapsed = time.monotonic() - self.start


def convert_page(
    doc,
    dest_dir: Path,
    page: int,
    *,
    limits: Limits,
    fault=None,
    lookahead=(),
    inline_max_bytes: int = 0,
):
    """``doc`` = (converter, prepared): one page to text at 72 dpi, optionally with a test
    fault, the pages the caller will ask for next and the inline limit of its text."""
    converter, prepared = doc
    options = {"dpi": 72, **({"_test_fault": fault} if fault else {})}
    return converter.convert_page(
        PageRequest(
            prepared=prepared,
            output="text",
            options=options,
            dest_dir=dest_dir,
            limits=limits,
            should_stop=never,
            inline_max_bytes=inline_max_bytes,
        ),
        page=page,
        lookahead=lookahead,
    )


def session_of(doc, scratch_dir: Path, *, limits: Limits):
    """The calling thread's converter session for ``doc`` (a new one if there is none)."""
    from conversion_jobs.converters import sessions

    return sessions.session_for(document=doc[1].document, scratch_dir=scratch_dir, limits=limits)
