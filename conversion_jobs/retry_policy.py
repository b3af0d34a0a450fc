"""Retry policy (pure): exponential backoff with full jitter, capped, and error classification."""

from __future__ import annotations

import random
from datetime import timedelta


def backoff_delay(
    *, attempt: int, base_s: float, cap_s: float, rng: random.Random | None = None
) -> timedelta:
    """Delay before attempt ``attempt + 1``: uniform in [ceiling/2, ceiling] where
    ceiling = min(cap, base * 2**(attempt-1)). Half the window is kept so delays still grow
    (an operator reading the timestamps sees the backoff) while retries spread out."""
    rng = rng or random.Random()  # noqa: S311  (jitter, not cryptography)
    ceiling = min(cap_s, base_s * (2 ** max(0, attempt - 1)))
    return timedelta(seconds=rng.uniform(ceiling / 2, ceiling))
