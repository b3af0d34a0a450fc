"""Canonical JSON: the one text of a value that fingerprints, digests and audit hashes cover (a
leaf module: the options, the audit chain in the store and its verifier all use it)."""

from __future__ import annotations

import json
from typing import Any


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))
