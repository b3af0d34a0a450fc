"""The generators produce what they promise (checked in-process on trusted files)."""

import pypdfium2 as pdfium
from PIL import Image

from tests import testdocs


def test_make_pdf__text_round_trips_through_pdfium(tmp_path):
    def text_of(n):
        return f"Page {n}: (parens) \\ back\nsecond line {n}"

    path = testdocs.make_pdf(tmp_path / "a.pdf", pages=4, text_of=text_of, page_size=(595, 842))
    doc = pdfium.PdfDocument(str(path))
    assert len(doc) == 4
    for index in range(4):
        text = doc[index].get_textpage().get_text_range().replace("\r\n", "\n")
        assert text == text_of(index + 1)
        assert doc.get_page_size(index) == (595, 842)


def test_make_tiff__frames_and_sizes(tmp_path):
    path = testdocs.make_tiff(tmp_path / "a.tiff", sizes=[(100, 50), (120, 60), (140, 70)])
    with Image.open(path) as image:
        sizes = []
        for frame in range(image.n_frames):
            image.seek(frame)
            sizes.append(image.size)
    assert sizes == [(100, 50), (120, 60), (140, 70)]


def test_make_png_bomb__declares_huge_size_in_a_small_file(tmp_path):
    path = testdocs.make_png_bomb(tmp_path / "bomb.png", width=50_000, height=60_000)
    assert path.stat().st_size < 10_000
    assert path.read_bytes()[16:24] == (50_000).to_bytes(4, "big") + (60_000).to_bytes(4, "big")


def test_pdfops_warm_up_pdf__is_the_generated_one_page_pdf():
    """The fork server warms pdfium with a PDF kept in the production code (the generator
    lives with the tests): it must stay the document the generator makes."""
    from conversion_jobs.converters.pdfops import _WARM_UP_PDF

    assert _WARM_UP_PDF == testdocs.pdf_bytes(pages=1, text_of=lambda _n: "warm up")
