"""runner._first_pages: what a first run's prepare asks for before the page count is known is
what the runner would request once it knows it (``todo[:2 * READ_AHEAD_PAGES]``)."""

from __future__ import annotations

import pytest

from conversion_jobs.converters import READ_AHEAD_PAGES, InvalidInput
from conversion_jobs.services.runner import _first_pages, _selected_pages


@pytest.mark.parametrize(
    ("options", "page_count"),
    [({}, 1), ({}, 3), ({}, 200), ({"pages": [2, 2]}, 3), ({"pages": [5, 60]}, 60)],
)
def test_first_pages__the_first_requested_pages_up_to_the_count(options, page_count) -> None:
    first = [p for p in _first_pages(options) if p <= page_count]
    assert first == _selected_pages(options, page_count)[: 2 * READ_AHEAD_PAGES]


def test_first_pages__a_range_beyond_the_document_asks_for_nothing_the_child_keeps() -> None:
    assert [p for p in _first_pages({"pages": [5, 6]}) if p <= 2] == []


@pytest.mark.parametrize(("pages", "page_count"), [([1, 99], 3), ([3, 4], 3), ([5, 6], 2)])
def test_selected_pages__a_range_ending_past_the_last_page__invalid_input(pages, page_count):
    with pytest.raises(InvalidInput) as info:
        _selected_pages({"pages": pages}, page_count)
    assert info.value.public
    assert info.value.detail == (
        f"the requested page range {pages[0]}-{pages[1]} exceeds the page count ({page_count})"
    )


def test_selected_pages__a_range_ending_on_the_last_page__its_pages() -> None:
    assert _selected_pages({"pages": [2, 3]}, 3) == [2, 3]
    assert _selected_pages({"pages": [3, 3]}, 3) == [3]
