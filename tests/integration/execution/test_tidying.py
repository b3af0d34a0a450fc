"""The end of an attempt after its task returns (ADR 0017, session 6; services/tidying.py): the
attempt's work dir is removed and the spare child started on the process's tidying thread, and
the process's next attempt starts converting only once that is done."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings

from conversion_jobs.models import ConversionJob
from conversion_jobs.services.tidying import tidy_later, tidy_wait
from conversion_jobs.states import State
from tests import testdocs
from tests.integration.execution.jobkit import (
    Worker,
    execute,
    submit,
    unique_text,
    work_dir_entries,
)
from tests.polling import wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("fast_quire")]


def _pdf(tmp_path: Path, name: str) -> Path:
    return testdocs.make_pdf(tmp_path / f"{name}.pdf", pages=1, text_of=unique_text(name))


def _work_dirs(job: ConversionJob) -> list[Path]:
    return sorted(Path(settings.QUIRE["WORK_DIR"]).glob(f"{job.id}.*"))


def test_next_attempt__waits_for_the_previous_attempts_tidying(tmp_path: Path) -> None:
    first = submit(_pdf(tmp_path, "first"), output="text")
    second = submit(_pdf(tmp_path, "second"), output="text")
    assert execute(first) == "succeeded"
    gate = threading.Event()
    tidy_later(gate.wait)  # the tidying thread is busy (after the first attempt's own tidying)
    worker = Worker(second.id, second.generation)
    worker.start()
    try:
        # The second attempt claims (its claim overlaps the tidying) and then waits: no work
        # dir, no page, while anything handed to the tidying thread before it is still to run.
        wait_for(
            lambda: ConversionJob.objects.get(id=second.id).state == State.RUNNING,
            timeout=10,
            what="the second job claimed",
        )
        assert worker.is_alive()
        assert _work_dirs(second) == []
        assert ConversionJob.objects.get(id=second.id).pages_done == 0
    finally:
        gate.set()
    assert worker.result() == "succeeded"
    tidy_wait()  # the second attempt's own tidying runs after its task returned
    assert _work_dirs(first) == [] and _work_dirs(second) == []
    assert work_dir_entries() == []


def test_next_attempt__takes_the_previous_attempts_emptied_work_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tidying empties the attempt's work dir and renames it to a spare; the process's next
    attempt renames the spare into its own name (one inode, no mkdir / rmdir per attempt) and
    finds nothing of the previous attempt in it."""
    from conversion_jobs.services import runner
    from conversion_jobs.services.recovery import SPARE_WORKDIR_PREFIX

    first = submit(_pdf(tmp_path, "first"), output="text")
    second = submit(_pdf(tmp_path, "second"), output="text")
    assert execute(first) == "succeeded"
    tidy_wait()
    assert _work_dirs(first) == []  # the attempt's name is gone with its files
    spare = runner._spare_workdir
    assert spare is not None and spare[0] == os.getpid()
    assert spare[1].name.startswith(SPARE_WORKDIR_PREFIX)
    assert list(spare[1].iterdir()) == []
    inode = spare[1].stat().st_ino

    seen: dict[str, Any] = {}
    make = runner._workdir_make

    def watched(workdir: Path) -> Path:
        made = make(workdir)
        seen.update(inode=made.stat().st_ino, entries=list(made.iterdir()), name=made.name)
        return made

    monkeypatch.setattr(runner, "_workdir_make", watched)
    assert execute(second) == "succeeded"
    assert seen["inode"] == inode and seen["entries"] == []
    assert seen["name"].startswith(f"{second.id}.")
    assert not spare[1].exists()
    assert work_dir_entries() == []


def test_next_attempt__makes_a_work_dir_when_its_spare_is_gone(tmp_path: Path) -> None:
    """The stale-work-dir sweep may remove an idle process's spare: the next attempt makes a
    new directory."""
    from conversion_jobs.services import runner

    first = submit(_pdf(tmp_path, "first"), output="text")
    second = submit(_pdf(tmp_path, "second"), output="text")
    assert execute(first) == "succeeded"
    tidy_wait()
    spare = runner._spare_workdir
    assert spare is not None
    spare[1].rmdir()
    assert execute(second) == "succeeded"
    assert ConversionJob.objects.get(id=second.id).state == State.SUCCEEDED
    assert work_dir_entries() == []
