"""The check of an Office container (OOXML or ODF ZIP) before any engine reads it.

Runs inside the isolated converter child (``office_scan``), never in the worker: the document is
untrusted, and inflating it costs CPU and memory that belong under the child's limits and
deadline (docs/THREAT_MODEL.md, "Decompression bombs").

* What the central directory declares (what LibreOffice's package reader reads too) is checked
  first: all entries together may not inflate past ``max_inflated_bytes``, and an entry past
  ``inflate_ratio_min_bytes`` not more than ``max_inflate_ratio`` times its compressed size
  (``input_too_large``); nothing is inflated for a container that declares too much.
* The declared sizes are then verified, never trusted: every entry is inflated as a stream, in
  bounded chunks, from its local header, and stops at the first byte past its declared size.
  An entry that inflates to more or less than it declares (or to other bytes than its CRC-32
  says), whose deflate stream does not end within its compressed size, or that uses ZIP
  encryption or another method than stored or deflated is a malformed container
  (``invalid_input``). So a bomb costs at most the declared (and allowed) bytes' worth of
  inflating, whatever its headers say.
* While its main part is inflated anyway, the scan notes whether the document has text that a
  PDF of it must show (``has_text``, see ``_TextProbe``); the conversion then fails
  ``conversion_lost_content`` if the PDF has none (docs/API_CONTRACT.md §5).

No Django; imports nothing the child does not already have.
"""

from __future__ import annotations

import re
import struct
import zipfile
import zlib
from typing import IO
from xml.parsers import expat

from .base import DOCX, ODT, PPTX, XLSX, Limits
from .errors import InputTooLarge, InvalidInput

#: The media types whose documents are ZIP containers, checked here.
CONTAINER_TYPES = frozenset({DOCX, PPTX, XLSX, ODT})
#: Compressed bytes read (and inflated output asked for) at a time.
_CHUNK = 1 << 16
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, ..., name length, extra length
_LOCAL_MAGIC = b"PK\x03\x04"
_ENCRYPTED_FLAG = 0x1

_W = ("http://schemas.openxmlformats.org/wordprocessingml/2006/main",
      "http://purl.oclc.org/ooxml/wordprocessingml/main")  # fmt: skip
_A = ("http://schemas.openxmlformats.org/drawingml/2006/main",
      "http://purl.oclc.org/ooxml/drawingml/main")  # fmt: skip
_ODF_TEXT = "urn:oasis:names:tc:opendocument:xmlns:text:1.0"
_ODF_OFFICE = "urn:oasis:names:tc:opendocument:xmlns:office:1.0"


class _Probe:
    """What marks printed text in a part: elements whose character data is printed
    (``text``), elements whose subtree never is (``skip``: ODF tracked deletions, comments and
    hidden text), the local name of a root that may say ``show="0"`` (a hidden slide), and a
    run element (``run``) whose text a direct ``vanish`` property hides (Word's hidden text)."""

    def __init__(
        self,
        text: frozenset[str],
        skip: frozenset[str] = frozenset(),
        hidden_root: str = "",
        run: frozenset[str] = frozenset(),
        vanish: frozenset[str] = frozenset(),
    ) -> None:
        self.text, self.skip, self.hidden_root = text, skip, hidden_root
        self.run, self.vanish = run, vanish


def _names(namespaces: tuple[str, ...], *local: str) -> frozenset[str]:
    return frozenset(f"{ns} {name}" for ns in namespaces for name in local)


#: Word: runs' text (``w:t``; deleted text is ``w:delText``, field codes ``w:instrText``).
_DOCX_PROBE = _Probe(
    _names(_W, "t"), run=_names(_W, "r"), vanish=_names(_W, "vanish", "specVanish")
)
#: Impress: DrawingML text of a slide that is shown (``<p:sld show="0">`` is not exported).
_PPTX_PROBE = _Probe(_names(_A, "t"), hidden_root="sld")
#: ODF: paragraphs and headings, not tracked changes (deleted text) nor annotations (comments).
_ODT_PROBE = _Probe(
    _names((_ODF_TEXT,), "p", "h", "span"),
    _names((_ODF_TEXT,), "tracked-changes", "hidden-text", "hidden-paragraph")
    | _names((_ODF_OFFICE,), "annotation"),
)
_OFF = ("0", "false", "off")
_SLIDE = re.compile(r"ppt/slides/slide[0-9]+\.xml")


def _probe_for(media_type: str, name: str) -> _Probe | None:
    """The text probe of part ``name``. Spreadsheets get none: a sheet's cells may lie outside
    its print area or in hidden sheets, so a PDF without text proves nothing."""
    if media_type == DOCX and name == "word/document.xml":
        return _DOCX_PROBE
    if media_type == PPTX and _SLIDE.fullmatch(name):
        return _PPTX_PROBE
    if media_type == ODT and name == "content.xml":
        return _ODT_PROBE
    return None


class _Found(Exception):
    pass


class _Malformed(ValueError):
    """What makes a container malformed; its message is a fixed phrase (a public detail)."""


class _TextProbe:
    """Feeds a part to expat until its first printed non-blank character (``found``), or until
    the part cannot tell (a DTD, malformed XML: ``gave_up``; the scan then claims nothing).
    Character data is never kept, only looked at."""

    def __init__(self, probe: _Probe) -> None:
        self.probe, self.found, self.gave_up = probe, False, False
        self._in_text = self._skipping = self._in_run = 0
        self._run_hidden = False
        self._parser = expat.ParserCreate(namespace_separator=" ")
        self._parser.SetParamEntityParsing(expat.XML_PARAM_ENTITY_PARSING_NEVER)
        self._parser.StartDoctypeDeclHandler = self._refuse_dtd
        self._parser.StartElementHandler = self._start
        self._parser.EndElementHandler = self._end
        self._parser.CharacterDataHandler = self._characters
        self._root = True

    @property
    def done(self) -> bool:
        return self.found or self.gave_up

    def feed(self, data: bytes, final: bool = False) -> None:
        if self.done:
            return
        try:
            self._parser.Parse(data, final)
        except _Found:
            self.found = True
        except (expat.ExpatError, ValueError):
            self.gave_up = True

    def _refuse_dtd(self, *_args: object) -> None:
        raise ValueError("a DTD in an Office part")

    def _start(self, name: str, attrs: dict[str, str]) -> None:
        if self._root:
            self._root = False
            hidden = attrs.get("show") in ("0", "false")
            if hidden and name.rsplit(" ", 1)[-1] == self.probe.hidden_root:
                raise ValueError("a hidden slide: its text is not exported")
        if self._skipping or name in self.probe.skip:
            self._skipping += 1
        elif name in self.probe.text:
            self._in_text += 1
        elif name in self.probe.run:
            self._in_run += 1
            self._run_hidden = False
        elif name in self.probe.vanish and self._in_run:
            value = next((v for k, v in attrs.items() if k.endswith(" val")), "true")
            self._run_hidden = value not in _OFF

    def _end(self, name: str) -> None:
        if self._skipping:
            self._skipping -= 1
        elif name in self.probe.text:
            self._in_text -= 1
        elif name in self.probe.run:
            self._in_run -= 1
            self._run_hidden = False

    def _characters(self, data: str) -> None:
        if self._in_text and not self._skipping and not self._run_hidden and not data.isspace():
            raise _Found


def office_scan(*, path: str, media_type: str, limits: Limits) -> dict:
    """Check the container at ``path`` against the limits (see the module docstring). Returns
    ``{"has_text": bool}``; ``has_text`` is False for a type that is not a container, for a
    spreadsheet and for a document whose text could not be told."""
    if media_type not in CONTAINER_TYPES:
        return {"has_text": False}
    try:
        with open(path, "rb") as fh, zipfile.ZipFile(fh) as zf:
            infos = zf.infolist()
            _check_declared(infos, limits)
            has_text = False
            for info in infos:
                probe = _probe_for(media_type, info.filename)
                text = _TextProbe(probe) if probe is not None and not has_text else None
                _inflate(fh, info, text=text)
                has_text = has_text or (text is not None and text.found)
    except _Malformed as exc:
        raise InvalidInput(f"not a readable Office container ({exc})", public=True) from None
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, ValueError):
        # (zipfile's own messages may quote the container's entry names: not public)
        raise InvalidInput("not a readable Office container", public=True) from None
    return {"has_text": has_text}


def _check_declared(infos: list[zipfile.ZipInfo], limits: Limits) -> None:
    """What the central directory declares, before anything is inflated."""
    declared = sum(info.file_size for info in infos)
    if declared > limits.max_inflated_bytes:
        raise InputTooLarge(
            f"the container declares {declared} inflated bytes; the limit is "
            f"{limits.max_inflated_bytes}",
            public=True,
        )
    for info in infos:
        if info.file_size > limits.inflate_ratio_min_bytes and info.file_size > (
            limits.max_inflate_ratio * max(info.compress_size, 1)
        ):
            raise InputTooLarge(
                f"a part inflates more than {limits.max_inflate_ratio} times its compressed size",
                public=True,
            )


def _inflate(fh: IO[bytes], info: zipfile.ZipInfo, *, text: _TextProbe | None) -> None:
    """Inflate one entry from its local header, in bounded chunks, to verify its declared size
    (on which the limits were checked); stops at the first byte past it. ``text`` sees the
    inflated bytes as they come."""
    if info.flag_bits & _ENCRYPTED_FLAG:
        raise _Malformed("a part uses ZIP encryption")
    if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
        raise _Malformed(f"a part uses compression method {info.compress_type}")
    fh.seek(info.header_offset)
    magic, name_length, extra_length = _LOCAL_HEADER.unpack(fh.read(_LOCAL_HEADER.size))
    if magic != _LOCAL_MAGIC:
        raise _Malformed("a part's local header is missing")
    fh.seek(name_length + extra_length, 1)
    inflater = zlib.decompressobj(-zlib.MAX_WBITS) if info.compress_type else None
    left, inflated, crc = info.compress_size, 0, 0

    def take(data: bytes) -> None:
        nonlocal inflated, crc
        inflated += len(data)
        crc = zlib.crc32(data, crc)
        if inflated > info.file_size:
            raise _Malformed("a part inflates past its declared size")
        if text is not None:
            text.feed(data)

    while left > 0:
        chunk = fh.read(min(_CHUNK, left))
        if not chunk:
            raise _Malformed("a part is truncated")
        left -= len(chunk)
        if inflater is None:
            take(chunk)
            continue
        try:
            # Never more than _CHUNK of output at a time: a bomb's chunk stays a chunk. A full
            # output may leave more to come from the input already given: ask until it is less.
            while True:
                out = inflater.decompress(chunk, _CHUNK)
                take(out)
                chunk = inflater.unconsumed_tail
                if inflater.eof or (not chunk and len(out) < _CHUNK):
                    break
        except zlib.error as exc:
            raise _Malformed(f"a part's data is damaged ({exc})") from None
        if inflater.eof:
            break
    if inflater is not None and not inflater.eof:
        raise _Malformed("a part's data ends before its deflate stream")
    if inflated != info.file_size:
        raise _Malformed("a part inflates to less than its declared size")
    if crc != info.CRC:
        raise _Malformed("a part's CRC-32 does not match its data")
    if text is not None:
        text.feed(b"", final=True)
