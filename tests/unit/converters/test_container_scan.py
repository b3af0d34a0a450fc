"""containers.office_scan: the limits on what an Office container inflates to, the guard
against headers that lie about it, and whether the document has text its PDF must show."""

from __future__ import annotations

import time
import zipfile
from pathlib import Path

import pytest

from conversion_jobs.converters import InputTooLarge, InvalidInput, Limits
from conversion_jobs.converters.base import DOCX, ODT, PPTX, RTF, XLSX
from conversion_jobs.converters.containers import office_scan
from tests import testdocs

MIB = 1 << 20
_W = 'xmlns:w="http://schemas.openxmlformats.org/wordprocessingml/2006/main"'


def _scan(path: Path, media_type: str = DOCX, **limits: int) -> dict:
    return office_scan(path=str(path), media_type=media_type, limits=Limits(**limits))


def _zip(path: Path, parts: dict[str, str | bytes], method: int = zipfile.ZIP_DEFLATED) -> Path:
    with zipfile.ZipFile(path, "w", compression=method) as zf:
        for name, data in parts.items():
            zf.writestr(name, data)
    return path


def _docx_body(path: Path, body: str) -> Path:
    return _zip(
        path, {"word/document.xml": f"<w:document {_W}><w:body>{body}</w:body></w:document>"}
    )


def test_office_scan__the_gib_bomb__input_too_large_from_its_declared_size(tmp_path):
    bomb = testdocs.make_docx_bomb(tmp_path / "bomb.docx")
    assert bomb.stat().st_size < 2 * MIB
    started = time.monotonic()
    with pytest.raises(InputTooLarge, match=r"declares 10[0-9]{8} inflated bytes"):
        _scan(bomb)
    assert time.monotonic() - started < 1  # refused from the directory: nothing inflated


def test_office_scan__total_over_the_limit__input_too_large(tmp_path):
    source = testdocs.make_docx_bomb(tmp_path / "b.docx", inflated=12 * MIB)
    with pytest.raises(InputTooLarge, match="the limit is 8388608"):
        _scan(source, max_inflated_bytes=8 * MIB, max_inflate_ratio=10**6)
    assert _scan(source, max_inflated_bytes=16 * MIB, max_inflate_ratio=10**6) == {"has_text": True}


def test_office_scan__ratio_over_the_limit_past_its_floor__input_too_large(tmp_path):
    source = testdocs.make_docx_bomb(tmp_path / "b.docx", inflated=12 * MIB)  # ~1000:1
    with pytest.raises(InputTooLarge, match="more than 100 times"):
        _scan(source)
    # the same ratio below the floor is a small part: allowed
    assert _scan(source, inflate_ratio_min_bytes=16 * MIB) == {"has_text": True}


def test_office_scan__header_lying_about_the_size__invalid_input(tmp_path):
    liar = testdocs.make_docx_bomb(tmp_path / "liar.docx", declared=4096)
    with zipfile.ZipFile(liar) as zf:  # a reader trusting the headers sees a short, sound part
        assert len(zf.read("word/document.xml")) == 4096
    started = time.monotonic()
    with pytest.raises(InvalidInput, match="inflates past its declared size"):
        _scan(liar)
    assert time.monotonic() - started < 1  # stopped at the first chunk past 4096 bytes


def test_office_scan__header_declaring_more_than_the_data__invalid_input(tmp_path):
    source = testdocs.make_docx_bomb(tmp_path / "b.docx", inflated=2 * MIB)
    _patch_sizes(source, "word/document.xml", declared=3 * MIB)
    with pytest.raises(InvalidInput, match="less than its declared size"):
        _scan(source, max_inflate_ratio=10**6)


def _patch_sizes(path: Path, name: str, *, declared: int) -> None:
    """Rewrite ``name``'s uncompressed size in its local and central headers."""
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo(name)
    data = bytearray(path.read_bytes())
    old, new = (size.to_bytes(4, "little") for size in (info.file_size, declared))
    local = info.header_offset + 22
    assert data[local : local + 4] == old
    data[local : local + 4] = new
    central = data.find(b"PK\x01\x02")
    while central != -1:
        if data[central + 46 : central + 46 + len(name)] == name.encode():
            assert data[central + 24 : central + 28] == old
            data[central + 24 : central + 28] = new
        central = data.find(b"PK\x01\x02", central + 4)
    path.write_bytes(bytes(data))


def _overwrite_data(path: Path, name: str, at: float, data: bytes) -> Path:
    """Overwrite ``name``'s compressed data at fraction ``at`` of it with ``data``."""
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo(name)
    raw = bytearray(path.read_bytes())
    start = info.header_offset + 30 + len(name) + len(info.extra)
    where = start + int(info.compress_size * at)
    raw[where : where + len(data)] = data
    path.write_bytes(bytes(raw))
    return path


@pytest.mark.parametrize(
    "damage",
    [
        lambda p: p.write_bytes(p.read_bytes()[:-300]),  # the directory cut
        lambda p: _overwrite_data(p, "word/document.xml", 0.5, b"\xff" * 32),
        lambda p: _overwrite_data(p, "word/document.xml", 0.999, b"\x00"),
    ],
)
def test_office_scan__damaged_container__invalid_input(tmp_path, damage):
    words = " ".join(f"word{n}" for n in range(5000))
    source = _docx_body(tmp_path / "d.docx", f"<w:p><w:r><w:t>{words}</w:t></w:r></w:p>")
    damage(source)
    with pytest.raises(InvalidInput, match="not a readable Office container"):
        _scan(source)


def test_office_scan__data_not_matching_its_crc__invalid_input(tmp_path):
    source = _docx_body(tmp_path / "c.docx", "<w:p><w:r><w:t>words</w:t></w:r></w:p>")
    with zipfile.ZipFile(source) as zf:
        info = zf.getinfo("word/document.xml")
    raw = bytearray(source.read_bytes())
    for at in (info.header_offset + 14, raw.find(b"PK\x01\x02") + 16):  # local, central CRC
        raw[at] ^= 0xFF
    source.write_bytes(bytes(raw))
    with pytest.raises(InvalidInput, match="CRC-32 does not match"):
        _scan(source)


def test_office_scan__unsupported_compression_method__invalid_input(tmp_path):
    source = _zip(tmp_path / "bz.docx", {"word/document.xml": "<x/>"}, zipfile.ZIP_BZIP2)
    with pytest.raises(InvalidInput, match="compression method 12"):
        _scan(source)


def test_office_scan__a_real_docx__passes_with_its_text(tmp_path):
    assert _scan(testdocs.make_docx(tmp_path / "a.docx", paragraphs=["words"])) == {
        "has_text": True
    }


@pytest.mark.parametrize(
    ("body", "has_text"),
    [
        ("<w:p><w:r><w:t>seen</w:t></w:r></w:p>", True),
        ("<w:p/><w:p><w:r><w:t xml:space='preserve'>  </w:t></w:r></w:p>", False),
        ("<w:p><w:r><w:rPr><w:vanish/></w:rPr><w:t>hidden</w:t></w:r></w:p>", False),
        ("<w:p><w:r><w:rPr><w:vanish w:val='0'/></w:rPr><w:t>shown</w:t></w:r></w:p>", True),
        ("<w:p><w:pPr><w:rPr><w:vanish/></w:rPr></w:pPr><w:r><w:t>run</w:t></w:r></w:p>", True),
        ("<w:p><w:del><w:r><w:delText>deleted</w:delText></w:r></w:del></w:p>", False),
        ("<w:p><w:r><w:instrText>PAGE</w:instrText></w:r></w:p>", False),
        ("<w:p><w:r></w:p><w:t>after</w:t>", False),  # malformed: cannot tell, claims nothing
    ],
)
def test_office_scan__docx_text__only_printed_runs_count(tmp_path, body, has_text):
    assert _scan(_docx_body(tmp_path / "t.docx", body)) == {"has_text": has_text}


def test_office_scan__docx_with_a_dtd__claims_no_text(tmp_path):
    xml = (
        '<?xml version="1.0"?><!DOCTYPE d [<!ENTITY e "entity">]>'
        f"<w:document {_W}><w:body><w:p><w:r><w:t>&e;</w:t></w:r></w:p></w:body></w:document>"
    )
    assert _scan(_zip(tmp_path / "dtd.docx", {"word/document.xml": xml})) == {"has_text": False}


def test_office_scan__odt_text__paragraphs_but_not_comments(tmp_path):
    assert _scan(testdocs.make_odt(tmp_path / "a.odt", paragraphs=["words"]), ODT) == {
        "has_text": True
    }
    annotated = (
        '<office:document-content xmlns:office="urn:oasis:names:tc:opendocument:xmlns:office:1.0"'
        ' xmlns:text="urn:oasis:names:tc:opendocument:xmlns:text:1.0"><office:body><office:text>'
        "<text:p><office:annotation><text:p>a comment</text:p></office:annotation></text:p>"
        "</office:text></office:body></office:document-content>"
    )
    source = testdocs._odt_package(tmp_path / "c.odt", annotated)
    assert _scan(source, ODT) == {"has_text": False}


def test_office_scan__pptx_text__shown_slides_only(tmp_path):
    ns = (
        'xmlns:p="http://schemas.openxmlformats.org/presentationml/2006/main" '
        'xmlns:a="http://schemas.openxmlformats.org/drawingml/2006/main"'
    )
    slide = "<p:sld {ns}{show}><p:cSld><a:p><a:r><a:t>title</a:t></a:r></a:p></p:cSld></p:sld>"
    shown = _zip(tmp_path / "s.pptx", {"ppt/slides/slide1.xml": slide.format(ns=ns, show="")})
    hidden = _zip(
        tmp_path / "h.pptx", {"ppt/slides/slide1.xml": slide.format(ns=ns, show=' show="0"')}
    )
    assert _scan(shown, PPTX) == {"has_text": True}
    assert _scan(hidden, PPTX) == {"has_text": False}


def test_office_scan__spreadsheets_and_non_containers__claim_no_text(tmp_path):
    sheet = _zip(tmp_path / "x.xlsx", {"xl/sharedStrings.xml": "<sst><si><t>cell</t></si></sst>"})
    assert _scan(sheet, XLSX) == {"has_text": False}
    rtf = testdocs.make_rtf(tmp_path / "r.rtf", paragraphs=["words"])
    assert _scan(rtf, RTF) == {"has_text": False}
