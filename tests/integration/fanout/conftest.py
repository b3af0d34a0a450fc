"""Fan-out tests (ADR 0023): the real runner, real converter children, real Postgres (or
SQLite); ranges are small so that a 12-page document has four of them."""

from __future__ import annotations

from typing import Any

import pytest

from tests.integration.execution.jobkit import fast_quire  # noqa: F401


@pytest.fixture
def fanout_quire(fast_quire: None, settings: Any) -> None:  # noqa: F811
    """Fan-out above 4 pages, ranges of 3 pages (one slot: ceil(12 / 4) = 3, bounded to 2-3)."""
    settings.QUIRE = {
        **settings.QUIRE,
        "FANOUT": True,
        "FANOUT_MIN_PAGES": 4,
        "FANOUT_RANGE_MIN_PAGES": 2,
        "FANOUT_RANGE_MAX_PAGES": 3,
        "FANOUT_SLOTS": 1,
    }
