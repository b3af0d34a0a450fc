"""Range sizing and planning (ADR 0023, docs/ARCHITECTURE.md §5a): pure functions of the
settings and the pages."""

from __future__ import annotations

from typing import Any

import pytest

from conversion_jobs.services.fanout import range_size, ranges_for
from conversion_jobs.services.runner import limits_from_settings


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
