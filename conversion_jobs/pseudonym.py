"""Keyed pseudonyms for tenants and actors (docs/THREAT_MODEL.md §3).

Audit details, logs, metrics and traces carry these instead of clear identifiers. The key comes
from ``QUIRE_PSEUDONYM_KEY``; rotating it breaks linkage with older pseudonyms by design.
"""

from __future__ import annotations

import functools
import hashlib
import hmac

from django.conf import settings


def pseudonym(kind: str, value: str) -> str:
    return _pseudonym(str(settings.QUIRE["PSEUDONYM_KEY"]), kind, value)


@functools.lru_cache(maxsize=4096)
def _pseudonym(key: str, kind: str, value: str) -> str:
    """Remembered per key, kind and value: the worker names every attempt's tenant (converter
    reuse) and a worker process sees few tenants; an HMAC per attempt was ≈ 30 µs of its CPU
    (ADR 0017, session 8). A rotated key is another cache key."""
    digest = hmac.new(key.encode(), f"{kind}:{value}".encode(), hashlib.sha256).hexdigest()
    return f"{kind[0]}_{digest[:24]}"


def actor_pseudonym(*, tenant: str, subject: str) -> str:
    return pseudonym("actor", f"{tenant}/{subject}")
