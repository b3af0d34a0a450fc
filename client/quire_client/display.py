"""How ``quire submit`` shows its work: rich progress bars on a terminal, plain lines otherwise,
JSON lines with ``--json``."""

from __future__ import annotations

import json
import sys
import time
from typing import Any, TextIO

from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    ProgressColumn,
    Task,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text

from quire_client.batch import NOT_SUCCEEDED, Item
from quire_client.models import Job
from quire_client.models import Progress as Snapshot


class RateColumn(ProgressColumn):
    """Items per second of a task (rich's own speed estimate)."""

    def render(self, task: Task) -> Text:
        unit = task.fields.get("unit", "")
        if task.speed is None:
            return Text(f"-- {unit}/s", style="progress.data.speed")
        return Text(f"{task.speed:.1f} {unit}/s", style="progress.data.speed")


class RichReporter:
    """One bar per file in flight (pages done / total, live from the event stream), an
    overall bar for files and one for pages, with their rate and the time left."""

    def __init__(self, console: Console | None = None) -> None:
        self.console = console or Console()
        self.bars = Progress(
            TextColumn("{task.description}", justify="left"),
            BarColumn(bar_width=None),
            TextColumn("{task.completed:>5.0f}/{task.fields[shown_total]} {task.fields[unit]}"),
            RateColumn(),
            TimeRemainingColumn(),
            TimeElapsedColumn(),
            console=self.console,
            refresh_per_second=8,
            expand=True,
        )
        self.files: TaskID | None = None
        self.pages: TaskID | None = None
        self.in_flight: dict[str, TaskID] = {}
        self.page_totals: dict[str, int] = {}
        self.page_done: dict[str, int] = {}

    def start(self, items: list[Item]) -> None:
        self.files = self.bars.add_task(
            "[bold]files", total=len(items), unit="files", shown_total=len(items)
        )
        self.pages = self.bars.add_task("[bold]pages", total=None, unit="pages", shown_total="?")
        self.bars.start()

    def _pages_total(self) -> None:
        assert self.pages is not None  # noqa: S101
        total = sum(self.page_totals.values())
        self.bars.update(
            self.pages,
            total=total or None,
            completed=sum(self.page_done.values()),
            shown_total=total or "?",
        )

    def skipped(self, item: Item) -> None:
        assert self.files is not None  # noqa: S101
        self.bars.advance(self.files)

    def submitted(self, item: Item, job: Job) -> None:
        pass  # a bar appears once the file is followed (in flight on the server)

    def progress(self, item: Item, snapshot: Snapshot) -> None:
        key = item.name
        total, done = snapshot.pages.total, snapshot.pages.done + snapshot.pages.failed
        if key not in self.in_flight:
            label = item.name if len(item.name) <= 28 else "…" + item.name[-27:]
            self.in_flight[key] = self.bars.add_task(
                f"  {label}",
                total=total,
                unit="pages",
                shown_total=total if total is not None else "?",
            )
        self.bars.update(
            self.in_flight[key],
            total=total,
            completed=done,
            shown_total=total if total is not None else "?",
        )
        if total is not None:
            self.page_totals[key] = total
        self.page_done[key] = done
        self._pages_total()

    def finished(self, item: Item) -> None:
        assert self.files is not None  # noqa: S101
        task = self.in_flight.pop(item.name, None)
        if task is not None:
            self.bars.remove_task(task)
        self.bars.advance(self.files)
        if item.state in NOT_SUCCEEDED:
            self.bars.console.print(
                f"[red]{item.state}[/red] {item.name}: {item.error_code or item.state}"
            )

    def stop(self) -> None:
        self.bars.stop()


class PlainReporter:
    """One line per event, for logs and pipes."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stdout
        self.total = 0
        self.done = 0
        self.started = time.monotonic()

    def _line(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def start(self, items: list[Item]) -> None:
        self.total = len(items)
        self._line(f"quire: {self.total} files")

    def skipped(self, item: Item) -> None:
        self.done += 1
        self._line(
            f"[{self.done}/{self.total}] skipped {item.name} (already downloaded and verified)"
        )

    def submitted(self, item: Item, job: Job) -> None:
        self._line(f"submitted {item.name} job {job.id}")

    def progress(self, item: Item, snapshot: Snapshot) -> None:
        pass  # page counters would flood a log; the outcome line follows

    def finished(self, item: Item) -> None:
        self.done += 1
        if item.state in NOT_SUCCEEDED:
            self._line(
                f"[{self.done}/{self.total}] {item.state} {item.name}:"
                f" {item.error_code or item.state}"
            )
        else:
            self._line(f"[{self.done}/{self.total}] {item.state} {item.name} -> {item.result_path}")

    def stop(self) -> None:
        pass


class JsonReporter:
    """JSON lines (one object per event, ``event`` names it), for scripts."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stdout

    def emit(self, event: str, **fields: Any) -> None:
        print(json.dumps({"event": event, **fields}, default=str), file=self.stream, flush=True)

    def start(self, items: list[Item]) -> None:
        self.emit("start", files=len(items))

    def emit_item(self, event: str, item: Item, **fields: Any) -> None:
        """An event about one file: its name, job and state, and ``fields``."""
        self.emit(event, file=item.name, job_id=item.job_id, state=item.state, **fields)

    def skipped(self, item: Item) -> None:
        self.emit_item("skipped", item, result=str(item.result_path))

    def submitted(self, item: Item, job: Job) -> None:
        self.emit("submitted", file=item.name, job_id=job.id, state=job.state)

    def progress(self, item: Item, snapshot: Snapshot) -> None:
        self.emit(
            "progress",
            file=item.name,
            job_id=snapshot.id,
            state=snapshot.state,
            pages_total=snapshot.pages.total,
            pages_done=snapshot.pages.done,
            pages_failed=snapshot.pages.failed,
        )

    def finished(self, item: Item) -> None:
        result = str(item.result_path) if item.result_path else None
        self.emit_item("finished", item, error_code=item.error_code, result=result)

    def stop(self) -> None:
        pass
