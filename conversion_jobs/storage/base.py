"""The artifact store's interface (docs/ARCHITECTURE.md §6) and the key scheme shared by
both backends.

Keys:
* ``sources/ab/<sha256>`` — content-addressed uploads (a retried upload reuses its object);
* ``pages/<job>/<nnnnn>.g<generation>.<ext>`` — page artifacts; the generation is part of the
  key, so a stale worker can never overwrite what a later generation checkpointed;
* ``results/<job>/result.g<generation>.<ext>`` — the published result, likewise.

Guarantees every backend keeps: ``put_file`` / ``put`` make an object appear whole or not at
all, and (once settled) durably; callers record a key in a row only after that (files first,
rows second) and delete objects only after their rows (rows first, files second). Storage
failures raise :class:`StorageError` (an ``OSError``: the runner's ``storage_error``).
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

CHUNK = 1024 * 1024

_KEY = re.compile(r"^[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*$")
_PARSE = re.compile(
    r"^(?:(?P<kind_s>sources)/[0-9a-f]{2}/(?P<sha>[0-9a-f]{64})"
    r"|(?P<kind_p>pages)/(?P<pjob>[0-9a-f-]{36})/(?P<page>\d+)\.g(?P<pgen>\d+)\.[a-z]+"
    r"|(?P<kind_r>results)/(?P<rjob>[0-9a-f-]{36})/result\.g(?P<rgen>\d+)\.[a-z]+)$"
)


class StorageError(OSError):
    """The artifact store failed (unreachable, refused, or an object is missing)."""

    code = "storage_error"


def check_key(key: str) -> str:
    if not _KEY.match(key) or ".." in key.split("/"):
        raise ValueError("invalid storage key")
    return key


def source_key(sha256: str) -> str:
    return f"sources/{sha256[:2]}/{sha256}"


#: A key that starts with this names bytes kept in a Postgres row, not in the store; the rest is
#: the key a stored copy would have: a job's ``source_key`` (its ``inline_source`` row, ADR 0017
#: session 10), a text page's ``artifact_key`` and a text result's ``result_key`` (the checkpoint
#: rows' ``content``).
INLINE_PREFIX = "inline:"


def inline_source_key(sha256: str) -> str:
    return INLINE_PREFIX + source_key(sha256)


def is_inline_source(key: str) -> bool:
    return key.startswith(INLINE_PREFIX)


def page_key(*, job_id: uuid.UUID, page: int, generation: int, ext: str) -> str:
    return f"pages/{job_id}/{page:05d}.g{generation}.{ext}"


def result_key(*, job_id: uuid.UUID, generation: int, ext: str) -> str:
    return f"results/{job_id}/result.g{generation}.{ext}"


@dataclass(frozen=True)
class ParsedKey:
    kind: str  # "sources" | "pages" | "results"
    sha256: str | None = None
    job_id: uuid.UUID | None = None
    page: int | None = None
    generation: int | None = None


def parse_key(key: str) -> ParsedKey | None:
    """What a stored key names, or None for a key Quire never writes."""
    m = _PARSE.match(key)
    if m is None:
        return None
    if m["kind_s"]:
        return ParsedKey(kind="sources", sha256=m["sha"])
    if m["kind_p"]:
        return ParsedKey(
            kind="pages",
            job_id=uuid.UUID(m["pjob"]),
            page=int(m["page"]),
            generation=int(m["pgen"]),
        )
    return ParsedKey(kind="results", job_id=uuid.UUID(m["rjob"]), generation=int(m["rgen"]))


def sha256_file(path: Path) -> tuple[str, int]:
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


@dataclass
class Put:
    """One object being stored. ``local`` holds the same bytes on this host for the rest of
    the attempt (assembly reads it); ``pending`` is the unfinished part of the put (None once
    the put is complete and durable)."""

    key: str
    local: Path
    pending: Future | None = None
    directory: Path | None = field(default=None, repr=False)


@dataclass(frozen=True)
class StoredObject:
    key: str
    modified: float  # seconds since the epoch
    size: int


class ArtifactStore(ABC):
    """One artifact store (filesystem or S3). Instances are per process; use ``store()``."""

    kind: str

    @abstractmethod
    def stage(self) -> tuple[BinaryIO, Path]:
        """An open local file (0600) to stream an upload into before it is stored."""

    @abstractmethod
    def put_file(
        self, key: str, path: Path, *, wait: bool = True, sha256: str | None = None
    ) -> Put:
        """Store the bytes of local file ``path`` under ``key``. With ``wait`` the object is
        complete and durable on return; otherwise ``settle`` must be called before the key is
        recorded anywhere. ``path`` may be consumed (the returned ``local`` is where the bytes
        are afterwards). ``sha256``: the file's SHA-256 (hex) when the caller knows it; a
        backend may send it along for the server to verify (S3: ``x-amz-checksum-sha256``)."""

    def put_file_if_absent(self, key: str, path: Path, *, sha256: str) -> bool:
        """Store ``path`` under ``key`` unless an object is there already (content-addressed
        keys: the same key holds the same bytes). Returns whether this call stored it; either
        way the object is complete and durable on return. A backend that can ask its server
        for a conditional create does it in one request."""
        if self.exists(key):
            return False
        self.put_file(key, path, sha256=sha256)
        return True

    @abstractmethod
    def put(self, key: str, stream: BinaryIO) -> None:
        """Store everything ``stream`` yields under ``key``, complete and durable on return."""

    @abstractmethod
    def settle(self, puts: list[Put]) -> None:
        """Wait until every put is complete and durable (raises the first failure)."""

    def abandon(self, puts: list[Put]) -> None:
        """Stop waiting for ``puts`` (cancel what has not started, let the rest finish)."""
        for put in puts:
            if put.pending is not None:
                put.pending.cancel()
        for put in puts:
            if put.pending is not None and not put.pending.cancelled():
                try:
                    put.pending.result()
                except Exception:  # noqa: S110 - abandoned: the caller deletes the keys anyway
                    pass

    @abstractmethod
    def open(self, key: str) -> BinaryIO:
        """A streaming reader of the object (FileNotFoundError if there is none)."""

    def read_errors(self) -> contextlib.AbstractContextManager[None]:
        """Around reads of an :meth:`open` body: the backend's read failures as StorageError
        (the filesystem's are OSErrors already)."""
        return contextlib.nullcontext()

    @abstractmethod
    def download(self, key: str, dest: Path) -> None:
        """Copy the object into local file ``dest`` (0600; FileNotFoundError if none)."""

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def stat(self, key: str) -> StoredObject | None:
        """The object's size and last-modified time, or None if there is none."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Delete the object; a missing object is not an error."""

    @abstractmethod
    def delete_prefix(self, prefix: str) -> int:
        """Delete every object under ``prefix/``; returns how many."""

    @abstractmethod
    def list(self, prefix: str) -> Iterator[StoredObject]:
        """Every object under ``prefix/`` with its last-modified time."""

    @abstractmethod
    def remove_stale_staging(self, *, older_than: float) -> int:
        """Remove staged uploads (of crashed processes) last modified before ``older_than``."""

    def presigned_url(self, key: str, *, filename: str, media_type: str) -> str | None:
        """A short-lived URL a client may GET the object from, or None (stream it instead)."""
        return None
