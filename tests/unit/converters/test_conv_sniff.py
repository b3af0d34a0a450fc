import zipfile
from pathlib import Path

import pytest

from conversion_jobs.converters import sniff_media_type
from conversion_jobs.converters.base import DOC, DOCX, JPEG, ODT, PDF, PNG, PPTX, RTF, TIFF, XLSX
from tests import testdocs


def _ooxml(path: Path, main_part: str) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("[Content_Types].xml", "<Types/>")
        zf.writestr(main_part, "<x/>")
    return path


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda p: testdocs.make_pdf(p, pages=1), PDF),
        (lambda p: testdocs.make_png(p), PNG),
        (lambda p: testdocs.make_jpeg(p), JPEG),
        (lambda p: testdocs.make_tiff(p), TIFF),
        (lambda p: testdocs.make_docx(p, paragraphs=["x"]), DOCX),
        (lambda p: testdocs.make_odt(p, paragraphs=["x"]), ODT),
        (lambda p: testdocs.make_rtf(p, paragraphs=["x"]), RTF),
        (lambda p: _ooxml(p, "ppt/presentation.xml"), PPTX),
        (lambda p: _ooxml(p, "xl/workbook.xml"), XLSX),
        (lambda p: p.write_bytes(bytes.fromhex("d0cf11e0a1b11ae1") + bytes(600)) and p, DOC),
        (lambda p: testdocs.make_png_bomb(p), PNG),
        (lambda p: testdocs.make_encrypted_pdf(p), PDF),
    ],
)
def test_sniff_media_type__known_types(tmp_path, make, expected):
    path = tmp_path / "upload.bin"
    make(path)
    assert sniff_media_type(path) == expected


@pytest.mark.parametrize(
    "make",
    [
        testdocs.make_zip_as_pdf,  # a ZIP holding a PDF, declared as PDF
        testdocs.make_wrong_magic,
        lambda p: p.write_bytes(b""),
        lambda p: p.write_text("hello, plain text"),
        lambda p: p.write_bytes(b"PK\x03\x04 truncated zip"),
        lambda p: _ooxml(p, "unknown/main.xml"),
    ],
)
def test_sniff_media_type__unknown_is_none(tmp_path, make):
    path = tmp_path / "upload.pdf"
    make(path)
    assert sniff_media_type(path) is None


def test_sniff_media_type__odf_other_than_text_is_none(tmp_path):
    path = tmp_path / "sheet.ods"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("mimetype", "application/vnd.oasis.opendocument.spreadsheet")
    assert sniff_media_type(path) is None


def test_sniff_media_type__missing_file_is_none(tmp_path):
    assert sniff_media_type(tmp_path / "nope") is None
