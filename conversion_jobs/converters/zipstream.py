"""A deterministic, streaming ZIP writer for PNG results (ADR 0018, session-4 "zipres").

The bytes are a pure function of the pages' numbers and bytes: ``ZIP_STORED``, arcname
``page-0001.png`` ..., fixed timestamp (1980-01-01 00:00) and attributes, CRC-32 and sizes in a
data descriptor after each entry (so nothing is read twice), ZIP64 records only when a size,
an offset or the entry count needs them. The worker hashes these bytes at publish without
storing them; the web streams the same bytes from the page objects.

The length is known before a byte is read (:func:`zip_length`), so a response can announce it;
a page whose bytes do not have the announced size raises :class:`PageChanged` mid-stream.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

CHUNK = 1024 * 1024
_U32 = 0xFFFFFFFF
_U16 = 0xFFFF
_DOS_TIME = 0
_DOS_DATE = (0 << 9) | (1 << 5) | 1  # 1980-01-01
_FLAGS = 0x0008  # sizes and CRC-32 in a data descriptor
_MADE_BY = (3 << 8) | 45  # Unix, spec 4.5
_EXTERNAL = (0o100644 << 16) & _U32  # a regular file, rw-r--r--


class Readable(Protocol):
    def read(self, size: int, /) -> bytes: ...


class PageChanged(OSError):
    """A page's bytes are not the size the archive announced (it changed or vanished)."""


@dataclass(frozen=True)
class Entry:
    page: int
    size: int
    open: Callable[[], AbstractContextManager[Readable]]


def arcname(page: int) -> bytes:
    return f"page-{page:04d}.png".encode("ascii")


def _zip64_entry(size: int) -> bool:
    return size >= _U32


def zip_length(entries: list[tuple[int, int]]) -> int:
    """The archive's length for ``(page, size)`` entries in order, without reading a byte."""
    offset = 0
    central = 0
    for page, size in entries:
        name = len(arcname(page))
        big = _zip64_entry(size)
        local_offset = offset
        offset += 30 + name + (20 if big else 0) + size + (24 if big else 16)
        extra = (16 if big else 0) + (8 if local_offset >= _U32 else 0)
        central += 46 + name + (4 + extra if extra else 0)
    return offset + central + _end_length(len(entries), central, offset)


def _end_length(count: int, cd_size: int, cd_offset: int) -> int:
    if count >= _U16 or cd_size >= _U32 or cd_offset >= _U32:
        return 56 + 20 + 22
    return 22


def zip_chunks(entries: list[Entry]) -> Iterator[bytes]:
    """The archive's bytes, in chunks, for ``entries`` in their given order."""
    offset = 0
    central: list[bytes] = []
    for entry in entries:
        name = arcname(entry.page)
        big = _zip64_entry(entry.size)
        local_extra = struct.pack("<HHQQ", 0x0001, 16, 0, 0) if big else b""
        header = struct.pack(
            "<IHHHHHIIIHH",
            0x04034B50,
            45 if big else 20,
            _FLAGS,
            0,  # stored
            _DOS_TIME,
            _DOS_DATE,
            0,
            _U32 if big else 0,
            _U32 if big else 0,
            len(name),
            len(local_extra),
        )
        yield header + name + local_extra
        local_offset = offset
        offset += len(header) + len(name) + len(local_extra)
        crc = 0
        read = 0
        with entry.open() as fh:
            while chunk := fh.read(CHUNK):
                read += len(chunk)
                if read > entry.size:
                    raise PageChanged("a page is larger than recorded")
                crc = zlib.crc32(chunk, crc)
                yield chunk
        if read != entry.size:
            raise PageChanged("a page is smaller than recorded")
        offset += read
        if big:
            descriptor = struct.pack("<IIQQ", 0x08074B50, crc, read, read)
        else:
            descriptor = struct.pack("<IIII", 0x08074B50, crc, read, read)
        yield descriptor
        offset += len(descriptor)
        fields = b""
        if big:
            fields += struct.pack("<QQ", read, read)
        if local_offset >= _U32:
            fields += struct.pack("<Q", local_offset)
        extra = struct.pack("<HH", 0x0001, len(fields)) + fields if fields else b""
        central.append(
            struct.pack(
                "<IHHHHHHIIIHHHHHII",
                0x02014B50,
                _MADE_BY,
                45 if extra else 20,
                _FLAGS,
                0,
                _DOS_TIME,
                _DOS_DATE,
                crc,
                _U32 if big else read,
                _U32 if big else read,
                len(name),
                len(extra),
                0,
                0,
                0,
                _EXTERNAL,
                _U32 if local_offset >= _U32 else local_offset,
            )
            + name
            + extra
        )
    directory = b"".join(central)
    count = len(entries)
    cd_offset = offset
    end = b""
    if count >= _U16 or len(directory) >= _U32 or cd_offset >= _U32:
        zip64_end_offset = cd_offset + len(directory)
        end += struct.pack(
            "<IQHHIIQQQQ",
            0x06064B50,
            44,
            _MADE_BY,
            45,
            0,
            0,
            count,
            count,
            len(directory),
            cd_offset,
        )
        end += struct.pack("<IIQI", 0x07064B50, 0, zip64_end_offset, 1)
    end += struct.pack(
        "<IHHHHIIH",
        0x06054B50,
        0,
        0,
        min(count, _U16),
        min(count, _U16),
        min(len(directory), _U32),
        min(cd_offset, _U32),
        0,
    )
    yield directory + end
