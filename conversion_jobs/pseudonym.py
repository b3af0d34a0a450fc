"""Keyed pseudonyms for tenants and actors (DESIGN.md §11).

Audit details, logs, metrics and traces carry these instead of clear identifiers. The key comes
from ``QUIRE_PSEUDONYM_KEY``; rotating it breaks linkage with older pseudonyms by design.
"""

from __future__ import annotations

import hashlib
import hmac

from django.conf import settings


def pseudonym(kind: str, value: str) -> str:
    key = str(settings.QUIRE["PSEUDONYM_KEY"]).encode()
    digest = hmac.new(key, f"{kind}:{value}".encode(), hashlib.sha256).hexdigest()
    return f"{kind[0]}_{digest[:24]}"


def actor_pseudonym(*, tenant: str, subject: str) -> str:
    return pseudonym("actor", f"{tenant}/{subject}")
