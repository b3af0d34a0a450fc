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


def test_work_dirs_remove_stale__both_layouts_dead_removed_live_and_young_kept(settings, make_job):
    from conversion_jobs.models import ConversionAttempt

    root = Path(settings.QUIRE["WORK_DIR"])
    job = make_job(state="running")
    live = ConversionAttempt.objects.create(job=job, generation=1, number=1, worker="w")
    dead_flat = aged(root / f"{uuid.uuid4()}.987655-abc")
    dead_nested = aged(root / str(uuid.uuid4()) / "987656-abc")
    live_flat = aged(root / f"{job.id}.{live.id}-abc")
    young_flat = root / f"{uuid.uuid4()}.987657-abc"
    young_flat.mkdir(parents=True)

    assert work_dirs_remove_stale(older_than_s=60) == 2
    assert not dead_flat.exists() and not dead_nested.exists()
    assert not dead_nested.parent.exists()  # the older layout's job directory goes too
    assert live_flat.is_dir() and young_flat.is_dir()
    assert root.is_dir()


def test_work_dirs_remove_stale__old_spare_removed_young_spare_kept(settings):
    from conversion_jobs.services.recovery import SPARE_WORKDIR_PREFIX

    root = Path(settings.QUIRE["WORK_DIR"])
    old_spare = aged(root / f"{SPARE_WORKDIR_PREFIX}{uuid.uuid4().hex}")
    young_spare = root / f"{SPARE_WORKDIR_PREFIX}{uuid.uuid4().hex}"
    young_spare.mkdir(parents=True)

    assert work_dirs_remove_stale(older_than_s=60) == 0  # spares are not counted
    assert not old_spare.exists()
    assert young_spare.is_dir()


def test_work_dirs_remove_stale__a_spare_with_files_is_never_emptied(settings):
    """A spare is removed by name only when empty (``rmdir``): were a worker to rename it into
    an attempt's name and write into it at that moment, no file of the attempt could go."""
    from conversion_jobs.services.recovery import SPARE_WORKDIR_PREFIX

    root = Path(settings.QUIRE["WORK_DIR"])
    spare = root / f"{SPARE_WORKDIR_PREFIX}{uuid.uuid4().hex}"
    spare.mkdir(parents=True)
    (spare / "source").write_bytes(b"x")
    aged(spare)

    work_dirs_remove_stale(older_than_s=60)
    assert (spare / "source").exists()
