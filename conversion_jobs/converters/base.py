"""Value types shared by the parent (worker) and the isolated child. No Django."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

OUTPUTS = ("text", "png", "pdf")
#: File extension of an output's result (a PNG result is the ZIP of its pages) and of its pages.
RESULT_EXT = {"text": "txt", "png": "zip", "pdf": "pdf"}
PAGE_EXT = {"text": "txt", "png": "png", "pdf": "pdf"}

PDF = "application/pdf"
PNG = "image/png"
JPEG = "image/jpeg"
TIFF = "image/tiff"
DOCX = "application/vnd.openxmlformats-officedocument.wordprocessingml.document"
PPTX = "application/vnd.openxmlformats-officedocument.presentationml.presentation"
XLSX = "application/vnd.openxmlformats-officedocument.spreadsheetml.sheet"
ODT = "application/vnd.oasis.opendocument.text"
DOC = "application/msword"
RTF = "application/rtf"

IMAGE_TYPES = frozenset({PNG, JPEG, TIFF})
OFFICE_TYPES = frozenset({DOCX, PPTX, XLSX, ODT, DOC, RTF})

TEXT_PLAIN = "text/plain; charset=utf-8"
ZIP = "application/zip"

DEFAULT_DPI = 150
#: Set to "1" in a process's environment to let ``options["_test_fault"]`` through (the API
#: accepts the option, the worker hands it to the child). The only definition.
TEST_FAULTS_ENV = "QUIRE_ENABLE_TEST_FAULTS"
#: Exit status of the child for MemoryError under RLIMIT_AS (reported as converter_crashed).
EXIT_OUT_OF_MEMORY = 75
#: Exit status of the child for any other unexpected exception (reported as converter_crashed).
EXIT_UNEXPECTED = 70

#: The key of a child answer's raw payload: an operation's result may hold bytes under it (a
#: text page's UTF-8); the child then sends the answer line with the payload's length under
#: this key and the bytes themselves right after the line, and the parent puts them back in the
#: result (child.py ``_encode``, isolation.py ``_receive``). No escaping, no JSON for the text.
BODY = "body"

#: A converter child left idle this long (a worker that forgot to release it) ends itself.
CHILD_IDLE_EXIT_S = 300.0

#: PDF 1.7 (ISO 32000-1, annex C): a page side may not exceed 14 400 user units (200 in).
MAX_PAGE_SIDE_PT = 14_400.0


@dataclass(frozen=True)
class Limits:
    max_pages: int = 2000
    max_pixels: int = 40_000_000  # per rendered page / per decoded image
    page_timeout_s: float = 60.0  # wall clock per child call
    prepare_timeout_s: float = 180.0  # e.g. LibreOffice conversion
    memory_bytes: int = 1_500_000_000  # RLIMIT_AS for the child
    max_dpi: int = 600
    #: Office containers (OOXML, ODF): the most all their parts may inflate to, and the most a
    #: part past ``inflate_ratio_min_bytes`` may inflate per compressed byte (containers.py).
    max_inflated_bytes: int = 256 * 1024 * 1024
    max_inflate_ratio: int = 100
    inflate_ratio_min_bytes: int = 10 * 1024 * 1024


def limits_description(limits: Limits) -> dict:
    """The limits as the capabilities endpoint shows them."""
    return {
        **asdict(limits),
        "default_dpi": DEFAULT_DPI,
        "max_page_side_pt": MAX_PAGE_SIDE_PT,
    }


@dataclass(frozen=True)
class Prepared:
    document: Path  # the file pages are taken from (the source, or the PDF LibreOffice made)
    media_type: str  # media type of `document`
    page_count: int
    #: the prepare asked for ``first``'s pages (those up to the count): the first
    #: ``convert_page`` calls find them due, no ``request_pages`` is needed
    first_requested: bool = False


@dataclass(frozen=True)
class FirstPages:
    """The pages a caller will ask for first, known before the page count (``prepare``'s
    ``first``): in order, as ``convert_page`` will be called with them."""

    pages: tuple[int, ...]
    output: str
    inline_max_bytes: int = 0


@dataclass(frozen=True)
class StepAside:
    """The worker's side of stepping aside (ADR 0022): ``ask`` hands the attempt's slot back
    (True: it was); ``others_wait``, asked while aside, says that other work waits for a slot
    (True: the conversion pauses)."""

    ask: Callable[[], bool]
    others_wait: Callable[[], bool]


@dataclass(frozen=True)
class PrepareRequest:
    """What a caller asks of a converter's ``prepare``: open the document ``source`` (accepted
    as ``media_type``) in ``workdir``, under ``limits``, stopping when ``should_stop`` says so;
    ``options``: the job's options for this attempt (e.g. its password); ``first``: the pages
    the caller will ask for first, if it knows them before the page count (a converter may start
    on them with the prepare; those beyond the count are dropped)."""

    source: Path
    media_type: str
    workdir: Path
    limits: Limits
    should_stop: Callable[[], bool]
    options: dict | None = None
    first: FirstPages | None = None
    #: How a long conversion hands this attempt's worker slot back (ADR 0022, "Stepping
    #: aside"); None: the attempt keeps its slot.
    step_aside: StepAside | None = None

    def pages(self, prepared: Prepared, *, output: str, inline_max_bytes: int = 0) -> PageRequest:
        """The request of the prepared document's pages in ``output``: into this work dir,
        under these limits, options and stop flag."""
        return PageRequest(
            prepared=prepared,
            output=output,
            options=self.options or {},
            dest_dir=self.workdir,
            limits=self.limits,
            should_stop=self.should_stop,
            inline_max_bytes=inline_max_bytes,
        )


@dataclass(frozen=True)
class PageRequest:
    """What a caller asks of a converter's ``convert_page`` / ``request_pages``, built once and
    handed down whole to the document's child session: the output, where the pages go and
    under which limits, and ``inline_max_bytes`` (a text page up to this size may come back as
    content, 0: always a file). ``op`` and ``password`` are the converter's (its child's page
    operation, the document's password): it fills them in (``registry._ChildPages``); a caller
    leaves them."""

    prepared: Prepared
    output: str
    options: dict
    dest_dir: Path
    limits: Limits
    should_stop: Callable[[], bool]
    inline_max_bytes: int = 0
    op: str = ""
    password: str | None = None


@dataclass(frozen=True)
class PageArtifact:
    """A converted page: a file at ``path``, or (a small text page asked for with
    ``inline_max_bytes``) its bytes in ``content``, which the child sent with its answer."""

    path: Path | None
    media_type: str  # text/plain; charset=utf-8 | image/png | application/pdf
    content: bytes | None = None


class Converter(Protocol):
    name: str
    media_types: frozenset[str]
    outputs: frozenset[str]

    def available(self) -> bool: ...

    def prepare(self, request: PrepareRequest) -> Prepared:
        """Open the document ``request`` names (see ``PrepareRequest``)."""
        ...

    def convert_page(
        self, request: PageRequest, *, page: int, lookahead: Sequence[int] = ()
    ) -> PageArtifact:
        """Convert one page into ``request.dest_dir``. ``lookahead``: the pages the caller will
        ask for next, in order (a converter may start on them early)."""
        ...

    def request_pages(self, request: PageRequest, *, pages: Sequence[int]) -> None:
        """Start converting ``pages`` (the caller's plan, in order) without waiting: the next
        ``convert_page`` calls, for these pages in this order, collect them. The caller may do
        other work meanwhile (record the page count). A failure here is met again by the first
        ``convert_page``; only ConversionStopped is raised."""
        ...


def _group_stats(pgid: int) -> Iterator[tuple[int, list[bytes]]]:
    """(pid, the fields of its ``/proc/<pid>/stat`` after the command name) of each live
    (non-zombie) process whose process group is ``pgid``."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:
            continue
        # The command name may contain spaces and parentheses; fields resume after the last ")".
        fields = stat[stat.rfind(b")") + 2 :].split()
        state, pgrp = fields[0], int(fields[2])
        if pgrp == pgid and state not in (b"Z", b"X"):
            yield int(entry.name), fields


def process_group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes whose process group is ``pgid``, from /proc."""
    return [pid for pid, _ in _group_stats(pgid)]


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def process_group_cpu_s(pgid: int) -> float:
    """CPU seconds (user and system) used by the live members of group ``pgid`` and by the
    children they reaped, from /proc (``utime`` .. ``cstime``)."""
    ticks = sum(sum(int(f) for f in fields[11:15]) for _, fields in _group_stats(pgid))
    return ticks / _CLOCK_TICKS


def process_group_idle(pgid: int) -> int:
    """Move every thread of group ``pgid`` to ``SCHED_IDLE`` (it runs only when a core has
    nothing else to run; threads they start inherit it), or where that is refused to nice 19.
    Returns how many threads were moved."""
    moved = 0
    for pid, _ in _group_stats(pgid):
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            continue
        for tid in tids:
            try:
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            except OSError:
                try:
                    os.setpriority(os.PRIO_PROCESS, tid, 19)
                except OSError:
                    continue  # gone meanwhile
            moved += 1
    return moved
