"""Media type from the bytes. The declared type and the file name are never trusted."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path
from typing import IO

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
    return _sniff_head(head, path)


def sniff_media_type_bytes(data: bytes) -> str | None:
    """:func:`sniff_media_type` of a source held in memory (an inline upload)."""
    return _sniff_head(data[:_HEAD_BYTES], io.BytesIO(data))


def _sniff_head(head: bytes, whole: Path | IO[bytes]) -> str | None:
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
        return _sniff_zip(whole)
    # Checked last: a ZIP or TIFF may well contain a stored PDF in its first kilobyte.
    if b"%PDF-" in head[:_PDF_HEADER_WINDOW]:
        return PDF
    return None


def _sniff_zip(whole: Path | IO[bytes]) -> str | None:
    try:
        with zipfile.ZipFile(whole) as zf:
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
      ``.doc`` sets ``fEncrypted`` (0x0100) in its FIB (the directory is read along its FAT
      chain).
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


#: Bounds for reading an OLE2 (compound file) directory: enough for any real Office file.
_MAX_OLE2_SECTORS = 4096
_ENDOFCHAIN = 0xFFFFFFFE


def _ole2_encrypted(fh) -> bool | None:
    """Walk the compound file's directory (its FAT chain) for the names that say encrypted."""
    fh.seek(0)
    header = fh.read(512)
    sector = 1 << int.from_bytes(header[0x1E:0x20], "little")
    if sector not in (512, 4096):
        return None

    def read_sector(number: int) -> bytes:
        fh.seek((number + 1) * sector)
        return fh.read(sector)

    def u32s(data: bytes) -> list[int]:
        return [int.from_bytes(data[i : i + 4], "little") for i in range(0, len(data) - 3, 4)]

    fat_sectors = u32s(header[0x4C:0x200])  # the first 109 DIFAT entries
    difat, difat_count = (int.from_bytes(header[o : o + 4], "little") for o in (0x44, 0x48))
    for _ in range(min(difat_count, _MAX_OLE2_SECTORS)):
        if difat >= _ENDOFCHAIN:
            break
        entries = u32s(read_sector(difat))
        fat_sectors += entries[:-1]
        difat = entries[-1]
    fat: list[int] = []
    for number in fat_sectors[:_MAX_OLE2_SECTORS]:
        if number < _ENDOFCHAIN - 1:
            fat += u32s(read_sector(number))
    directory, current = b"", int.from_bytes(header[0x30:0x34], "little")
    for _ in range(_MAX_OLE2_SECTORS):
        if current >= len(fat) or current >= _ENDOFCHAIN:
            break
        directory += read_sector(current)
        current = fat[current]

    def chain_offset(first: int, position: int) -> int | None:
        """File offset of byte ``position`` of the regular-sector chain starting at ``first``."""
        current = first
        for _ in range(position // sector):
            if current >= len(fat):
                return None
            current = fat[current]
        if current >= _ENDOFCHAIN or current >= len(fat):
            return None
        return (current + 1) * sector + position % sector

    mini_cutoff = int.from_bytes(header[0x38:0x3C], "little")
    root_start = int.from_bytes(directory[0x74:0x78], "little") if directory else _ENDOFCHAIN
    for offset in range(0, len(directory) - 127, 128):
        entry = directory[offset : offset + 128]
        length = int.from_bytes(entry[0x40:0x42], "little")
        name = entry[: max(0, min(length, 64) - 2)].decode("utf-16-le", "replace")
        if name in ("EncryptedPackage", "EncryptionInfo"):
            return True
        if name == "WordDocument":
            start = int.from_bytes(entry[0x74:0x78], "little")
            size = int.from_bytes(entry[0x78:0x7C], "little")
            # A stream below the cutoff lives in the mini stream (64-byte sectors kept in the
            # root entry's chain); the FIB's flags (offset 0x0A) are in its first sector.
            if size < mini_cutoff:
                where = chain_offset(root_start, start * 64 + 0x0A)
            else:
                where = (start + 1) * sector + 0x0A
            if where is None:
                return None
            fh.seek(where)
            return bool(int.from_bytes(fh.read(2), "little") & 0x0100)
    return None
