"""Page checkpoints of a running attempt, written in batches (DESIGN.md §7.4)."""

from __future__ import annotations

import time
from concurrent.futures import Future, wait
from pathlib import Path
from typing import Any

from conversion_jobs import storage
from conversion_jobs.models import PageCheckpoint
from conversion_jobs.services import execution
from conversion_jobs.services.db_retry import db_retry, lease_ttl_s
from conversion_jobs.services.execution import Lease


class CheckpointBatch:
    """Finished pages waiting for their fenced checkpoint write. Writing one transaction per
    page made the commit (a WAL flush) the cost of a text page; a batch is written when it holds
    ``MAX_PAGES`` pages or its oldest page has waited ``MAX_WAIT_S``, always before a failed page
    or an error, and the last batch inside the publishing transaction. A crash loses at most one
    batch, which a resumed attempt converts again; a page is never skipped unless its checkpoint
    committed. Page files are renamed into storage at once and ``fsync``ed on background threads;
    every one of them, and their directory, is on disk before their checkpoints are written
    (``durable``). Artifacts of pages that never got their checkpoint are deleted on the way out,
    so nothing is orphaned."""

    MAX_PAGES = 256
    MAX_WAIT_S = 0.25

    def __init__(self, lease: Lease, checkpoints: dict[int, Any]) -> None:
        self.lease, self.checkpoints = lease, checkpoints
        self.pending: list[PageCheckpoint] = []
        self.syncs: list[Future] = []
        self.directories: set[Path] = set()
        self.since = 0.0

    def __enter__(self) -> CheckpointBatch:
        return self

    def __exit__(self, *exc: object) -> None:
        for future in self.syncs:
            future.cancel()
        wait(self.syncs)
        self.syncs = []
        for checkpoint in self.pending:  # never recorded: leave no artifact behind
            storage.delete(checkpoint.artifact_key or "")
        self.pending = []

    def add(self, checkpoint: PageCheckpoint, placed: Path) -> None:
        """``checkpoint``'s artifact has been placed at ``placed``; its fsync starts now."""
        if not self.pending:
            self.since = time.monotonic()
        self.pending.append(checkpoint)
        self.syncs.append(storage.sync_later(placed))
        self.directories.add(placed.parent)

    def durable(self) -> None:
        """Wait until every pending page file and its directory entry is on disk (an OSError
        here is a storage error: nothing gets recorded)."""
        syncs, self.syncs = self.syncs, []
        for future in syncs:
            future.result()
        for directory in sorted(self.directories):
            storage.fsync_dir(directory)
        self.directories = set()

    def flush_if_due(self) -> None:
        if len(self.pending) >= self.MAX_PAGES or (
            self.pending and time.monotonic() - self.since >= self.MAX_WAIT_S
        ):
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        self.durable()
        batch = list(self.pending)
        db_retry(
            lambda: execution.page_checkpoints_record(lease=self.lease, checkpoints=batch),
            deadline_s=lease_ttl_s(),
        )
        self.written()

    def written(self) -> None:
        """The pending checkpoints committed (here or in the publishing transaction)."""
        for checkpoint in self.pending:
            self.checkpoints[checkpoint.page_number] = checkpoint
        self.pending = []
