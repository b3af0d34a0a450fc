"""Where a job's source lives: the artifact store, or its ``inline_source`` row (ADR 0017
session 10). The rollback of migration 0012 moves every inline source to the store."""

from __future__ import annotations

import uuid

from django.db import transaction

from conversion_jobs import storage
from conversion_jobs.exceptions import StorageUnavailable
from conversion_jobs.models import ConversionJob, InlineSource
from conversion_jobs.services.artifacts import source_lock


def inline_sources_store(*, batch: int = 100) -> int:
    """Write every inline source to the artifact store (content-addressed, reusing an object
    with the same bytes) and repoint its job at it, then delete the row: object first, rows
    second. Safe while the service runs: a job claimed meanwhile read its bytes with its claim,
    a later claim reads the stored key. Returns how many jobs were repointed."""
    moved = 0
    while True:
        rows = list(
            InlineSource.objects.order_by("job_id").values_list("job_id", "content")[:batch]
        )
        if not rows:
            return moved
        for job_id, content in rows:
            moved += _store_one(job_id=job_id, content=bytes(content))


def _store_one(*, job_id: uuid.UUID, content: bytes) -> int:
    sha = ConversionJob.objects.filter(id=job_id).values_list("source_sha256", flat=True).first()
    if sha is None:  # pragma: no cover - the row goes with its job
        return 0
    handle, path = storage.stage()
    try:
        with handle:
            handle.write(content)
        key, _ = storage.put_source(path, sha)
    except storage.StorageError as exc:
        raise StorageUnavailable() from exc
    finally:
        path.unlink(missing_ok=True)
    with transaction.atomic():
        # As an acceptance that reuses an object: under the source's lock it is still there.
        source_lock(sha256=sha, exclusive=False)
        if not storage.exists(key):
            raise StorageUnavailable("the stored source vanished; run the command again")
        repointed = ConversionJob.objects.filter(
            id=job_id, source_key=storage.inline_source_key(sha)
        ).update(source_key=key)
        InlineSource.objects.filter(job_id=job_id).delete()
    return repointed
