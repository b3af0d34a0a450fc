"""The artifact store (docs/ARCHITECTURE.md §6): one small interface, two backends,
chosen by settings.

``QUIRE_STORAGE=filesystem`` (the default, and the standalone profile) keeps objects under
``QUIRE_STORAGE_DIR``; ``QUIRE_STORAGE=s3`` keeps them in an S3-compatible bucket
(``QUIRE_S3_*``, credentials from the environment). Everything that reads or writes an artifact
calls the functions below; a host's local disk is used only for work directories.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from django.conf import settings

from .base import (
    CHUNK,
    INLINE_PREFIX,
    ArtifactStore,
    ParsedKey,
    Put,
    StorageError,
    StoredObject,
    inline_source_key,
    is_inline_source,
    page_key,
    parse_key,
    result_key,
    sha256_file,
    source_key,
)
from .filesystem import FilesystemStore

__all__ = [
    "CHUNK",
    "INLINE_PREFIX",
    "ArtifactStore",
    "ParsedKey",
    "Put",
    "StorageError",
    "StoredObject",
    "inline_source_key",
    "is_inline_source",
    "page_key",
    "parse_key",
    "result_key",
    "sha256_file",
    "source_key",
    "store",
]

_stores: dict[tuple[Any, ...], ArtifactStore] = {}


def _config() -> tuple[Any, ...]:
    quire = settings.QUIRE
    kind = quire.get("STORAGE", "filesystem")
    if kind == "filesystem":
        return (kind, str(quire["STORAGE_DIR"]))
    if kind == "s3":
        s3 = quire["S3"]
        return (
            kind,
            s3["BUCKET"],
            s3["ENDPOINT_URL"],
            s3["REGION"],
            s3["ADDRESSING_STYLE"],
            s3["PREFIX"],
            float(s3["PRESIGN_TTL_S"]),
            str(quire["UPLOAD_DIR"]),
        )
    raise StorageError(f"unknown QUIRE_STORAGE {kind!r} (filesystem or s3)")


def store() -> ArtifactStore:
    """This process's store for the current settings (one per process: clients, connection
    pools and threads do not survive a fork)."""
    config = _config()
    key = (os.getpid(), *config)
    found = _stores.get(key)
    if found is None:
        if config[0] == "filesystem":
            found = FilesystemStore(Path(config[1]))
        else:
            # Imported when configured: boto3 costs every process that never uses S3 ~0.2 s.
            from .s3 import S3Store

            found = S3Store(
                bucket=config[1],
                endpoint_url=config[2],
                region=config[3],
                addressing_style=config[4],
                prefix=config[5],
                presign_ttl_s=config[6],
                staging_dir=Path(config[7]),
            )
        _stores[key] = found
    return found


# Thin module-level calls, so call sites read ``storage.delete(key)``.


def stage() -> tuple[BinaryIO, Path]:
    return store().stage()


def put_file(key: str, path: Path, *, wait: bool = True, sha256: str | None = None) -> Put:
    return store().put_file(key, path, wait=wait, sha256=sha256)


def put(key: str, stream: BinaryIO) -> None:
    store().put(key, stream)


def settle(puts: list[Put]) -> None:
    store().settle(puts)


def abandon(puts: list[Put]) -> None:
    store().abandon(puts)


def put_source(staged: Path, sha256: str) -> tuple[str, bool]:
    """Content-addressed: an object with the same bytes is reused, never uploaded twice.
    Returns the key and whether this call uploaded it. The caller removes ``staged``."""
    key = source_key(sha256)
    return key, store().put_file_if_absent(key, staged, sha256=sha256)


def open_object(key: str) -> BinaryIO:
    return store().open(key)


def read_errors() -> contextlib.AbstractContextManager[None]:
    """Around reads of an ``open_object`` body: the backend's read failures as StorageError."""
    return store().read_errors()


def download(key: str, dest: Path) -> None:
    store().download(key, dest)


def exists(key: str) -> bool:
    return store().exists(key)


def delete(key: str) -> None:
    store().delete(key)


def delete_prefix(prefix: str) -> int:
    return store().delete_prefix(prefix)


def list_objects(prefix: str) -> Iterator[StoredObject]:
    return store().list(prefix)


def presigned_url(key: str, *, filename: str, media_type: str) -> str | None:
    return store().presigned_url(key, filename=filename, media_type=media_type)
