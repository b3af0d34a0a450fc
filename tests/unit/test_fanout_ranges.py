"""Range sizing and planning (ADR 0023, docs/ARCHITECTURE.md §5a): pure functions of the
settings and the pages."""

from __future__ import annotations

from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured

from conversion_jobs.models import ConversionJob
from conversion_jobs.services.fanout import fanout_min_pages, range_size, range_sizes, ranges_for
from conversion_jobs.services.runner import limits_from_settings
from project.settings import env_pages_by_output


@pytest.fixture
def sizing(settings: Any) -> None:
    settings.QUIRE = {
        **settings.QUIRE,
        "FANOUT_SLOTS": 2,
        "FANOUT_RANGE_MIN_PAGES": 32,
        "FANOUT_RANGE_MAX_PAGES": 256,
    }


@pytest.mark.usefixtures("sizing")
@pytest.mark.parametrize(
    ("pages", "size"), [(65, 32), (2000, 250), (2049, 256), (20_000, 256), (100, 32)]
)
def test_range_size__four_per_slot_bounded(pages: int, size: int):
    assert range_size(pages) == size


@pytest.mark.usefixtures("sizing")
def test_ranges_for__cover_the_selected_pages_in_order_with_absolute_numbers():
    pages = list(range(101, 401))  # options.pages = [101, 400]
    spans = ranges_for(pages=pages, todo=pages)
    assert spans[0] == (101, 138)  # ceil(300 / 8) = 38 and spans[-1][1] == 400
    assert [b[0] for b in spans[1:]] == [a[1] + 1 for a in spans[:-1]]  # contiguous, no overlap


@pytest.mark.usefixtures("sizing")
def test_ranges_for__a_resumed_job_keeps_boundaries_and_skips_finished_ranges():
    pages = list(range(1, 201))
    todo = [p for p in pages if p > 70]
    assert (
        ranges_for(pages=pages, todo=todo)
        == [(33, 64), (65, 96), (97, 128), (129, 160), (161, 192), (193, 200)][1:]
    )


def test_page_limit__is_a_setting_of_at_least_20000():
    assert limits_from_settings().max_pages >= 20_000


@pytest.mark.usefixtures("sizing")
def test_range_sizes__taper_towards_the_end(settings: Any):
    settings.QUIRE = {**settings.QUIRE, "FANOUT_RANGE_TAPER": True}
    sizes = range_sizes(2000)
    assert sum(sizes) == 2000
    assert sizes[:5] == [250] * 5  # a quarter of the pages left per slot, at most range_size
    assert sizes[:-1] == sorted(sizes[:-1], reverse=True)  # shrinking (but the remainder)
    assert all(size >= 32 for size in sizes)  # never below the minimum
    assert sizes[-3:] == [32, 32, 35]  # a remainder below the minimum joins the last range
    settings.QUIRE = {**settings.QUIRE, "FANOUT_RANGE_TAPER": False}
    assert range_sizes(2000) == [250] * 8


DEFAULTS = {"text": 20_000, "ocr": 64, "png": 64, "pdf": 64}


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("", DEFAULTS),
        ("64", {"text": 64, "ocr": 64, "png": 64, "pdf": 64}),
        ("text=5000, png=100", {**DEFAULTS, "text": 5000, "png": 100}),
    ],
)
def test_fanout_min_pages__env_is_one_number_or_pages_by_output(
    monkeypatch: pytest.MonkeyPatch, raw: str, expected: dict[str, int]
):
    monkeypatch.setenv("QUIRE_FANOUT_MIN_PAGES", raw)
    assert env_pages_by_output("QUIRE_FANOUT_MIN_PAGES", DEFAULTS) == expected


@pytest.mark.parametrize("raw", ["text=", "word=5", "png=-1", "png=many"])
def test_fanout_min_pages__a_bad_value_refuses_to_start(monkeypatch: pytest.MonkeyPatch, raw: str):
    monkeypatch.setenv("QUIRE_FANOUT_MIN_PAGES", raw)
    with pytest.raises(ImproperlyConfigured):
        env_pages_by_output("QUIRE_FANOUT_MIN_PAGES", DEFAULTS)


@pytest.mark.parametrize(
    ("media_type", "output", "pages"),
    [
        ("application/pdf", "text", 1000),
        ("image/tiff", "text", 10),  # OCR
        ("application/pdf", "png", 20),
        ("image/tiff", "pdf", 30),
        ("application/vnd.oasis.opendocument.text", "text", 1000),
    ],
)
def test_fanout_min_pages__by_output(settings: Any, media_type: str, output: str, pages: int):
    by_output = {"text": 1000, "ocr": 10, "png": 20, "pdf": 30}
    settings.QUIRE = {**settings.QUIRE, "FANOUT_MIN_PAGES": by_output}
    job = ConversionJob(source_media_type=media_type, output=output)
    assert fanout_min_pages(job=job) == pages
    settings.QUIRE = {**settings.QUIRE, "FANOUT_MIN_PAGES": 7}  # one number: every output
    assert fanout_min_pages(job=job) == 7
