"""The converters, which one handles what, and what this machine can do."""

from __future__ import annotations

import functools
import shutil
import uuid
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from . import engines
from .aside import ConversionClock
from .base import (
    BODY,
    DEFAULT_DPI,
    IMAGE_TYPES,
    OFFICE_TYPES,
    OUTPUTS,
    PDF,
    Converter,
    PageArtifact,
    PageRequest,
    Prepared,
    PrepareRequest,
)
from .errors import (
    ConversionError,
    ConversionStopped,
    EncryptedInput,
    InvalidInput,
    UnsupportedConversion,
)
from .isolation import ChildSession, test_fault_from
from .sessions import forget, fresh_child, open_session, session_due, session_for
from .sniff import office_encrypted, sniff_media_type

_SUFFIX = {"text": ".txt", "png": ".png", "pdf": ".pdf"}


def _check_magic(source: Path, media_type: str) -> None:
    """The bytes must be what the job was accepted as (wrong magic -> invalid_input)."""
    actual = sniff_media_type(source)
    if actual != media_type:
        raise InvalidInput(f"the content is not {media_type} (detected: {actual or 'unknown'})")


def _prepare_in_session(
    request: PrepareRequest, *, op: str, page_op: str, password: str | None
) -> dict:
    """Prepare in a fresh child that then stays open for this document's pages. With
    ``request.first`` (``page_op`` converts them), the first pages are asked for in the
    prepare's own request (``ChildSession.prepare_reading_ahead``): the first ``convert_page``
    finds its page due, one round trip fewer per attempt."""
    limits, first = request.limits, request.first
    session = open_session(
        document=Path(request.source), scratch_dir=request.workdir, limits=limits
    )
    args = _document_args(session, password)
    try:
        if first is None:
            return session.call(
                op, args, timeout_s=limits.prepare_timeout_s, should_stop=request.should_stop
            )
        fault = test_fault_from(request.options)
        if fault:
            session.fault_records_to = request.workdir
        return session.prepare_reading_ahead(
            op,
            args,
            page_op,
            first.pages,
            (str(session.inside()), _SUFFIX[first.output]),
            _page_args(args, request, output=first.output, inline_max_bytes=first.inline_max_bytes),
            limits=limits,
            should_stop=request.should_stop,
            fault=fault,
        )
    except BaseException:
        forget(session)
        raise


def _document_args(session: ChildSession, password: str | None) -> dict:
    """What opens the session's document in the child: its path, and its password if it has
    one. A prepare's arguments, and part of every page request's: a fresh child (after a failed
    page) opens the document again."""
    secret = {"password": password} if password is not None else {}
    return {"path": str(session.document), **secret}


def _page_args(
    document: dict,
    request: PrepareRequest | PageRequest,
    *,
    output: str,
    inline_max_bytes: int,
) -> dict:
    """The arguments of a page request but its pages (``read_ahead``'s ``args``): the
    document's (``_document_args``), the ``output``, the dpi (the request's option, within its
    limits) and the largest page that comes back inline."""
    dpi = int((request.options or {}).get("dpi") or DEFAULT_DPI)
    extra = {"inline_max_bytes": inline_max_bytes} if inline_max_bytes > 0 else {}
    return {**document, "output": output, "dpi": max(1, min(dpi, request.limits.max_dpi)), **extra}


#: Pages asked of the child in one read-ahead request (it answers each as it is done).
READ_AHEAD_PAGES = 16


def _page_call(request: PageRequest, *, page: int, lookahead: Sequence[int] = ()) -> PageArtifact:
    """Convert ``page`` in the document's session. ``lookahead``: the pages the caller will ask
    for next, in order; they are requested with this one (up to READ_AHEAD_PAGES) and the child
    converts them while the caller checkpoints; when half of them are collected, the next ones
    are requested (queued behind the first request), so the child never waits for the caller.
    Asking for a page out of that order ends the session (its child is killed and a fresh one
    serves the page). ``request.inline_max_bytes`` (pdf text only): a page's text up to that
    many bytes comes back in the answer (``PageArtifact.content``), with no file written."""
    prepared, limits, output, dest_dir = (
        request.prepared,
        request.limits,
        request.output,
        request.dest_dir,
    )
    if not 1 <= page <= prepared.page_count:
        raise InvalidInput(f"page {page} does not exist (the document has {prepared.page_count})")
    dest: Path | None = None
    try:
        # The page a read-ahead already asked for: no request to build, no child to probe.
        session = session_due(document=prepared.document, limits=limits, page=page)
        if session is None or len(session.ahead) <= READ_AHEAD_PAGES // 2:
            session = _request_pages(request, session=session, page=page, lookahead=lookahead)
        result = session.next_page(
            page, timeout_s=limits.page_timeout_s, should_stop=request.should_stop
        )
        if BODY in result:  # inline: the page's text (UTF-8) came with the answer, no file
            return PageArtifact(path=None, media_type=result["media_type"], content=result[BODY])
        dest_dir.mkdir(parents=True, exist_ok=True)
        dest = _page_dest(dest_dir, page, output)
        session.hand_out(_page_dest(session.inside(), page, output), dest)
    except BaseException:
        # A killed or failed child may have left half an artifact; it must never be promoted.
        if dest is not None:
            dest.unlink(missing_ok=True)
        raise
    return PageArtifact(path=dest, media_type=result["media_type"])


def _request_pages(
    request: PageRequest, *, session: ChildSession | None, page: int, lookahead: Sequence[int]
) -> ChildSession:
    """The session that will answer ``page``, with ``page`` and the next pages of ``lookahead``
    requested of it as needed: ``session`` (``page`` already due from it, half of its read-ahead
    or less left) or the thread's session of the document, or a fresh one."""
    prepared, dest_dir, limits = request.prepared, request.dest_dir, request.limits
    fault = test_fault_from(request.options)
    if session is None:
        # The session of this document (the child keeps it open); a fresh child if an earlier
        # page's failure killed it.
        session = session_for(document=prepared.document, scratch_dir=dest_dir, limits=limits)
        if session.ahead and session.ahead[0] != page:
            forget(session)  # the caller changed its plan: drop the pages still coming
            session = session_for(document=prepared.document, scratch_dir=dest_dir, limits=limits)
    upcoming = [p for p in lookahead if p != page and 1 <= p <= prepared.page_count]
    if not session.ahead:
        wanted = [page, *upcoming[: READ_AHEAD_PAGES - 1]]
    elif len(session.ahead) <= READ_AHEAD_PAGES // 2 and session.ahead == [
        page,
        *upcoming[: len(session.ahead) - 1],
    ]:
        # Half collected, the plan unchanged: queue the next pages behind those in flight.
        wanted = upcoming[len(session.ahead) - 1 : len(session.ahead) - 1 + READ_AHEAD_PAGES]
    else:
        wanted = []
    if wanted:
        if fault:
            session.fault_records_to = dest_dir
        # The child writes in its private directory; each page is handed out when read.
        session.read_ahead(
            request.op,
            [(p, str(_page_dest(session.inside(), p, request.output))) for p in wanted],
            _page_args(
                _document_args(session, request.password),
                request,
                output=request.output,
                inline_max_bytes=request.inline_max_bytes,
            ),
            timeout_s=limits.page_timeout_s,
            should_stop=request.should_stop,
            fault=fault,
        )
    return session


def _request_first(request: PageRequest, *, pages: Sequence[int]) -> None:
    """``request_pages`` of a session converter: the read-ahead the first ``_page_call`` of
    ``pages`` would send (the same pages, so that call finds them due). A failure closes the
    session and is left to that call, which meets it again (with its page's tries)."""
    if not pages or not 1 <= pages[0] <= request.prepared.page_count:
        return
    try:
        _request_pages(request, session=None, page=pages[0], lookahead=pages[1:])
    except ConversionStopped:
        raise
    except ConversionError:
        return  # the session is closed (read_ahead, open_session): a fresh one serves the page


def _page_dest(dest_dir: Path, page: int, output: str) -> Path:
    # The child names a prepare's first pages the same way (child._first_items).
    return dest_dir / f"page-{page:04d}{_SUFFIX[output]}"


class _ChildPages:
    """``prepare``, ``convert_page`` and ``request_pages`` of a converter whose document's child
    session prepares it with ``prepare_op`` (the document's password along when
    ``with_password``; the first pages in the same request when ``reads_first``) and converts
    its pages with ``page_op``; a converter says which outputs it can make now
    (``_check_output``) and what else its page requests carry (``_page_args_for``)."""

    prepare_op: str = ""
    page_op: str
    outputs: frozenset[str]
    with_password = False
    reads_first = False

    def prepare(self, request: PrepareRequest) -> Prepared:
        _check_magic(request.source, request.media_type)
        first = request.first
        if first is not None and not (
            self.reads_first and first.output in self.outputs and first.pages
        ):
            request = replace(request, first=None)
        password = (request.options or {}).get("password") if self.with_password else None
        result = _prepare_in_session(
            request, op=self.prepare_op, page_op=self.page_op, password=password
        )
        return Prepared(
            document=Path(request.source),
            media_type=request.media_type,
            page_count=result["page_count"],
            first_requested=request.first is not None,
        )

    def _check_output(self, media_type: str, output: str) -> None:
        if output not in self.outputs:
            raise UnsupportedConversion(f"{media_type} -> {output}")

    def _page_args_for(self, output: str, options: dict | None, inline_max_bytes: int) -> dict:
        """The page requests' ``password`` and ``inline_max_bytes`` (none by default)."""
        return {}

    def _request(self, request: PageRequest) -> PageRequest:
        """The caller's request as this converter's child session takes it: its page ``op``
        and its page requests' extras (``_page_args_for``)."""
        self._check_output(request.prepared.media_type, request.output)
        extras = self._page_args_for(request.output, request.options, request.inline_max_bytes)
        return replace(
            request,
            op=self.page_op,
            password=extras.get("password"),
            inline_max_bytes=extras.get("inline_max_bytes", 0),
        )

    def convert_page(
        self, request: PageRequest, *, page: int, lookahead: Sequence[int] = ()
    ) -> PageArtifact:
        return _page_call(self._request(request), page=page, lookahead=lookahead)

    def request_pages(self, request: PageRequest, *, pages: Sequence[int]) -> None:
        try:
            built = self._request(request)
        except UnsupportedConversion:
            return  # the first convert_page raises it
        _request_first(built, pages=pages)


class PdfConverter(_ChildPages):
    """PDF -> text (pypdfium2 text layer) or png (pypdfium2 render at options.dpi)."""

    name = "pdfium"
    media_types = frozenset({PDF})
    outputs = frozenset({"text", "png"})
    prepare_op = "pdf_prepare"
    page_op = "pdf_page"
    with_password = True
    reads_first = True

    def available(self) -> bool:
        return True

    def _page_args_for(self, output: str, options: dict | None, inline_max_bytes: int) -> dict:
        return {
            "password": (options or {}).get("password"),
            "inline_max_bytes": inline_max_bytes if output == "text" else 0,
        }


class ImageConverter(_ChildPages):
    """PNG / JPEG / TIFF, one page per frame -> png, pdf (img2pdf), text (tesseract)."""

    name = "image"
    media_types = IMAGE_TYPES
    outputs = frozenset({"text", "png", "pdf"})
    prepare_op = "image_prepare"
    page_op = "image_page"

    def available(self) -> bool:
        return True

    def _check_output(self, media_type: str, output: str) -> None:
        super()._check_output(media_type, output)
        if output == "text" and not tesseract_available():
            raise UnsupportedConversion("OCR (tesseract) is not installed")


def engine_label(converter: Converter) -> str:
    """The converter's name for metrics; LibreOffice's says whether its engine is warm."""
    if converter.name == "libreoffice":
        return "libreoffice-warm" if engines.current_settings().warm else "libreoffice-fresh"
    return converter.name


class OfficeConverter(_ChildPages):
    """Office documents -> PDF with LibreOffice headless (private profile per call), then as PDF.

    Per-page ``pdf`` is that page split out of LibreOffice's PDF with pypdf.
    """

    name = "libreoffice"
    media_types = OFFICE_TYPES
    outputs = frozenset({"text", "png", "pdf"})
    page_op = "pdf_page"  # the pages of the PDF LibreOffice made

    def available(self) -> bool:
        return soffice_available()

    def prepare(self, request: PrepareRequest) -> Prepared:
        source, media_type, workdir = request.source, request.media_type, request.workdir
        limits = request.limits
        _check_magic(source, media_type)
        options = request.options or {}
        password = options.get("password")
        encrypted = office_encrypted(Path(source))
        if encrypted and password is None:
            raise EncryptedInput()
        fault = test_fault_from(options)
        document = Path(workdir) / f"office-{uuid.uuid4().hex}.pdf"
        if engines.current_settings().warm:
            result = engines.convert(
                request, dest=document, password=password, encrypted=encrypted, fault=fault
            )
        else:
            # A fresh child converts to PDF in its private directory (LibreOffice's profile, the
            # copy of the input): all of it goes with the child; the PDF is handed out first.
            # ``--convert-to`` cannot take a password: an encrypted document is opened over UNO
            # by a one-off engine in the same child. The child checks the container first
            # (containers.py): LibreOffice starts only for a document that passed.
            with fresh_child() as session:
                session.setup(limits=limits, scratch_dir=workdir)
                copy = session.hand_in(source)
                clock = ConversionClock(
                    request, engines.current_settings().aside, pgid=lambda: session.pgid
                )
                scan = session.call(
                    "office_scan",
                    {"path": str(copy), "media_type": media_type},
                    timeout_s=clock.begin(),
                    should_stop=clock.should_stop,
                )
                args = {
                    "path": str(copy),
                    "media_type": media_type,
                    "base": str(session.inside("office")),
                    "has_text": scan["has_text"],
                }
                if password is not None:
                    args["password"], args["encrypted"] = password, encrypted
                try:
                    result = session.call(
                        "office_prepare" if password is None else "office_engine_convert",
                        args,
                        timeout_s=clock.begin(),
                        should_stop=clock.should_stop,
                        fault=fault,
                    )
                finally:
                    clock.end()
                session.hand_out(Path(result["document"]), document)
        return Prepared(document=document, media_type=PDF, page_count=result["page_count"])


CONVERTERS: tuple[Converter, ...] = (PdfConverter(), ImageConverter(), OfficeConverter())


@functools.cache
def tesseract_available() -> bool:
    return shutil.which("tesseract") is not None


@functools.cache
def soffice_available() -> bool:
    return shutil.which("soffice") is not None


def _program_version(*argv: str) -> str:
    """The first line a program prints for ``--version`` (once per process; "" if it cannot
    say): LibreOffice's and tesseract's own release."""
    import subprocess

    try:
        done = subprocess.run(  # noqa: S603 - a fixed argv of an installed program
            argv, capture_output=True, text=True, timeout=20, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    lines = (done.stdout or done.stderr).strip().splitlines()
    return lines[0].strip() if lines else ""


@functools.cache
def _engine_version(name: str) -> str:
    from pypdfium2.version import PDFIUM_INFO

    pdfium = f"pdfium {PDFIUM_INFO}"
    if name == "pdfium":
        return pdfium
    if name == "image":
        import PIL

        return f"pillow {PIL.__version__}; {_program_version('tesseract', '--version')}"
    if name == "libreoffice":
        return f"{_program_version('soffice', '--version')}; {pdfium}"
    return name


def engine_version(media_type: str) -> str:
    """The engines that convert this input type and their versions, as this installation has
    them (cached per process): part of a quarantine's key (services/quarantine.py), so a new
    engine release lifts every quarantine of the old one. The web and the workers run the same
    installation (as ``capabilities`` assumes)."""
    for converter in CONVERTERS:
        if media_type in converter.media_types:
            return _engine_version(converter.name)[:128]
    return "none"


@functools.cache
def _capabilities() -> tuple[tuple[str, tuple[str, ...]], ...]:
    table = []
    for converter in CONVERTERS:
        if not converter.available():
            continue
        outputs = set(converter.outputs)
        if converter.media_types == IMAGE_TYPES and not tesseract_available():
            outputs.discard("text")
        for media_type in sorted(converter.media_types):
            table.append((media_type, tuple(o for o in OUTPUTS if o in outputs)))
    return tuple(table)


def capabilities() -> dict[str, list[str]]:
    """media type -> outputs this installed machine can produce. Cached per process."""
    return {media_type: list(outputs) for media_type, outputs in _capabilities()}


def converter_for(media_type: str, output: str) -> Converter:
    """The converter for this input type and output; UnsupportedConversion if there is none."""
    if output in capabilities().get(media_type, []):
        for converter in CONVERTERS:
            if media_type in converter.media_types:
                return converter
    raise UnsupportedConversion(f"cannot convert {media_type or 'unknown content'} to {output}")
