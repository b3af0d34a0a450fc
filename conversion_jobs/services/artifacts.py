"""Who may delete a stored object, and when (docs/ARCHITECTURE.md §6, ADR 0018).

Objects are created before the rows that name them and deleted after: so a crash between a put
and its commit leaves an object no row names. ``artifacts_remove_orphans`` finds those once
they are older than ``QUIRE_ORPHAN_GRACE_S`` — far longer than any put-to-commit gap (a page's
checkpoint batch, a result's publish, an upload's acceptance transaction all commit within a
lease or give up) — and deletes them, on either backend.

Sources are content-addressed and shared: a new job may reuse an object at the very moment a
deleter decides nobody names it. ``source_lock`` serialises the two on the source's digest: the
accepting transaction holds it shared while it checks the object is still there and inserts its
row; a deleter holds it exclusively while it checks no row names the object and deletes it.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import defaultdict

from django.conf import settings
from django.db import transaction

from conversion_jobs import storage
from conversion_jobs.models import ConversionJob, JobRange, PageCheckpoint
from conversion_jobs.store.sources import source_lock

log = logging.getLogger(__name__)


def source_delete_if_unused(
    *, sha256: str, key: str, live_only: bool, grace_s: float | None = None
) -> bool:
    """Delete source ``key`` if no job still needs it: with ``live_only`` (retention) no
    unexpired job, otherwise (orphans) no unpurged job. An object younger than the grace period
    is kept: an acceptance that uploaded it may be about to commit without the lock (the orphan
    sweep takes it later if it stays unnamed). Returns whether it was deleted."""
    grace_s = grace_s if grace_s is not None else float(settings.QUIRE["ORPHAN_GRACE_S"])
    with transaction.atomic():
        source_lock(sha256=sha256, exclusive=True)
        users = ConversionJob.objects.filter(source_sha256=sha256)
        users = (
            users.filter(expired_at__isnull=True)
            if live_only
            else users.filter(purged_at__isnull=True)
        )
        if users.exists():
            return False
        found = storage.store().stat(key)
        if found is None or found.modified > time.time() - grace_s:
            return False
        storage.delete(key)  # inside the lock: no acceptance can start naming it meanwhile
        return True


def artifacts_remove_orphans(*, grace_s: float | None = None, batch: int | None = None) -> int:
    """Delete stored objects older than the grace period that no row names. Returns how many."""
    grace_s = grace_s if grace_s is not None else float(settings.QUIRE["ORPHAN_GRACE_S"])
    batch = batch or int(settings.QUIRE["SWEEP_BATCH"])
    cutoff = time.time() - grace_s
    removed = 0
    for prefix in ("pages", "results", "sources"):
        old: list[storage.ParsedKey] = []
        keys: list[str] = []
        for obj in storage.list_objects(prefix):
            parsed = storage.parse_key(obj.key)
            if parsed is None or obj.modified >= cutoff:
                continue  # young, or not a key Quire writes: never ours to delete
            old.append(parsed)
            keys.append(obj.key)
            if len(keys) >= batch:
                break
        if keys:
            removed += _remove_unnamed(prefix, keys, old, grace_s)
    removed += storage.store().remove_stale_staging(older_than=cutoff)
    if removed:
        log.info("orphaned artifacts removed", extra={"objects": removed})
    return removed


def _remove_unnamed(
    prefix: str, keys: list[str], parsed: list[storage.ParsedKey], grace_s: float
) -> int:
    removed = 0
    if prefix == "sources":
        for key, p in zip(keys, parsed, strict=True):
            removed += source_delete_if_unused(
                sha256=p.sha256 or "", key=key, live_only=False, grace_s=grace_s
            )
        return removed
    by_job: dict[uuid.UUID, list[str]] = defaultdict(list)
    for key, p in zip(keys, parsed, strict=True):
        if p.job_id is not None:
            by_job[p.job_id].append(key)
    if prefix == "pages":
        named = set(
            PageCheckpoint.objects.filter(job_id__in=by_job).values_list("artifact_key", flat=True)
        )
        # the PDF an Office document was converted to once, split by its page ranges (ADR 0023)
        named |= set(
            JobRange.objects.filter(job_id__in=by_job, document_key__isnull=False).values_list(
                "document_key", flat=True
            )
        )
    else:
        named = set(
            ConversionJob.objects.filter(id__in=by_job, purged_at__isnull=True).values_list(
                "result_key", flat=True
            )
        )
    # An object this old whose row has not committed never will: its lease ran out long ago,
    # and every later write under it is fenced out.
    for job_keys in by_job.values():
        for key in job_keys:
            if key not in named:
                storage.delete(key)
                removed += 1
    return removed
