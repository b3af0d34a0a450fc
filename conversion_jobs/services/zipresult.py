"""PNG results that are not stored a second time (ADR 0018, session-4 "zipres").

A PNG job's result is the ZIP of its done page artifacts in page order. Instead of building and
storing that archive, the worker publishes the key ``zip:results/<job>/result.g<n>.zip`` with
the sha256 and size of the bytes :mod:`conversion_jobs.converters.zipstream` writes from those
pages; ``GET /jobs/{id}/result`` streams the same bytes from the page objects. The key names no
object of its own: nothing lists, stats, presigns or deletes it (the pages are deleted with
the job's ``pages/<job>`` prefix by retention, as always).
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from conversion_jobs import storage
from conversion_jobs.converters import zipstream
from conversion_jobs.converters.base import RESULT_EXT
from conversion_jobs.exceptions import QuireError, StorageUnavailable
from conversion_jobs.models import ConversionJob, PageCheckpoint, PageState

#: ``result_key`` prefix of a PNG result that is the ZIP of the job's done pages (no object).
ZIP_PREFIX = "zip:"


def zip_result_key(*, job_id: uuid.UUID, generation: int) -> str:
    return ZIP_PREFIX + storage.result_key(
        job_id=job_id, generation=generation, ext=RESULT_EXT["png"]
    )


def is_zip_result(key: str | None) -> bool:
    return (key or "").startswith(ZIP_PREFIX)


class ResultIncomplete(QuireError, code="result_incomplete", status=500):
    """A page of this result is missing from the artifact store; the result cannot be served."""


class _StoredPage:
    """A page object opened for reading; a backend's read failure is a StorageError."""

    def __init__(self, key: str) -> None:
        self.key = key

    def __enter__(self) -> _StoredPage:
        self.body = storage.open_object(self.key)
        return self

    def read(self, size: int) -> bytes:
        with storage.read_errors():
            return self.body.read(size)

    def __exit__(self, *exc: object) -> None:
        self.body.close()


def _stored_opener(key: str) -> Any:
    return lambda: _StoredPage(key)


def _local_opener(path: Path) -> Any:
    return lambda: open(path, "rb")


def zip_result_digest(*, done: list[tuple[int, Any]], local: dict[int, Path]) -> tuple[str, int]:
    """Worker, at publish: sha256 and size of the result ZIP of the ``(page, checkpoint)`` done
    pages in page order, read from this attempt's local files, else from the store. Nothing is
    written."""
    entries = []
    for page, checkpoint in sorted(done, key=lambda item: item[0]):
        path = local.get(page)
        if path is not None:
            entries.append(
                zipstream.Entry(page=page, size=Path(path).stat().st_size, open=_local_opener(path))
            )
        else:
            key = checkpoint.artifact_key or ""
            entries.append(
                zipstream.Entry(
                    page=page, size=int(checkpoint.artifact_size), open=_stored_opener(key)
                )
            )
    digest = hashlib.sha256()
    size = 0
    for chunk in zipstream.zip_chunks(entries):
        digest.update(chunk)
        size += len(chunk)
    return digest.hexdigest(), size


def zip_result_stream(job: ConversionJob) -> Iterator[bytes]:
    """Web: the result ZIP's bytes, from the done pages of the terminal ``job``. Every page
    object is checked first (a missing one: :class:`ResultIncomplete`, the store down:
    :class:`StorageUnavailable`), so a response never starts that cannot complete; a page that
    vanishes or changes afterwards raises mid-stream and the connection is cut."""
    checkpoints = list(
        PageCheckpoint.objects.filter(job_id=job.id, state=PageState.DONE)
        .order_by("page_number")
        .only("page_number", "artifact_key", "artifact_size")
    )
    entries = []
    try:
        for checkpoint in checkpoints:
            key = checkpoint.artifact_key or ""
            found = storage.store().stat(key)
            if found is None or found.size != checkpoint.artifact_size:
                raise ResultIncomplete()
            entries.append(
                zipstream.Entry(
                    page=checkpoint.page_number, size=found.size, open=_stored_opener(key)
                )
            )
    except storage.StorageError as exc:
        raise StorageUnavailable() from exc
    if zipstream.zip_length([(e.page, e.size) for e in entries]) != job.result_size:
        raise ResultIncomplete()
    return zipstream.zip_chunks(entries)
