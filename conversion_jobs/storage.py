"""Artifact storage on a filesystem shared by web and workers (a local disk, NFS, or a mounted
bucket). Every file is written elsewhere first and renamed onto its key, so a reader never sees
half a file: ``promote`` fsyncs before the rename; ``place`` (page files) renames at once and
leaves the fsync to the caller (``sync_later``, ``fsync_dir``) before the key is recorded.

Keys:
* ``sources/ab/<sha256>`` — content-addressed uploads (a retried upload reuses its key);
* ``pages/<job>/<page>.g<generation>.<ext>`` — page artifacts, derived from the job and the
  generation, so a stale worker can never overwrite what a later generation checkpointed;
* ``results/<job>/result.g<generation>.<ext>`` — the published result, likewise.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import tempfile
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO

from django.conf import settings

CHUNK = 1024 * 1024


def root() -> Path:
    return Path(str(settings.QUIRE["STORAGE_DIR"]))


def path_of(key: str) -> Path:
    if ".." in key.split("/") or key.startswith("/"):
        raise ValueError("invalid storage key")
    return root() / key


def staging_file() -> tuple[BinaryIO, Path]:
    """An open temporary file on the storage filesystem, for streaming an upload into."""
    staging = root() / "staging"
    staging.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=staging, prefix="up-")
    return os.fdopen(fd, "wb"), Path(name)


def source_key(sha256: str) -> str:
    return f"sources/{sha256[:2]}/{sha256}"


def page_key(*, job_id: uuid.UUID, page: int, ext: str) -> str:
    return f"pages/{job_id}/{page:05d}.{ext}"


def result_key(*, job_id: uuid.UUID, ext: str) -> str:
    return f"results/{job_id}/result.{ext}"


def promote(src: Path, key: str) -> Path:
    """Move ``src`` under ``key`` atomically, its bytes on disk before its name appears."""
    return _move(src, key, sync=True)


def place(src: Path, key: str) -> Path:
    """Move ``src`` under ``key`` atomically without waiting for the disk: the caller makes it
    durable (``sync_later`` + ``fsync_dir``) before anything records the key. Page files only:
    their keys carry the generation, so a name left by a crash before that is never looked up."""
    return _move(src, key, sync=False)


def _move(src: Path, key: str, *, sync: bool) -> Path:
    """Rename ``src`` onto ``key`` (through a temporary name when it is on another
    filesystem), fsyncing its bytes first if ``sync``."""
    dest = path_of(key)
    dest.parent.mkdir(parents=True, exist_ok=True)
    if sync:
        _fsync(src)
    try:
        os.replace(src, dest)
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
        tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex}.tmp")
        shutil.copyfile(src, tmp)
        if sync:
            _fsync(tmp)
        os.replace(tmp, dest)
        src.unlink(missing_ok=True)
    return dest


_sync_pool: tuple[int, ThreadPoolExecutor] | None = None


def sync_later(path: Path) -> Future:
    """``fsync`` ``path`` on a background thread (several in flight share the filesystem's
    journal commits); wait for the future before recording the file anywhere."""
    global _sync_pool
    if _sync_pool is None or _sync_pool[0] != os.getpid():  # threads do not survive a fork
        _sync_pool = (os.getpid(), ThreadPoolExecutor(max_workers=4, thread_name_prefix="fsync"))
    return _sync_pool[1].submit(_fsync, path)


def _fsync(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def fsync_dir(path: Path) -> None:
    """Make the names created in directory ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def promote_source(staged: Path, sha256: str) -> str:
    """Content-addressed: an existing copy of the same bytes is kept and the staged one dropped."""
    key = source_key(sha256)
    if path_of(key).exists():
        staged.unlink(missing_ok=True)
    else:
        promote(staged, key)
    return key


def sha256_file(path: Path) -> tuple[str, int]:
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


def delete(key: str) -> None:
    path_of(key).unlink(missing_ok=True)


def delete_tree(prefix: str) -> None:
    shutil.rmtree(path_of(prefix), ignore_errors=True)
