"""The dispatch cost (``services/fair.py``, docs/OPERABILITY.md §6.8): pages x a factor per
output, the pages estimated from bytes and format before they are known."""

from __future__ import annotations

from pathlib import Path

import pytest

from conversion_jobs.services import fair
from tests import testdocs

NO_OPTIONS = {"dpi": None, "pages": None, "allow_partial": True}
PDF = "application/pdf"


def test_cost__pages_times_the_output_factor():
    assert (
        fair.dispatch_cost(media_type=PDF, size=1, output="text", options=NO_OPTIONS, pages=10)
        == 10
    )
    png150 = {**NO_OPTIONS, "dpi": 150}
    assert fair.dispatch_cost(media_type=PDF, size=1, output="png", options=png150, pages=10) == 40
    png300 = {**NO_OPTIONS, "dpi": 300}
    assert fair.dispatch_cost(media_type=PDF, size=1, output="png", options=png300, pages=10) == 160
    ocr = fair.dispatch_cost(
        media_type="image/tiff", size=1, output="text", options=NO_OPTIONS, pages=2
    )
    assert ocr == 2 * fair.OCR_FACTOR
    docx = "application/vnd.openxmlformats-officedocument.wordprocessingml.document"
    assert (
        fair.dispatch_cost(media_type=docx, size=1, output="pdf", options=NO_OPTIONS, pages=3) == 33
    )


def test_estimate__the_selected_range_wins():
    options = {**NO_OPTIONS, "pages": [3, 7]}
    assert fair.estimated_pages(media_type=PDF, size=10**9, options=options) == 5


def test_estimate__one_page_for_a_single_image_whatever_its_size():
    assert fair.estimated_pages(media_type="image/png", size=10**8, options=NO_OPTIONS) == 1


def test_estimate__size_over_bytes_per_page_bounded():
    assert fair.estimated_pages(media_type=PDF, size=600_000, options=NO_OPTIONS) == 10
    assert fair.estimated_pages(media_type=PDF, size=1, options=NO_OPTIONS) == 1
    huge = fair.estimated_pages(media_type=PDF, size=10**12, options=NO_OPTIONS)
    assert huge == fair.MAX_ESTIMATED_PAGES


@pytest.mark.parametrize("pages", [1, 10, 120])
def test_pdf_page_hint__counts_a_small_pdf_without_parsing_it(tmp_path: Path, pages: int):
    path = testdocs.make_pdf(tmp_path / "d.pdf", pages=pages, text_of=lambda n: f"p{n}")
    raw = path.read_bytes()
    assert fair.pdf_page_hint(raw) == pages
    assert fair.pdf_page_hint(path) == pages  # a stored source: its first and last bytes
    estimate = fair.estimated_pages(
        media_type=PDF, size=len(raw), options=NO_OPTIONS, page_hint=pages
    )
    assert estimate == pages


def test_pdf_page_hint__nothing_seen_is_none():
    assert fair.pdf_page_hint(b"not a pdf at all") is None
    assert fair.pdf_page_hint(None) is None
