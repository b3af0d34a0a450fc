"""Job ids are UUID version 7 (conversion_jobs/ids.py): time-ordered, RFC 9562 layout."""

from __future__ import annotations

import time
import uuid

from conversion_jobs.ids import uuid7


def test_uuid7__layout_is_rfc_9562():
    before = time.time_ns() // 1_000_000
    value = uuid7()
    after = time.time_ns() // 1_000_000
    assert value.version == 7
    assert value.variant == uuid.RFC_4122
    assert before <= value.int >> 80 <= after  # the 48-bit Unix time in milliseconds


def test_uuid7__later_ids_sort_after_earlier_ones_and_never_repeat():
    first = [uuid7() for _ in range(1000)]
    time.sleep(0.002)
    later = uuid7()
    assert all(earlier < later for earlier in first)
    assert len(set(first)) == len(first)
