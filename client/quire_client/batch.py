"""``quire submit``'s engine: converts many files with bounded concurrency, resumable from its
manifest (:mod:`quire_client.manifest`).

Two stages run at once, each with ``concurrency`` tasks: submitters upload files (or, on a
re-run, pick up the job recorded for them) and hand the job to followers, which follow its
progress over SSE, then download and verify the result. Submitting never waits for a conversion,
so the submit rate is the server's accept rate; a server at its quota answers 429 and the
client waits as ``Retry-After`` says.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from quire_client import errors
from quire_client._core import sha256_file
from quire_client.aio import AsyncClient
from quire_client.manifest import (
    MANIFEST_NAME,
    Manifest,
    Written,
    idempotency_key,
    options_fingerprint,
)
from quire_client.models import Job, Progress

#: the result file's extension per output (docs/API_CONTRACT.md §2.6)
RESULT_EXT = {"text": "txt", "png": "zip", "pdf": "pdf"}
#: job states that are not a success (exit code 2)
NOT_SUCCEEDED = frozenset({"partial", "failed", "cancelled", "rejected"})


@dataclass
class Item:
    """One source file of the batch."""

    source: Path
    name: str  # its path relative to the argument it came from (what the user sees)
    dest: Path  # where its result goes
    sha256: str = ""
    job_id: str | None = None
    state: str = "pending"
    error_code: str | None = None
    result_path: Path | None = None
    skipped: bool = False
    job: Job | None = None  # the last representation seen (a terminal one needs no following)


@dataclass
class Outcome:
    """What a batch did, per file."""

    items: list[Item] = field(default_factory=list)

    @property
    def failures(self) -> list[Item]:
        """Files that did not succeed (each with its state and code)."""
        return [i for i in self.items if i.state in NOT_SUCCEEDED]

    @property
    def exit_code(self) -> int:
        """0 when every file succeeded, 2 when any did not."""
        return 2 if self.failures else 0


class Reporter(Protocol):
    """What the batch tells its display (rich bars, plain lines or JSON lines)."""

    def start(self, items: list[Item]) -> None: ...
    def skipped(self, item: Item) -> None: ...
    def submitted(self, item: Item, job: Job) -> None: ...
    def progress(self, item: Item, snapshot: Progress) -> None: ...
    def finished(self, item: Item) -> None: ...
    def stop(self) -> None: ...


def collect(paths: Iterable[Path], out: Path, output: str) -> list[Item]:
    """The files named, directories walked (sorted; hidden files and the output directory
    skipped). A result is named after its source plus the output's extension
    (``report.pdf`` -> ``report.pdf.txt``), under the same relative directory."""
    items: list[Item] = []
    out_resolved = out.resolve()
    seen_dest: set[Path] = set()
    for arg in paths:
        if arg.is_dir():
            found = sorted(
                p
                for p in arg.rglob("*")
                if p.is_file()
                and not any(part.startswith(".") for part in p.relative_to(arg).parts)
                and out_resolved not in p.resolve().parents
            )
            pairs = [(p, p.relative_to(arg).as_posix()) for p in found]
        elif arg.is_file():
            pairs = [(arg, arg.name)]
        else:
            raise FileNotFoundError(f"no such file or directory: {arg}")
        for source, name in pairs:
            if source.name == MANIFEST_NAME:
                continue
            dest = out / f"{name}.{RESULT_EXT[output]}"
            if dest in seen_dest:  # the same relative name from two arguments
                dest = out / f"{name}.{len(items)}.{RESULT_EXT[output]}"
            seen_dest.add(dest)
            items.append(Item(source=source.resolve(), name=name, dest=dest))
    return items


class Batch:
    """One ``quire submit`` run."""

    def __init__(
        self,
        client: AsyncClient,
        *,
        items: list[Item],
        output: str,
        options: dict[str, Any],
        out: Path,
        concurrency: int,
        reporter: Reporter,
    ) -> None:
        self.client = client
        self.items = items
        self.output = output
        self.options = options
        self.fingerprint = options_fingerprint(output, options)
        self.manifest = Manifest(out)
        self.concurrency = max(1, concurrency)
        self.reporter = reporter

    async def run(self) -> Outcome:
        """Convert every file; raises :class:`~quire_client.errors.ConnectionFailed` or an
        authentication error (401 / 403) when the whole batch cannot go on."""
        pending: asyncio.Queue[Item | None] = asyncio.Queue()
        follow: asyncio.Queue[Item | None] = asyncio.Queue()
        self.reporter.start(self.items)
        try:
            for item in self.items:
                item.sha256 = await asyncio.to_thread(sha256_file, item.source)
                entry = self.manifest.begin(
                    str(item.source), sha256=item.sha256, fingerprint=self.fingerprint
                )
                if entry.verified_result(sha256=item.sha256, fingerprint=self.fingerprint):
                    item.job_id, item.state, item.skipped = entry.job_id, entry.state, True
                    item.error_code = entry.error_code
                    item.result_path = Path(entry.result_path or "")
                    self.reporter.skipped(item)
                    continue
                item.job_id = entry.job_id
                pending.put_nowait(item)
            submitters = [
                asyncio.create_task(self._submitter(pending, follow))
                for _ in range(self.concurrency)
            ]
            followers = [
                asyncio.create_task(self._follower(follow)) for _ in range(self.concurrency)
            ]
            for _ in submitters:
                pending.put_nowait(None)
            try:
                await asyncio.gather(*submitters)
                for _ in followers:
                    follow.put_nowait(None)
                await asyncio.gather(*followers)
            except BaseException:
                for task in (*submitters, *followers):
                    task.cancel()
                await asyncio.gather(*submitters, *followers, return_exceptions=True)
                raise
        finally:
            self.reporter.stop()
            self.manifest.close()
        return Outcome(items=self.items)

    async def _submitter(
        self, pending: asyncio.Queue[Item | None], follow: asyncio.Queue[Item | None]
    ) -> None:
        while (item := await pending.get()) is not None:
            if item.job_id is not None:
                # A re-run: the job recorded for this content and request is followed, not
                # uploaded again (one GET). Gone (retention): submitted again below, with the
                # same key.
                try:
                    job = await self.client.get(item.job_id)
                except errors.NotFound:
                    item.job_id = None
                else:
                    item.job = job
                    self.reporter.submitted(item, job)
                    follow.put_nowait(item)
                    continue
            try:
                job = await self.client.submit(
                    item.source,
                    output=self.output,
                    options=self.options,
                    idempotency_key=idempotency_key(item.sha256, self.fingerprint),
                )
            except (errors.NotAuthenticated, errors.InvalidToken, errors.InsufficientScope):
                raise
            except errors.ClientError as exc:
                # Refused for this file (415, 413, 422, 400): listed with its code.
                self._finish(item, state="rejected", error_code=exc.code)
                continue
            item.job_id, item.job = job.id, job
            self.manifest.submitted(str(item.source), job_id=job.id)
            self.reporter.submitted(item, job)
            follow.put_nowait(item)

    async def _follower(self, follow: asyncio.Queue[Item | None]) -> None:
        while (item := await follow.get()) is not None:
            assert item.job_id is not None  # noqa: S101 - only submitted items are followed
            job = item.job
            if job is None or not job.terminal:
                # A job already terminal when submitted or picked up again (a replay, a
                # re-run) has nothing to follow: straight to its result.
                async for snapshot in self.client.watch(item.job_id):
                    self.reporter.progress(item, snapshot)
                job = await self.client.get(item.job_id)
            await self._conclude(item, job)

    async def _conclude(self, item: Item, job: Job) -> None:
        code = job.error.code if job.error else None
        if job.state == "partial":
            failed = [
                p.error_code or "page_failed"
                for p in await self.client.pages(job.id)
                if p.state == "failed"
            ]
            code = ",".join(sorted(set(failed))) or "page_failed"
        elif job.state == "cancelled":
            code = code or "cancelled"
        if job.result is None:
            if job.state == "succeeded":  # expired by retention before it was fetched
                self._finish(item, state="failed", error_code="no_result")
            else:
                self._finish(item, state=job.state, error_code=code)
            return
        try:
            path = await self.client.download(job.id, item.dest, sha256=job.result.sha256)
        except (errors.DigestMismatch, errors.NoResult, errors.NotFound) as exc:
            self._finish(item, state="failed", error_code=exc.code)
            return
        written = Written(path=path, sha256=job.result.sha256, size=os.path.getsize(path))
        self._finish(item, state=job.state, error_code=code, result=written)

    def _finish(
        self, item: Item, *, state: str, error_code: str | None, result: Written | None = None
    ) -> None:
        item.state, item.error_code = state, error_code
        item.result_path = result.path if result else None
        self.manifest.finished(str(item.source), state=state, error_code=error_code, result=result)
        self.reporter.finished(item)
