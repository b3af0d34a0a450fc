"""Clear ``PROMETHEUS_MULTIPROC_DIR`` of dead processes' files (the Procfile's ``release``):
prometheus-client's multiprocess files must not outlive the processes that wrote them across
deploys. Files of processes still running on this machine are kept: deleting them would make
every series those processes hold (the zero series included) vanish from the scrape until they
restart. Counters of the removed processes restart from zero, which Prometheus handles as a
reset."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand


class Command(BaseCommand):
    help = "Reset the prometheus-client multiprocess directory."

    def handle(self, *args: Any, **options: Any) -> None:
        target = Path(os.environ.get("PROMETHEUS_MULTIPROC_DIR") or "var/metrics")
        target.mkdir(parents=True, exist_ok=True)
        removed = kept = 0
        for path in target.iterdir():
            pid = _writer_pid(path)
            if pid is not None and _alive(pid):
                kept += 1
                continue
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            removed += 1
        self.stdout.write(
            f"metrics directory reset: {target} ({removed} removed, {kept} of live processes kept)"
        )


def _writer_pid(path: Path) -> int | None:
    """The pid in a multiprocess file's name (``counter_123.db``, ``gauge_livesum_123.db``)."""
    if path.suffix != ".db":
        return None
    tail = path.stem.rsplit("_", 1)[-1]
    return int(tail) if tail.isdigit() else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by another user
        return True
    return True
