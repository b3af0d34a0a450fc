"""The filesystem backend: a directory (local disk, or one filesystem every host mounts).

Every object is written elsewhere first (the attempt's work directory, or ``staging/`` for
uploads) and renamed onto its key, so a reader never sees half a file. A waited put fsyncs the
file before the rename and the directory after it; an unwaited one (page files) renames at once
and fsyncs both on background threads, and ``settle`` waits for them before the key is recorded.
Files are 0600 and directories 0700: readable by the service's user only.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO

from .base import CHUNK, ArtifactStore, Put, StoredObject, check_key

FILE_MODE = 0o600
DIR_MODE = 0o700


class FilesystemStore(ArtifactStore):
    kind = "filesystem"

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._pool: ThreadPoolExecutor | None = None

    # --- paths ----------------------------------------------------------------------------

    def path_of(self, key: str) -> Path:
        return self.root / check_key(key)

    def _dir(self, path: Path) -> Path:
        """Create ``path`` and its missing parents up to the root, each 0700."""
        missing = []
        probe = path
        while not probe.is_dir():
            missing.append(probe)
            if probe == probe.parent:
                break
            probe = probe.parent
        for directory in reversed(missing):
            try:
                directory.mkdir(mode=DIR_MODE)
            except FileExistsError:
                pass
        return path

    # --- writes -----------------------------------------------------------------------------

    def stage(self) -> tuple[BinaryIO, Path]:
        # On the store's own filesystem, so storing the upload is a rename.
        fd, name = tempfile.mkstemp(dir=self._dir(self.root / "staging"), prefix="up-")
        return os.fdopen(fd, "wb"), Path(name)

    def put_file(
        self, key: str, path: Path, *, wait: bool = True, sha256: str | None = None
    ) -> Put:
        dest = self.path_of(key)
        self._dir(dest.parent)
        os.chmod(path, FILE_MODE)
        if wait:
            _fsync(path)
        _move(Path(path), dest, sync=wait)
        if wait:
            fsync_dir(dest.parent)
            return Put(key=key, local=dest)
        pending = self._sync_pool().submit(_fsync, dest)
        return Put(key=key, local=dest, pending=pending, directory=dest.parent)

    def put(self, key: str, stream: BinaryIO) -> None:
        fh, staged = self.stage()
        try:
            with fh:
                shutil.copyfileobj(stream, fh, CHUNK)
            self.put_file(key, staged)
        finally:
            staged.unlink(missing_ok=True)

    def settle(self, puts: list[Put]) -> None:
        directories = set()
        for put in puts:
            if put.pending is not None:
                put.pending.result()
                put.pending = None
            if put.directory is not None:
                directories.add(put.directory)
        for directory in sorted(directories):
            fsync_dir(directory)

    def _sync_pool(self) -> ThreadPoolExecutor:
        # Several fsyncs in flight share the filesystem's journal commits.
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="fsync")
        return self._pool

    def remove_stale_staging(self, *, older_than: float) -> int:
        return remove_older(self.root / "staging", older_than)

    # --- reads and deletes ------------------------------------------------------------------

    def open(self, key: str) -> BinaryIO:
        return open(self.path_of(key), "rb")

    def download(self, key: str, dest: Path) -> None:
        copy_out(self.path_of(key), dest)

    def exists(self, key: str) -> bool:
        return self.path_of(key).is_file()

    def stat(self, key: str) -> StoredObject | None:
        try:
            found = self.path_of(key).stat()
        except FileNotFoundError:
            return None
        return StoredObject(key=key, modified=found.st_mtime, size=found.st_size)

    def delete(self, key: str) -> None:
        self.path_of(key).unlink(missing_ok=True)

    def delete_prefix(self, prefix: str) -> int:
        folder = self.path_of(prefix)
        count = sum(1 for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else 0
        shutil.rmtree(folder, ignore_errors=True)
        return count

    def list(self, prefix: str) -> Iterator[StoredObject]:
        folder = self.path_of(prefix)
        if not folder.is_dir():
            return
        for path in folder.rglob("*"):
            try:
                if path.is_file():
                    stat = path.stat()
                    yield StoredObject(
                        key=path.relative_to(self.root).as_posix(),
                        modified=stat.st_mtime,
                        size=stat.st_size,
                    )
            except FileNotFoundError:  # deleted while we walked
                continue


def remove_older(folder: Path, older_than: float) -> int:
    removed = 0
    for path in folder.glob("up-*") if folder.is_dir() else []:
        try:
            if path.stat().st_mtime < older_than:
                path.unlink()
                removed += 1
        except FileNotFoundError:
            continue
    return removed


def _move(src: Path, dest: Path, *, sync: bool) -> None:
    """Rename ``src`` onto ``dest`` (through a temporary name when it is on another
    filesystem, fsynced first if ``sync``)."""
    try:
        os.replace(src, dest)
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
        tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex}.tmp")
        shutil.copyfile(src, tmp)
        os.chmod(tmp, FILE_MODE)
        if sync:
            _fsync(tmp)
        os.replace(tmp, dest)
        src.unlink(missing_ok=True)


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


def copy_out(source: Path, dest: Path) -> None:
    """``source``'s bytes in ``dest`` (created or truncated, ``FILE_MODE``): what
    ``shutil.copyfile`` and a ``chmod`` did, without their path-based checks (two ``samefile``
    stats, a FIFO test per side, a ``chmod`` by name): two opens, one ``sendfile`` for a small
    object, two closes. ≈ 45 -> ≈ 20 µs for a one-page PDF, once per attempt (the runner's
    source copy; ADR 0017, session 8). Objects are immutable once stored, so the size read at
    the start is the size to copy."""
    src = os.open(source, os.O_RDONLY | os.O_CLOEXEC)
    try:
        dst = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, FILE_MODE)
        try:
            os.fchmod(dst, FILE_MODE)  # an existing file keeps its mode through open()
            remaining = os.fstat(src).st_size
            while remaining > 0:
                sent = os.sendfile(dst, src, None, remaining)
                if not sent:
                    break
                remaining -= sent
        finally:
            os.close(dst)
    finally:
        os.close(src)
