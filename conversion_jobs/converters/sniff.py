"""Media type from the bytes. The declared type and the file name are never trusted."""

from __future__ import annotations

import zipfile
from pathlib import Path

from .base import DOC, DOCX, JPEG, ODT, PDF, PNG, PPTX, RTF, TIFF, XLSX

_HEAD_BYTES = 4096
#: PDF readers (and pdfium) accept the header anywhere in the first 1024 bytes.
_PDF_HEADER_WINDOW = 1024
_OLE2_MAGIC = bytes.fromhex("d0cf11e0a1b11ae1")
_ZIP_MAGICS = (b"PK\x03\x04", b"PK\x05\x06")
#: A real office document has at most a few thousand parts; more is not worth parsing here.
_MAX_ZIP_ENTRIES = 20_000

_OOXML_MAIN_PARTS = (
    ("word/document.xml", DOCX),
    ("ppt/presentation.xml", PPTX),
    ("xl/workbook.xml", XLSX),
)


def sniff_media_type(path: Path) -> str | None:
    """Real media type from the bytes (declared type is never trusted); None for anything else.

    Reads at most a few KB, plus the central directory of a ZIP.
    """
    try:
        with open(path, "rb") as fh:
            head = fh.read(_HEAD_BYTES)
    except OSError:
        return None
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return PNG
    if head.startswith(b"\xff\xd8\xff"):
        return JPEG
    if head.startswith((b"II*\x00", b"MM\x00*")):
        return TIFF
    if head.startswith(b"{\\rtf"):
        return RTF
    if head.startswith(_OLE2_MAGIC):
        return DOC
    if head.startswith(_ZIP_MAGICS):
        return _sniff_zip(path)
    # Checked last: a ZIP or TIFF may well contain a stored PDF in its first kilobyte.
    if b"%PDF-" in head[:_PDF_HEADER_WINDOW]:
        return PDF
    return None


def _sniff_zip(path: Path) -> str | None:
    try:
        with zipfile.ZipFile(path) as zf:
            infos = zf.infolist()
            if len(infos) > _MAX_ZIP_ENTRIES:
                return None
            names = {info.filename for info in infos}
            if "mimetype" in names:
                with zf.open("mimetype") as fh:
                    mimetype = fh.read(100).decode("ascii", "replace").strip()
                if mimetype == ODT:
                    return ODT
                return None
            if "[Content_Types].xml" not in names:
                return None
            for part, media_type in _OOXML_MAIN_PARTS:
                if part in names:
                    return media_type
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError):
        return None
    return None
