"""What the sync and the async client share: retry policy, ``Retry-After`` parsing, turning an
answer into a model or a typed error, the idempotency key, and digest checks. No I/O here."""

from __future__ import annotations

import email.utils
import hashlib
import json
import os
import random
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

import httpx

from quire_client import errors
from quire_client.models import OUTPUTS, Problem

API = "/api/v1"
#: statuses retried (honouring Retry-After): too many live jobs, capacity, a store or the
#: database briefly away (docs/API_CONTRACT.md §4)
RETRY_STATUSES = frozenset({429, 503})
#: connection-level failures retried for idempotent calls
TRANSPORT_ERRORS = (httpx.TransportError,)
USER_AGENT = "quire-client/0.1"
Upload = str | os.PathLike[str] | bytes | IO[bytes]


@dataclass(frozen=True)
class RetryPolicy:
    """How 429 / 503 answers and connection errors are retried.

    ``max_attempts`` bounds the tries of one call (the first included) on 429 / 503;
    ``connection_attempts`` on connection errors (a server that is down is reported soon);
    ``max_wait_s`` caps a single wait, whatever ``Retry-After`` asks; without ``Retry-After``
    the wait is exponential from ``backoff_s`` (with jitter), also capped."""

    max_attempts: int = 8
    max_wait_s: float = 30.0
    backoff_s: float = 0.5
    connection_attempts: int = 4

    def delay(self, attempt: int, retry_after: float | None) -> float:
        """Seconds to wait before try ``attempt + 1`` (``attempt`` counts from 1)."""
        if retry_after is not None:
            return min(max(retry_after, 0.0), self.max_wait_s)
        base = self.backoff_s * (2 ** (attempt - 1))
        return float(min(base * (0.5 + random.random() / 2), self.max_wait_s))  # noqa: S311 - jitter


def parse_retry_after(value: str | None, *, now: datetime | None = None) -> float | None:
    """``Retry-After`` as seconds to wait: delta-seconds or an HTTP date (RFC 9110 §10.2.3);
    None when absent or unreadable; a date in the past is 0."""
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when is None:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - (now or datetime.now(UTC))).total_seconds())


def raise_for_problem(response: httpx.Response) -> None:
    """Raise the typed error of an error answer (its body must have been read)."""
    if response.status_code < 400:
        return
    try:
        body = response.json()
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError):
        body = None
    if not isinstance(body, dict):
        body = {"title": response.reason_phrase, "status": response.status_code}
    problem = Problem.from_dict(body, status=response.status_code)
    retry_after = parse_retry_after(response.headers.get("Retry-After"))
    if retry_after is None and problem.retry_after is not None:
        retry_after = float(problem.retry_after)
    raise errors.error_for(problem, retry_after=retry_after)


def retry_after_of(response: httpx.Response) -> float | None:
    """The wait a 429 / 503 answer asks for (header first, then the problem member)."""
    found = parse_retry_after(response.headers.get("Retry-After"))
    if found is None:
        try:
            member = response.json().get("retry_after")
            found = float(member) if member is not None else None
        except (ValueError, AttributeError, TypeError):
            found = None
    return found


def new_idempotency_key() -> str:
    """A fresh Idempotency-Key, for a submit whose caller names none."""
    return f"quire-client-{uuid.uuid4().hex}"


def options_json(options: dict[str, Any] | None) -> str | None:
    """The ``options`` part, compact and key-sorted (None: no part)."""
    if not options:
        return None
    return json.dumps(options, sort_keys=True, separators=(",", ":"))


def check_output(output: str) -> None:
    """Refuse an unknown output before any request."""
    if output not in OUTPUTS:
        raise ValueError(f"output must be one of {', '.join(OUTPUTS)}")


def open_upload(file: Upload) -> tuple[str, IO[bytes] | bytes, bool]:
    """(file name sent, body, whether the caller must close it). The name is not used by the
    server (types are sniffed) and is sent as ``document``, so no file name leaves here."""
    if isinstance(file, bytes):
        return "document", file, False
    if isinstance(file, str | os.PathLike):
        return "document", open(Path(file), "rb"), True
    if hasattr(file, "seek"):
        file.seek(0)  # a retry re-sends from the start
    return "document", file, False


def etag_digest(value: str | None) -> str | None:
    """The sha256 in an artifact ETag (``"<hex>"``, ``W/`` tolerated), or None."""
    if not value:
        return None
    value = value.strip().removeprefix("W/").strip('"')
    return (
        value.lower()
        if len(value) == 64 and all(c in "0123456789abcdef" for c in value.lower())
        else None
    )


def expected_digest(response: httpx.Response, known: str | None) -> str | None:
    """The digest a download must have: the job's recorded result digest if given, else the
    ETag of the first answer (a presigned redirect carries it; the store's own ETag is not a
    sha256)."""
    if known:
        return known.lower()
    first = response.history[0] if response.history else response
    return etag_digest(first.headers.get("ETag"))


def sha256_file(path: Path) -> str:
    """The file's sha256 (hex)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def part_path(dest: Path) -> Path:
    """Where a download is written before it is verified and renamed."""
    return dest.with_name(dest.name + ".part")


def finish_download(part: Path, dest: Path, digests: tuple[str | None, str]) -> Path:
    """Rename a verified ``.part`` to ``dest``; delete it and raise when its digest is not
    the announced one (or none was announced)."""
    expected, actual = digests
    if expected is None or expected != actual:
        part.unlink(missing_ok=True)
        raise errors.DigestMismatch(
            f"downloaded sha256 {actual} != announced {expected or '(none)'}"
        )
    os.replace(part, dest)
    return dest
