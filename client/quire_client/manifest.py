"""The resume manifest of ``quire submit``: one SQLite file in the output directory
(``.quire-manifest.sqlite3``), one row per source file. Every change is committed at once, so a
CLI killed at any moment (kill -9 included) leaves a manifest a re-run can trust: a file with a
verified result is skipped, a file with a job id is followed rather than uploaded again, and a
file without one is submitted with the same Idempotency-Key as before (content digest + options
fingerprint), which the server answers with the original job."""

from __future__ import annotations

import hashlib
import json
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MANIFEST_NAME = ".quire-manifest.sqlite3"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    source TEXT PRIMARY KEY,          -- the source file's absolute path
    sha256 TEXT NOT NULL,             -- its content digest when last seen
    fingerprint TEXT NOT NULL,        -- output + normalized options
    job_id TEXT,                      -- the server's job, once submitted
    state TEXT NOT NULL,              -- pending, submitted, or the job's terminal state
    error_code TEXT,                  -- why it did not succeed (a problem or job error code)
    result_path TEXT,                 -- where the result was written
    result_sha256 TEXT,               -- the verified digest of that file
    result_size INTEGER,
    updated_at REAL NOT NULL
)
"""


def options_fingerprint(output: str, options: dict[str, Any]) -> str:
    """A stable digest of what the conversion asks for: the output and the options, keys
    sorted (so ``dpi=200 pages=1-2`` and ``pages=1-2 dpi=200`` are the same request)."""
    canonical = json.dumps(
        {"output": output, "options": options}, sort_keys=True, separators=(",", ":")
    )
    return hashlib.sha256(canonical.encode()).hexdigest()[:32]


def idempotency_key(sha256: str, fingerprint: str) -> str:
    """The Idempotency-Key of a file: its content digest and the options fingerprint, so the
    same file with the same request is one job on the server, however often it is sent."""
    return f"quire-cli:{sha256}:{fingerprint}"


@dataclass(frozen=True)
class Written:
    """A result downloaded and verified: where, its sha256 and its size."""

    path: Path
    sha256: str
    size: int


@dataclass
class Entry:
    """A manifest row."""

    source: str
    sha256: str
    fingerprint: str
    job_id: str | None
    state: str
    error_code: str | None
    result_path: str | None
    result_sha256: str | None
    result_size: int | None

    def verified_result(self, *, sha256: str, fingerprint: str) -> bool:
        """Whether this file's result for this request is already downloaded and verified
        (and still on disk with its size)."""
        if self.sha256 != sha256 or self.fingerprint != fingerprint or not self.result_sha256:
            return False
        path = Path(self.result_path or "")
        return path.is_file() and path.stat().st_size == self.result_size


class Manifest:
    """The manifest of one output directory."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / MANIFEST_NAME
        self._db = sqlite3.connect(self.path, isolation_level=None)  # autocommit
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute(_SCHEMA)

    def close(self) -> None:
        """Close the database."""
        self._db.close()

    def get(self, source: str) -> Entry | None:
        """The row of ``source``, if any."""
        row = self._db.execute(
            "SELECT source, sha256, fingerprint, job_id, state, error_code, result_path,"
            " result_sha256, result_size FROM files WHERE source = ?",
            (source,),
        ).fetchone()
        return Entry(*row) if row else None

    def begin(self, source: str, *, sha256: str, fingerprint: str) -> Entry:
        """The row for this content and request: kept when they match the recorded ones,
        else (a changed file or other options) started afresh."""
        entry = self.get(source)
        if entry is not None and entry.sha256 == sha256 and entry.fingerprint == fingerprint:
            return entry
        self._db.execute(
            "INSERT OR REPLACE INTO files (source, sha256, fingerprint, state, updated_at)"
            " VALUES (?, ?, ?, 'pending', ?)",
            (source, sha256, fingerprint, time.time()),
        )
        entry = self.get(source)
        assert entry is not None  # noqa: S101 - just written
        return entry

    def submitted(self, source: str, *, job_id: str) -> None:
        """The server accepted (or replayed) the file as ``job_id``."""
        self._db.execute(
            "UPDATE files SET job_id = ?, state = 'submitted', error_code = NULL, updated_at = ?"
            " WHERE source = ?",
            (job_id, time.time(), source),
        )

    def finished(
        self, source: str, *, state: str, error_code: str | None, result: Written | None = None
    ) -> None:
        """The file's outcome: a job state (or ``rejected`` for a refused submission), its
        error code, and the verified result written, if any."""
        written = (str(result.path), result.sha256, result.size) if result else (None, None, None)
        self._db.execute(
            "UPDATE files SET state = ?, error_code = ?, result_path = ?, result_sha256 = ?,"
            " result_size = ?, updated_at = ? WHERE source = ?",
            (state, error_code, *written, time.time(), source),
        )
