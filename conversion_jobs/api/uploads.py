"""Streams the multipart ``file`` part to a staged file while hashing it (the artifact store's
staging area on the filesystem backend, the web's work directory on S3).

An upload up to ``QUIRE_INLINE_SOURCE_MAX_BYTES`` stays in memory instead (no staging file): its
bytes go to Postgres with the acceptance (ADR 0017 session 10); a larger one spills to a staged
file the moment it crosses that size. Nothing larger is buffered in memory and nothing past the
size limit is stored: the handler refuses an
oversized ``Content-Length`` before reading, and stops (deleting the partial file) the moment a
chunked or lying upload crosses the limit.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from django.core.files.uploadedfile import UploadedFile
from django.core.files.uploadhandler import FileUploadHandler, StopFutureHandlers

from conversion_jobs import storage
from conversion_jobs.exceptions import PayloadTooLarge, UnexpectedFilePart
from conversion_jobs.services.acceptance import StagedUpload

# Room for the multipart envelope and the small form fields around the file.
ENVELOPE = 64 * 1024
FILE_FIELD = "file"


class StagedFile(UploadedFile):
    def __init__(self, staged: StagedUpload) -> None:
        super().__init__(file=None, name="upload", size=staged.size)
        self.staged = staged

    def close(self) -> None:
        """Nothing is open: the handler closed the staged file when it completed. (Django
        closes every parsed file when a later part fails; the staged path is removed by
        ``StagingUploadHandler.cleanup``.)"""


class StagingUploadHandler(FileUploadHandler):
    chunk_size = 256 * 1024

    def __init__(self, request: Any = None, *, max_bytes: int, inline_max: int = 0) -> None:
        super().__init__(request)
        self.max_bytes = max_bytes
        self.inline_max = inline_max
        self._parts = 0
        #: the upload so far while it is no larger than ``inline_max``; None once spilled
        self._buffer: bytearray | None = None
        self._fh: Any = None
        self._path: Path | None = None
        self._digest = hashlib.sha256()
        self._size = 0
        self.staged: list[Path] = []

    def handle_raw_input(
        self, input_data: Any, META: Any, content_length: int, boundary: Any, encoding: Any = None
    ) -> None:
        if content_length and content_length > self.max_bytes + ENVELOPE:
            raise PayloadTooLarge(
                f"the upload limit is {self.max_bytes} bytes", limit=self.max_bytes
            )

    def new_file(self, field_name: str, *args: Any, **kwargs: Any) -> None:
        super().new_file(field_name, *args, **kwargs)
        # One file part, named "file": anything else is refused before a byte of it is written
        # (otherwise 100 parts could each stage up to the size limit).
        if field_name != FILE_FIELD or self._parts:
            raise UnexpectedFilePart()
        self._parts += 1
        if self.inline_max > 0:
            self._buffer = bytearray()
        else:
            self._stage()
        self._digest = hashlib.sha256()
        self._size = 0
        raise StopFutureHandlers()

    def receive_data_chunk(self, raw_data: bytes, start: int) -> None:
        self._size += len(raw_data)
        if self._size > self.max_bytes:
            self.cleanup()
            raise PayloadTooLarge(
                f"the upload limit is {self.max_bytes} bytes", limit=self.max_bytes
            )
        self._digest.update(raw_data)
        if self._buffer is not None:
            if self._size <= self.inline_max:
                self._buffer += raw_data
                return None
            self._stage()  # past the inline size: what was kept in memory goes first
            self._fh.write(self._buffer)
            self._buffer = None
        self._fh.write(raw_data)
        return None

    def _stage(self) -> None:
        self._fh, self._path = storage.stage()
        self.staged.append(self._path)

    def file_complete(self, file_size: int) -> StagedFile:
        sha256 = self._digest.hexdigest()
        if self._buffer is not None:
            content = bytes(self._buffer)
            self._buffer = None
            return StagedFile(
                StagedUpload(path=None, sha256=sha256, size=self._size, content=content)
            )
        if self._fh is None or self._path is None:  # Django calls new_file() first
            raise RuntimeError("file_complete without new_file")
        self._fh.close()
        return StagedFile(StagedUpload(path=self._path, sha256=sha256, size=self._size))

    def upload_interrupted(self) -> None:
        self.cleanup()

    def cleanup(self) -> None:
        self._buffer = None
        if self._fh is not None and not self._fh.closed:
            self._fh.close()
        for path in self.staged:
            path.unlink(missing_ok=True)
