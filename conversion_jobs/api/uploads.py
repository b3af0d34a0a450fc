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
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.exceptions import RequestDataTooBig
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


#: Bodies up to this size may take :func:`small_form` (read whole into memory: they are within
#: Django's own in-memory limit, ``DATA_UPLOAD_MAX_MEMORY_SIZE``, too).
SMALL_BODY_BYTES = 64 * 1024
#: ``multipart/form-data; boundary=...`` as every common client writes it (RFC 2046 bchars, no
#: space; quoted or not).
_SMALL_TYPE = re.compile(
    rb'multipart/form-data; ?boundary=("?)([0-9A-Za-z\'()+_,\-./:=?]{1,70})\1', re.IGNORECASE
)
_DISPOSITION = re.compile(
    rb'form-data; ?name="([A-Za-z0-9_.\-]{1,64})"(?:; ?filename="([A-Za-z0-9 _.\-()]{1,255})")?'
)
_MAX_SMALL_PARTS = 8


@dataclass(frozen=True)
class SmallForm:
    """A small multipart body in the plain shape: the text fields and the one file part."""

    fields: dict[str, str]
    file: bytes | None
    boundary: bytes


def small_form_parse(content_type: bytes, body: bytes) -> SmallForm | None:
    """``body`` split into its parts when it has the plain shape every common client sends
    (CRLF line ends, no preamble or epilogue, the boundary nowhere but between parts, parts
    with only ``Content-Disposition: form-data; name="…"`` and, on the one file part named
    ``file``, ``filename="…"`` and ``Content-Type``; unique names); None for anything else,
    which Django's parser then reads exactly as before (its errors, its limits).

    In the plain shape the split below and Django's ``MultiPartParser`` see the same parts,
    with field values decoded as Django decodes them (UTF-8, errors replaced). Django's parser
    proper was ≈ 10 % of the web's CPU per accepted 10 KB job (ADR 0017, session 6)."""
    kind = _SMALL_TYPE.fullmatch(content_type)
    if kind is None:
        return None
    dash = b"--" + kind.group(2)
    close = b"\r\n" + dash + b"--"
    if not body.startswith(dash + b"\r\n"):
        return None
    if body.endswith(close):
        inner = body[len(dash) + 2 : -len(close)]
    elif body.endswith(close + b"\r\n"):
        inner = body[len(dash) + 2 : -len(close) - 2]
    else:
        return None
    parts = inner.split(b"\r\n" + dash + b"\r\n")
    # The boundary anywhere else (inside a part, or a "\n--boundary" Django would also split
    # at) makes the shape ambiguous: Django decides.
    if len(parts) > _MAX_SMALL_PARTS or body.count(dash) != len(parts) + 1:
        return None
    fields: dict[str, str] = {}
    file: bytes | None = None
    for part in parts:
        head, blank, data = part.partition(b"\r\n\r\n")
        if not blank:
            return None
        disposition: re.Match[bytes] | None = None
        content_type_seen = False
        for line in head.split(b"\r\n"):
            name, colon, value = line.partition(b":")
            name, value = name.lower(), value.strip()
            if not colon or name.strip() != name:
                return None
            if name == b"content-disposition" and disposition is None:
                disposition = _DISPOSITION.fullmatch(value)
                if disposition is None:
                    return None
            elif name == b"content-type" and not content_type_seen and b"\r" not in value:
                content_type_seen = True
            else:
                return None
        if disposition is None:
            return None
        field = disposition.group(1).decode()
        if field in fields or (field == FILE_FIELD and file is not None):
            return None
        if disposition.group(2) is not None:  # a file part
            if field != FILE_FIELD or disposition.group(2).strip(b" .") == b"":
                return None
            file = data
        elif content_type_seen:
            return None
        else:
            fields[field] = data.decode("utf-8", errors="replace")
    return SmallForm(fields=fields, file=file, boundary=kind.group(2))


def small_form(request: Any, handler: StagingUploadHandler) -> tuple[dict[str, str], Any] | None:
    """The form fields and the staged ``file`` part (a :class:`StagedFile`, or None without
    one) of a small request in the plain shape (:func:`small_form_parse`), staged and hashed by
    ``handler`` as Django's parser would have it do (same limits, same errors); None when the
    request is larger or not in that shape: the caller lets Django's parser read it (the body
    read here stays readable: Django keeps it in ``request.body``)."""
    try:
        length = int(request.META.get("CONTENT_LENGTH") or 0)
    except ValueError:
        return None
    content_type = request.META.get("CONTENT_TYPE", "")
    limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    if (
        not 0 < length <= min(SMALL_BODY_BYTES, limit if limit is not None else length)
        or not content_type.startswith("multipart/form-data")
        or not content_type.isascii()
    ):
        return None
    try:
        body = request.body
    except RequestDataTooBig:  # more body than Content-Length said: Django's parser decides
        return None
    form = small_form_parse(content_type.encode("ascii"), body)
    if form is None:
        return None
    handler.handle_raw_input(None, request.META, length, form.boundary)
    upload = None
    if form.file is not None:
        try:
            handler.new_file(FILE_FIELD, "upload", "", None, None, {})
        except StopFutureHandlers:
            pass
        handler.receive_data_chunk(form.file, 0)
        upload = handler.file_complete(len(form.file))
    return form.fields, upload
