"""PDF work done inside the isolated child: open, count, extract text, render, split.

Runs only in ``conversion_jobs.converters.child``; never import it in the worker. The child keeps
the last PDF it opened (``document``) so a session's pages do not re-parse the file; every page,
text page and bitmap is closed as soon as its page is written, so memory stays flat.
"""

from __future__ import annotations

import ctypes
import math
import os
import tempfile
from pathlib import Path

import pypdfium2 as pdfium
import pypdfium2.raw as pdfium_c

from .base import BODY, MAX_PAGE_SIDE_PT, PDF, PNG, TEXT_PLAIN, Limits
from .errors import (
    ConversionLostContent,
    EncryptedInput,
    InputTooLarge,
    InvalidInput,
    InvalidPassword,
)


def open_pdf(path: Path | str, password: str | None = None) -> pdfium.PdfDocument:
    """Open the PDF at ``path``. pdfium opens it by name (what ``pdfium.PdfDocument(path)``
    does, without its path resolution); the handle is then wrapped, so the rest of the code uses
    pypdfium2's document API. In a fresh converter child every Python object touched is a
    copy-on-write fault, so the hot path (this, ``pdf_prepare``, a text page) stays thin."""
    secret = None if password is None else (password + "\x00").encode("utf-8")
    raw = pdfium_c.FPDF_LoadDocument((str(path) + "\x00").encode("utf-8"), secret)
    if pdfium_c.FPDF_GetPageCount(raw) < 1:
        err_code = pdfium_c.FPDF_GetLastError()
        if raw:
            pdfium_c.FPDF_CloseDocument(raw)
        if err_code == pdfium_c.FPDF_ERR_PASSWORD:
            if password is not None:
                raise InvalidPassword()
            raise EncryptedInput()
        if err_code == pdfium_c.FPDF_ERR_SECURITY:
            raise EncryptedInput("the document uses an unsupported security handler")
        if err_code == pdfium_c.FPDF_ERR_FILE and not os.path.isfile(path):
            # No fault of the document's (the hand-in went wrong): a crash, retried, as before.
            raise FileNotFoundError(path)
        reason = _PDFIUM_ERRORS.get(err_code, f"error {err_code}")
        raise InvalidInput(f"not a readable PDF (Failed to load document (PDFium: {reason}).)")
    return pdfium.PdfDocument(raw)


#: pdfium's load errors (``FPDF_GetLastError``), as pypdfium2 names them.
_PDFIUM_ERRORS = {
    0: "Success",
    1: "Unknown error",
    2: "File access error",
    3: "Data format error",
    4: "Incorrect password error",
    5: "Unsupported security scheme error",
    6: "Page not found or content error",
}


_open: dict = {"key": None, "doc": None}


def document(path: Path | str, password: str | None = None) -> pdfium.PdfDocument:
    """The open document for ``path``, reused while the file is the same (size, mtime, inode).
    ``password`` opens an encrypted PDF; it is not kept (an open document needs it no more)."""
    st = os.stat(path)
    key = (str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if _open["key"] != key:
        close_document()
        _open["doc"] = open_pdf(path, password)
        _open["key"] = key
    return _open["doc"]


def close_document() -> None:
    doc, _open["doc"], _open["key"] = _open["doc"], None, None
    if doc is not None:
        doc.close()


#: A one-page PDF with a line of text (what tests/testdocs.pdf_bytes makes), for ``warm_up``.
_WARM_UP_PDF = (
    b"%PDF-1.7\n"
    b"%\xe2\xe3\xcf\xd3\n"
    b"3 0 obj\n"
    b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica /Encoding /WinAnsiEncoding >>\n"
    b"endobj\n"
    b"4 0 obj\n"
    b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] "
    b"/Resources << /Font << /F1 3 0 R >> >> /Contents 5 0 R >>\n"
    b"endobj\n"
    b"5 0 obj\n"
    b"<< /Length 47 >>\n"
    b"stream\n"
    b"BT /F1 12 Tf 14 TL 36 744.00 Td\n"
    b"(warm up) Tj\n"
    b"ET\n"
    b"endstream\n"
    b"endobj\n"
    b"2 0 obj\n"
    b"<< /Type /Pages /Kids [4 0 R] /Count 1 >>\n"
    b"endobj\n"
    b"1 0 obj\n"
    b"<< /Type /Catalog /Pages 2 0 R >>\n"
    b"endobj\n"
    b"xref\n"
    b"0 6\n"
    b"0000000000 65535 f \n"
    b"0000000392 00000 n \n"
    b"0000000335 00000 n \n"
    b"0000000015 00000 n \n"
    b"0000000112 00000 n \n"
    b"0000000238 00000 n \n"
    b"trailer\n"
    b"<< /Size 6 /Root 1 0 R >>\n"
    b"startxref\n"
    b"441\n"
    b"%%EOF\n"
)


def warm_up() -> None:
    """Run pdfium once over a generated one-page PDF (text and a tiny render) so its lazily
    initialised state (font mapper, caches) exists before the fork server forks: every child
    then starts with it instead of building it again (~1 ms of CPU per child)."""
    doc = pdfium.PdfDocument(_WARM_UP_PDF)
    try:
        _page_text(doc, 1)
        page = doc[0]
        page.render(scale=0.1).close()
        page.close()
    finally:
        doc.close()
    # A child's own path once, from a file as a child opens one: prepare and a text page (what
    # this touches first is then in place before the fork; ≈ 40 copy-on-write faults fewer per
    # child). Skipped where no temporary file can be written.
    try:
        with tempfile.TemporaryDirectory() as scratch:
            path = str(Path(scratch) / "warm-up.pdf")
            Path(path).write_bytes(_WARM_UP_PDF)
            pdf_prepare(path=path, limits=Limits())
            pdf_page(
                path=path,
                page=1,
                output="text",
                dpi=72,
                dest="",
                limits=Limits(),
                inline_max_bytes=1 << 16,
            )
            close_document()
    except OSError:
        close_document()


def pdf_prepare(*, path: str, limits: Limits, password: str | None = None) -> dict:
    """Open the PDF, count its pages and reject absurd page sizes (whole-document checks)."""
    doc = document(Path(path), password)
    count = len(doc)
    if count < 1:
        raise InvalidInput("the PDF has no pages")
    if count > limits.max_pages:
        raise InputTooLarge(f"{count} pages; the limit is {limits.max_pages}")
    for index in range(count):
        _check_page_size(doc, index)
    return {"page_count": count}


def pdf_require_text(*, path: str) -> None:
    """ConversionLostContent unless some page of the PDF at ``path`` has a non-blank
    character: an engine's PDF of a document with text (containers.office_scan) that has none
    lost the document (docs/API_CONTRACT.md §5). Stops at the first page with text."""
    doc = document(Path(path))
    for page in range(1, len(doc) + 1):
        text = _page_text(doc, page)
        if text and not text.isspace():
            return
    raise ConversionLostContent("the document has text; its PDF has none on any page", public=True)


def _check_page_size(doc: pdfium.PdfDocument, index: int) -> tuple[float, float]:
    try:
        width, height = doc.get_page_size(index)
    except pdfium.PdfiumError:
        raise InvalidInput(f"page {index + 1} is unreadable") from None
    if not (math.isfinite(width) and math.isfinite(height)) or width <= 0 or height <= 0:
        raise InvalidInput(f"page {index + 1} has an invalid size")
    if width > MAX_PAGE_SIDE_PT or height > MAX_PAGE_SIDE_PT:
        raise InputTooLarge(
            f"page {index + 1} is {width:.0f} x {height:.0f} pt; "
            f"the limit is {MAX_PAGE_SIDE_PT:.0f} pt per side"
        )
    return width, height


def pdf_page(
    *,
    path: str,
    page: int,
    output: str,
    dpi: int,
    dest: str,
    limits: Limits,
    password: str | None = None,
    inline_max_bytes: int = 0,
) -> dict:
    doc = document(path, password)  # a str: no Path built per page
    if not 1 <= page <= len(doc):
        raise InvalidInput(f"page {page} does not exist (the document has {len(doc)})")
    if output == "text":
        return _text(doc, page, dest, inline_max_bytes)
    if output == "png":
        return _render(doc, page, dpi, Path(dest), limits)
    if output == "pdf":
        return _split(path, page, Path(dest))
    raise ValueError(output)


def _text(doc: pdfium.PdfDocument, page: int, dest: Path | str, inline_max_bytes: int = 0) -> dict:
    """The page's text, written to ``dest``; or, when its UTF-8 is at most ``inline_max_bytes``,
    returned in the answer with no file (``body``: the UTF-8 bytes, which the child sends raw
    after the answer's line, see child.py): the worker stores them in its checkpoint row."""
    text = _page_text(doc, page)
    # pdfium separates lines with CRLF; the result is plain UTF-8 text with LF.
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\x00", "")
    encoded = text.encode("utf-8")
    if 0 < inline_max_bytes and len(encoded) <= inline_max_bytes:
        return {"media_type": TEXT_PLAIN, BODY: encoded}
    Path(dest).write_bytes(encoded)
    return {"media_type": TEXT_PLAIN}


def _page_text(doc: pdfium.PdfDocument, page: int) -> str:
    """The text of ``page`` (1-based): what pypdfium2's ``get_text_range()`` returns, read
    with pdfium's calls directly (no page and text-page wrapper objects: see ``open_pdf``).
    Characters pdfium leaves out of the text at either end of the page are skipped first, so it
    never reads beyond the range (pypdfium2 issue 261, crbug.com/pdfium/2079)."""
    raw_page = pdfium_c.FPDF_LoadPage(doc.raw, page - 1)
    if not raw_page:
        raise InvalidInput(f"page {page}: cannot extract text (Failed to load page.)")
    textpage = None
    try:
        textpage = pdfium_c.FPDFText_LoadPage(raw_page)
        if not textpage:
            raise InvalidInput(f"page {page}: cannot extract text (Failed to load text page.)")
        first, last = 0, pdfium_c.FPDFText_CountChars(textpage) - 1
        text_index = pdfium_c.FPDFText_GetTextIndexFromCharIndex
        while first <= last and text_index(textpage, first) == -1:
            first += 1
        if first > last:
            return ""
        while text_index(textpage, last) == -1:  # stops at ``first`` at the latest
            last -= 1
        size = text_index(textpage, last) + 2 - text_index(textpage, first)  # with the NUL
        buffer = (ctypes.c_ushort * size)()
        written = pdfium_c.FPDFText_GetText(textpage, first, last - first + 1, buffer)
        return bytes(memoryview(buffer)[: max(written - 1, 0)]).decode("utf-16-le", "ignore")
    finally:
        if textpage:
            pdfium_c.FPDFText_ClosePage(textpage)
        pdfium_c.FPDF_ClosePage(raw_page)


def render_size(width_pt: float, height_pt: float, dpi: int, max_pixels: int) -> tuple[int, int]:
    """Pixel size of a page at ``dpi``: round(pt * dpi / 72), shrunk to fit ``max_pixels``."""
    width = max(1, round(width_pt * dpi / 72))
    height = max(1, round(height_pt * dpi / 72))
    if width * height > max_pixels:
        shrink = math.sqrt(max_pixels / (width * height))
        width = max(1, math.floor(width * shrink))
        height = max(1, math.floor(height * shrink))
    return width, height


def _render(doc: pdfium.PdfDocument, page: int, dpi: int, dest: Path, limits: Limits) -> dict:
    dpi = max(1, min(int(dpi), limits.max_dpi))
    _check_page_size(doc, page - 1)
    pdf_page_obj = bitmap = image = None
    try:
        pdf_page_obj = doc[page - 1]
        width, height = render_size(
            pdf_page_obj.get_width(), pdf_page_obj.get_height(), dpi, limits.max_pixels
        )
        bitmap = pdfium.PdfBitmap.new_native(
            width, height, pdfium_c.FPDFBitmap_BGR, rev_byteorder=True
        )
        bitmap.fill_rect((255, 255, 255, 255), 0, 0, width, height)
        flags = pdfium_c.FPDF_ANNOT | pdfium_c.FPDF_REVERSE_BYTE_ORDER
        pdfium_c.FPDF_RenderPageBitmap(bitmap, pdf_page_obj, 0, 0, width, height, 0, flags)
        image = bitmap.to_pil()
        image.save(dest, format="PNG", compress_level=6)
    except pdfium.PdfiumError as exc:
        raise InvalidInput(f"page {page}: cannot render ({exc})") from None
    finally:
        # The PIL image shares the bitmap's buffer: close it first, then the bitmap, the page.
        for handle in (image, bitmap, pdf_page_obj):
            if handle is not None:
                handle.close()
    return {"media_type": PNG, "width": width, "height": height}


def _split(path: str, page: int, dest: Path) -> dict:
    # (function-level: pypdf costs ~0.2 s; the fork server preloads this module for every child,
    # and only a PDF page output splits)
    from pypdf import PdfReader, PdfWriter
    from pypdf.errors import PdfReadError

    try:
        reader = PdfReader(path)
        writer = PdfWriter()
        writer.add_page(reader.pages[page - 1])
        with open(dest, "wb") as fh:
            writer.write(fh)
    except (PdfReadError, IndexError, KeyError, ValueError) as exc:
        raise InvalidInput(f"page {page}: cannot extract ({exc})") from None
    return {"media_type": PDF}
