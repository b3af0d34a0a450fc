"""Backoff (conversion_jobs/retry_policy.py): grows, capped, jitter within bounds."""

from __future__ import annotations

import random

import pytest

from conversion_jobs.retry_policy import backoff_delay

BASE, CAP = 2.0, 300.0


def _delay(attempt: int, seed: int) -> float:
    return backoff_delay(
        attempt=attempt, base_s=BASE, cap_s=CAP, rng=random.Random(seed)
    ).total_seconds()


@pytest.mark.parametrize("attempt", range(1, 12))
def test_backoff_delay__within_jitter_window(attempt):
    ceiling = min(CAP, BASE * 2 ** (attempt - 1))
    for seed in range(200):
        assert ceiling / 2 <= _delay(attempt, seed) <= ceiling


def test_backoff_delay__grows_with_attempts_until_cap():
    for seed in range(50):
        delays = [_delay(attempt, seed) for attempt in range(1, 9)]
        # The lower bound of attempt n+1 equals the upper bound of attempt n: never shrinks.
        assert delays == sorted(delays)
    assert min(_delay(8, s) for s in range(50)) > max(_delay(1, s) for s in range(50)) * 10


def test_backoff_delay__capped():
    for attempt in (9, 10, 20, 60, 200):
        for seed in range(50):
            assert CAP / 2 <= _delay(attempt, seed) <= CAP


def test_backoff_delay__jitter_spreads_retries():
    delays = {_delay(5, seed) for seed in range(100)}
    assert len(delays) > 90
    ceiling = BASE * 2**4
    assert max(delays) - min(delays) > ceiling / 4


def test_backoff_delay__first_attempt_and_zero_use_base():
    for attempt in (0, 1):
        for seed in range(20):
            assert BASE / 2 <= _delay(attempt, seed) <= BASE


def test_backoff_delay__default_rng_is_random():
    values = {backoff_delay(attempt=6, base_s=BASE, cap_s=CAP).total_seconds() for _ in range(20)}
    assert len(values) > 1
