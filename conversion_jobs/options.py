"""Normalised conversion options and request fingerprints (pure functions, unit-tested)."""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from conversion_jobs.canonical import canonical_json
from conversion_jobs.converters.base import DEFAULT_DPI, TEST_FAULTS_ENV
from conversion_jobs.exceptions import InvalidOptions

MIN_DPI = 36
KNOWN = {"dpi", "pages", "allow_partial", "password"}
#: A document password: at most this many characters (LibreOffice and PDF allow less in practice).
MAX_PASSWORD_CHARS = 256
#: Converter fault injection for e2e tests (conversion_jobs/converters/isolation.py); the option
#: exists only in a process started with QUIRE_ENABLE_TEST_FAULTS=1, and is rejected otherwise.
TEST_FAULT = "_test_fault"


def normalize_options(raw: Any, *, output: str, max_dpi: int = 600) -> dict[str, Any]:
    """The canonical options for ``output``: every key present, defaults filled in, so two
    requests that mean the same thing have the same content identity."""
    raw = _options_object(raw)
    normalized: dict[str, Any] = {
        "dpi": _dpi(raw, output=output, max_dpi=max_dpi),
        "pages": _parse_pages(raw["pages"]) if raw.get("pages") is not None else None,
        "allow_partial": _allow_partial(raw),
    }
    if "password" in raw:
        # Kept only until acceptance seals it (passwords.py); never stored or shown in clear.
        normalized["password"] = _password(raw["password"])
    if TEST_FAULT in raw:
        normalized[TEST_FAULT] = _test_fault(raw[TEST_FAULT])
    return normalized


def _options_object(raw: Any) -> dict[str, Any]:
    """The request's options as a dict of known keys (JSON text is parsed; empty is {})."""
    if raw in (None, ""):
        raw = {}
    if isinstance(raw, str | bytes):
        try:
            raw = json.loads(raw)
        except (ValueError, RecursionError) as exc:  # RecursionError: nesting past the stack
            raise InvalidOptions("options must be a JSON object") from exc
    if not isinstance(raw, dict):
        raise InvalidOptions("options must be a JSON object")
    test_faults = os.environ.get(TEST_FAULTS_ENV) == "1"
    unknown = set(raw) - KNOWN - ({TEST_FAULT} if test_faults else set())
    if unknown:
        raise InvalidOptions(f"unknown option(s): {', '.join(sorted(unknown))}")
    return raw


def _dpi(raw: dict[str, Any], *, output: str, max_dpi: int) -> int | None:
    dpi = raw.get("dpi", DEFAULT_DPI)
    if output != "png" and "dpi" in raw:
        raise InvalidOptions("dpi applies to png output only")
    if not isinstance(dpi, int) or isinstance(dpi, bool) or not MIN_DPI <= dpi <= max_dpi:
        raise InvalidOptions(f"dpi must be an integer from {MIN_DPI} to {max_dpi}")
    return dpi if output == "png" else None


def _allow_partial(raw: dict[str, Any]) -> bool:
    allow_partial = raw.get("allow_partial", True)
    if not isinstance(allow_partial, bool):
        raise InvalidOptions("allow_partial must be true or false")
    return allow_partial


def _password(password: Any) -> str:
    if (
        not isinstance(password, str)
        or not 1 <= len(password) <= MAX_PASSWORD_CHARS
        or "\x00" in password
    ):
        raise InvalidOptions(f"password must be a string of 1 to {MAX_PASSWORD_CHARS} characters")
    return password


def _test_fault(fault: Any) -> dict[str, Any]:
    if not isinstance(fault, dict) or not isinstance(fault.get("kind"), str):
        raise InvalidOptions("_test_fault must be an object with a kind")
    return fault


def _parse_pages(value: Any) -> list[int]:
    """``"3-7"``, ``"4"``, ``[3, 7]`` -> ``[first, last]`` (1-based, inclusive)."""
    if isinstance(value, str):
        parts = value.split("-")
        try:
            bounds = [int(p) for p in parts]
        except ValueError as exc:
            raise InvalidOptions('pages must look like "3-7" or "4"') from exc
    elif isinstance(value, list):
        bounds = value
    else:
        raise InvalidOptions('pages must be a range such as "3-7"')
    if len(bounds) == 1:
        bounds = [bounds[0], bounds[0]]
    if (
        len(bounds) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) for b in bounds)
        or not 1 <= bounds[0] <= bounds[1]
    ):
        raise InvalidOptions("pages must be a range first-last with 1 <= first <= last")
    return [bounds[0], bounds[1]]


def options_digest(options: dict[str, Any]) -> str:
    return hashlib.sha256(canonical_json(options).encode()).hexdigest()


def request_fingerprint(*, source_sha256: str, output: str, options: dict[str, Any]) -> str:
    """What an Idempotency-Key is bound to: the same bytes, output and options."""
    material = canonical_json({"sha256": source_sha256, "output": output, "options": options})
    return hashlib.sha256(material.encode()).hexdigest()
