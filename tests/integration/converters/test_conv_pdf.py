import io
import zipfile

import pytest
from convhelpers import FAST, convert_all
from PIL import Image

from conversion_jobs.converters import Limits, assemble_result, zipstream
from tests import testdocs


def text_of(n):
    return f"Page {n} of fifty\nQuire line two {n * 7}"


def test_pdf_text__page_count_and_exact_text_round_trip(tmp_path):
    source = testdocs.make_pdf(tmp_path / "doc.pdf", pages=6, text_of=text_of)
    prepared, artifacts = convert_all(source, tmp_path, output="text")
    assert prepared.page_count == 6
    assert prepared.document == source
    for n, artifact in enumerate(artifacts, start=1):
        assert artifact.media_type == "text/plain; charset=utf-8"
        assert artifact.path.read_text(encoding="utf-8") == text_of(n)
    dest = tmp_path / "result.txt"
    assemble_result(
        output="text",
        pages=list(enumerate((a.path for a in artifacts), start=1)),
        dest=dest,
        prepared_document=prepared.document,
    )
    assert dest.read_text(encoding="utf-8") == "\f".join(text_of(n) for n in range(1, 7))


@pytest.mark.parametrize("dpi", [72, 100, 150])
def test_pdf_png__dimensions_are_points_at_dpi(tmp_path, dpi):
    source = testdocs.make_pdf(tmp_path / "a4.pdf", pages=2, page_size=(595, 842))
    _prepared, artifacts = convert_all(source, tmp_path, output="png", options={"dpi": dpi})
    for artifact in artifacts:
        assert artifact.media_type == "image/png"
        with Image.open(artifact.path) as image:
            assert image.size == (round(595 * dpi / 72), round(842 * dpi / 72))


def test_pdf_png__dpi_capped_by_max_dpi(tmp_path):
    source = testdocs.make_pdf(tmp_path / "a.pdf", pages=1)
    limits = Limits(max_dpi=100, page_timeout_s=20)
    _prepared, [artifact] = convert_all(
        source, tmp_path, output="png", options={"dpi": 600}, limits=limits
    )
    with Image.open(artifact.path) as image:
        assert image.size == (850, 1100)


def test_pdf_png__scale_reduced_to_max_pixels(tmp_path):
    source = testdocs.make_pdf(tmp_path / "a.pdf", pages=1)
    limits = Limits(max_pixels=1_000_000, page_timeout_s=20)
    _prepared, [artifact] = convert_all(
        source, tmp_path, output="png", options={"dpi": 600}, limits=limits
    )
    with Image.open(artifact.path) as image:
        width, height = image.size
    assert width * height <= 1_000_000
    assert width > 800


def test_pdf_png__rendered_text_is_visible_and_the_pages_zip(tmp_path):
    source = testdocs.make_pdf(tmp_path / "a.pdf", pages=2)
    _prepared, artifacts = convert_all(source, tmp_path, output="png")
    with Image.open(artifacts[0].path) as image:
        assert image.convert("L").getextrema()[0] < 100  # some dark (text) pixels
    # The result is the ZIP of the page files (zipstream, as the worker hashes and the web
    # streams it).
    entries = [
        zipstream.Entry(page=n, size=a.path.stat().st_size, open=lambda p=a.path: open(p, "rb"))
        for n, a in enumerate(artifacts, start=1)
    ]
    with zipfile.ZipFile(io.BytesIO(b"".join(zipstream.zip_chunks(entries)))) as zf:
        assert zf.namelist() == ["page-0001.png", "page-0002.png"]
        assert [zf.read(n) for n in zf.namelist()] == [a.path.read_bytes() for a in artifacts]


def test_pdf_prepare__fifty_pages_is_fast(tmp_path):
    source = testdocs.make_pdf(tmp_path / "fifty.pdf", pages=50)
    from convhelpers import prepare

    _converter, prepared = prepare(source, tmp_path, output="text", limits=FAST)
    assert prepared.page_count == 50


def test_pdf_text__pdfium_calls_read_what_pypdfium2_reads(tmp_path):
    """``pdfops`` reads a text page with pdfium's calls directly (ADR 0017, session 5): the
    text is exactly pypdfium2's ``get_text_range()`` for every page, blank pages included, and
    a file that is no PDF fails as before. In-process: the child runs the same functions."""
    import pypdfium2 as pdfium

    from conversion_jobs.converters import InvalidInput, pdfops

    texts = {1: "Grüße, naïve café \u2013 10 €", 2: "", 3: "two\nlines", 4: "   "}
    source = testdocs.make_pdf(tmp_path / "doc.pdf", pages=4, text_of=lambda n: texts[n])
    ours, theirs = pdfops.open_pdf(source), pdfium.PdfDocument(str(source))
    try:
        for page in range(1, 5):
            textpage = theirs[page - 1].get_textpage()
            assert pdfops._page_text(ours, page) == textpage.get_text_range()
    finally:
        ours.close()
        theirs.close()
    (tmp_path / "not.pdf").write_bytes(b"%PDF-1.7\nthis is not a PDF")
    with pytest.raises(InvalidInput, match=r"not a readable PDF .*Data format error"):
        pdfops.open_pdf(tmp_path / "not.pdf")
    with pytest.raises(FileNotFoundError):  # not the document's fault: the child crashes
        pdfops.open_pdf(tmp_path / "missing.pdf")
