"""The stale-work-directory sweep removes dead attempts' directories and nothing else: never a
worker's sandbox directory (``<WORK_DIR>/.sandbox/<pid>-…``), however long it sat idle."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import pytest

from conversion_jobs.services.recovery import work_dirs_remove_stale

pytestmark = pytest.mark.django_db


def aged(path: Path, seconds: float = 3600) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    then = time.time() - seconds
    os.utime(path, (then, then))
    return path


def test_work_dirs_remove_stale__removes_a_dead_attempt_dir_and_keeps_an_idle_sandbox(settings):
    root = Path(settings.QUIRE["WORK_DIR"])
    dead = aged(root / str(uuid.uuid4()) / "987654-abc")
    sandbox = aged(root / ".sandbox" / f"{os.getpid()}-8e4a9c18d24f")
    (sandbox / "tmp").mkdir()
    aged(sandbox)

    assert work_dirs_remove_stale(older_than_s=1) == 1
    assert not dead.exists()
    assert (sandbox / "tmp").is_dir()
