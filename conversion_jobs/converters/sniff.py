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


def office_encrypted(path: Path) -> bool | None:
    """Whether an Office file is password-protected: True, False, or None when this cannot tell.

    * ODF (ZIP with ``mimetype``): the manifest lists ``encryption-data`` for encrypted parts;
    * OLE2: an encrypted OOXML file is an OLE2 container with ``EncryptedPackage``; a Word 97
      ``.doc`` sets ``fEncrypted`` (0x0100) in its FIB. Only the first directory sectors are read.
    Reads a few KB; never raises for a damaged file (None)."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(8)
            if head.startswith(_ZIP_MAGICS):
                return _odf_encrypted(path)
            if head.startswith(_OLE2_MAGIC):
                return _ole2_encrypted(fh)
    except (OSError, ValueError, zipfile.BadZipFile):
        return None
    return False


def _odf_encrypted(path: Path) -> bool:
    with zipfile.ZipFile(path) as zf:
        try:
            info = zf.getinfo("META-INF/manifest.xml")
        except KeyError:
            return False
        if info.file_size > 1 << 20:
            raise ValueError("manifest too large")
        return b"encryption-data" in zf.read(info)


def _ole2_encrypted(fh) -> bool | None:
    fh.seek(0)
    header = fh.read(512)
    sector = 1 << int.from_bytes(header[0x1E:0x20], "little")
    first_dir = int.from_bytes(header[0x30:0x34], "little")
    if sector not in (512, 4096):
        return None
    fh.seek((first_dir + 1) * sector)
    directory = fh.read(4 * sector)  # directory sectors are usually contiguous; a few suffice
    for offset in range(0, len(directory) - 127, 128):
        entry = directory[offset : offset + 128]
        length = int.from_bytes(entry[0x40:0x42], "little")
        name = entry[: max(0, length - 2)].decode("utf-16-le", "replace")
        if name in ("EncryptedPackage", "EncryptionInfo"):
            return True
        if name == "WordDocument":
            start = int.from_bytes(entry[0x74:0x78], "little")
            fh.seek((start + 1) * sector + 0x0A)
            flags = int.from_bytes(fh.read(2), "little")
            return bool(flags & 0x0100)
    return None
