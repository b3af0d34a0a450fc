import pypdfium2 as pdfium
import pytest
from pypdf import PdfReader

from conversion_jobs.converters import assemble_result
from tests import testdocs


def test_assemble_result__text_joined_by_form_feed_in_page_order(tmp_path):
    pages = []
    for n in (3, 1, 2):
        path = tmp_path / f"p{n}.txt"
        path.write_text(f"page {n} é", encoding="utf-8")
        pages.append((n, path))
    media_type = assemble_result(
        output="text", pages=pages, dest=tmp_path / "r", prepared_document=None
    )
    assert media_type == "text/plain; charset=utf-8"
    assert (tmp_path / "r").read_text(encoding="utf-8") == "page 1 é\fpage 2 é\fpage 3 é"


def test_assemble_result__png_is_never_assembled(tmp_path):
    """A PNG result is the ZIP of its page objects (``zipstream``, whose tests hold its names):
    nothing writes it as a file."""
    pages = [(n, testdocs.make_png(tmp_path / f"{n}.png", width=10, height=10)) for n in (2, 10)]
    with pytest.raises(ValueError, match="unknown output 'png'"):
        assemble_result(output="png", pages=pages, dest=tmp_path / "r.zip", prepared_document=None)
    assert not (tmp_path / "r.zip").exists()


def test_assemble_result__pdf_merges_page_pdfs_for_images(tmp_path):
    pages = [
        (n, testdocs.make_pdf(tmp_path / f"{n}.pdf", pages=1, text_of=lambda _, n=n: f"P{n}"))
        for n in (2, 1, 3)
    ]
    source = testdocs.make_png(tmp_path / "src.png")
    assert (
        assemble_result(
            output="pdf", pages=pages, dest=tmp_path / "r.pdf", prepared_document=source
        )
        == "application/pdf"
    )
    doc = pdfium.PdfDocument(str(tmp_path / "r.pdf"))
    assert [doc[i].get_textpage().get_text_range() for i in range(len(doc))] == ["P1", "P2", "P3"]


def test_assemble_result__pdf_office_all_pages_is_the_prepared_pdf(tmp_path):
    prepared = testdocs.make_pdf(tmp_path / "lo.pdf", pages=3)
    pages = [(n, tmp_path / f"unused-{n}.pdf") for n in (1, 2, 3)]
    assemble_result(output="pdf", pages=pages, dest=tmp_path / "r.pdf", prepared_document=prepared)
    assert (tmp_path / "r.pdf").read_bytes() == prepared.read_bytes()


def test_assemble_result__pdf_office_subset_selects_pages(tmp_path):
    prepared = testdocs.make_pdf(tmp_path / "lo.pdf", pages=4, text_of=lambda n: f"Sheet {n}")
    pages = [(n, tmp_path / f"unused-{n}.pdf") for n in (4, 2)]
    assemble_result(output="pdf", pages=pages, dest=tmp_path / "r.pdf", prepared_document=prepared)
    reader = PdfReader(tmp_path / "r.pdf")
    assert [p.extract_text() for p in reader.pages] == ["Sheet 2", "Sheet 4"]
