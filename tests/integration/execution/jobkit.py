"""Helpers for in-process execution tests: accept a real document, run the real worker path
(``conversion_job_execute``) with real converter child processes, inspect what it left."""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.db import connection

from conversion_jobs import storage
from conversion_jobs.converters import TEST_FAULTS_ENV, engines, sandbox, zygote
from conversion_jobs.models import ConversionJob
from conversion_jobs.services.acceptance import StagedUpload, conversion_job_accept
from conversion_jobs.services.checkpoints import (
    INLINE_PREFIX,
    inline_result_bytes,
    is_inline_result,
)
from conversion_jobs.services.runner import conversion_job_execute
from conversion_jobs.services.tidying import tidy_wait
from tests.polling import wait_for

CHILD_NAME = zygote.CHILD_NAME  # forked by the zygote: its cmdline is the zygote's


@pytest.fixture
def fast_quire(settings: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Short heartbeat and lease, and test faults honoured by this (worker) process."""
    settings.QUIRE = {**settings.QUIRE, "HEARTBEAT_S": 0.2, "LEASE_S": 2}
    monkeypatch.setenv(TEST_FAULTS_ENV, "1")


def submit(
    source: Path,
    *,
    output: str,
    tenant: str = "tenant-a",
    options: dict[str, Any] | None = None,
    fault: dict[str, Any] | None = None,
    inline: bool = False,
) -> ConversionJob:
    """Accept ``source`` (a copy: acceptance consumes the staged file) as a new job; with
    ``inline``, from memory as the upload handler hands over a small upload (its bytes go to
    ``inline_source``). A test fault is written into the stored options, as a client could not
    send it."""
    if inline:
        content = source.read_bytes()
        upload = StagedUpload(
            path=None,
            sha256=hashlib.sha256(content).hexdigest(),
            size=len(content),
            content=content,
        )
    else:
        fh, staged = storage.stage()
        with fh, open(source, "rb") as data:
            shutil.copyfileobj(data, fh)
        sha, size = storage.sha256_file(staged)
        upload = StagedUpload(path=staged, sha256=sha, size=size)
    acceptance = conversion_job_accept(
        tenant=tenant,
        actor="tester",
        upload=upload,
        output=output,
        raw_options=options,
        idempotency_key=None,
    )
    assert acceptance.created, "documents in these tests are unique: a new job is expected"
    job = acceptance.job
    if fault is not None:
        ConversionJob.objects.filter(id=job.id).update(
            options={**job.options, "_test_fault": fault}
        )
    return ConversionJob.objects.get(id=job.id)


def execute(job: ConversionJob, generation: int | None = None) -> str:
    return conversion_job_execute(job_id=job.id, generation=generation or job.generation)


class Worker(threading.Thread):
    """``conversion_job_execute`` in its own thread (and its own database connection)."""

    def __init__(
        self, job_id: uuid.UUID, generation: int, before: Callable[[], None] | None = None
    ):
        super().__init__(name=f"worker-{job_id}", daemon=True)
        self.job_id, self.generation, self.before = job_id, generation, before
        self.outcome: str | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            if self.before is not None:
                self.before()
            self.outcome = conversion_job_execute(job_id=self.job_id, generation=self.generation)
        except BaseException as exc:
            self.error = exc
        finally:
            connection.close()

    def result(self, timeout: float = 60) -> str | None:
        self.join(timeout)
        assert not self.is_alive(), "the worker thread did not finish"
        if self.error is not None:
            raise self.error
        return self.outcome


def run_until_pages_then_lose_lease(job: ConversionJob, pages_done: int) -> None:
    """A worker converts ``job`` until ``pages_done`` pages are checkpointed; then its lease is
    stolen (it expires, as if the worker stalled), the sweep recovers the job (generation + 1,
    queued) and the worker stops with ``lost``. ``job`` is refreshed."""
    from datetime import timedelta

    from django.utils import timezone

    from conversion_jobs.models import PageCheckpoint, WorkerLease
    from conversion_jobs.services.recovery import conversion_jobs_recover_if_lease_expired

    first = Worker(job.id, job.generation)
    first.start()
    wait_for(lambda: PageCheckpoint.objects.filter(job=job, state="done").count() >= pages_done)
    WorkerLease.objects.filter(job=job).update(expires_at=timezone.now() - timedelta(seconds=1))
    # The sweep skips a lease row the worker holds locked at that moment (a checkpoint batch
    # in its transaction): as the periodic sweep would, try again until it recovers the job.
    assert wait_for(conversion_jobs_recover_if_lease_expired, timeout=10, what="recovery") == 1
    assert first.result() == "lost"
    job.refresh_from_db()


def downloaded_result(api: Callable[[], Any], job: ConversionJob) -> bytes:
    """The job's result as a client downloads it (``GET /result``, 200, streamed)."""
    response = api().get(f"/api/v1/jobs/{job.id}/result")
    assert response.status_code == 200, response.content
    return b"".join(response.streaming_content)


def work_dir_entries() -> list[Path]:
    """Everything in WORK_DIR except the skeleton of live converter sandboxes (their ``work``
    and ``tmp`` directories, account files and the mount points bwrap makes in the sandbox's
    /tmp for what lies under the host's /tmp: ``work``, a checkout). A private directory or a
    file left by a converter child in a sandbox counts. An attempt's work dir goes on this
    process's tidying thread after the attempt returns: this waits for it, as the next attempt
    does."""
    tidy_wait()
    root = Path(settings.QUIRE["WORK_DIR"])
    if not root.exists():
        return []
    skeleton = {root / ".sandbox"}
    for box in (root / ".sandbox").glob("*"):
        skeleton |= {box, box / "work", box / "tmp", box / "passwd", box / "group"}
        for inside in sandbox.tmp_mount_points(box / "work"):
            mount_point = box / "tmp" / inside.removeprefix("/tmp/")
            skeleton |= {mount_point, *mount_point.parents}
    # A warm engine outlives attempts (ADR 0019; what it keeps is tested on its own): its
    # private directory, and with the sandbox off ``.engines``, are not an attempt's leftovers.
    kept = [root / ".engines", engines.host_private()]
    # Empty directories held for this process's next attempt (ADR 0017, session 7): the spare
    # work dir and a kept converter child's emptied private directory. Only the directory
    # itself is skipped: anything in it counts.
    skeleton |= set(held_empty_dirs())
    return sorted(
        p
        for p in root.rglob("*")
        if p not in skeleton and not any(k is not None and (p == k or k in p.parents) for k in kept)
    )


def held_empty_dirs() -> list[Path]:
    """This process's spare work dir and its kept converter child's emptied private directory
    (either may be absent)."""
    from conversion_jobs.converters import sessions
    from conversion_jobs.services import runner

    held = []
    spare = runner._spare_workdir
    if spare is not None and spare[0] == os.getpid():
        held.append(spare[1])
    kept = sessions._kept
    if kept is not None and kept.emptied is not None:
        held.append(kept.emptied)
    return held


def result_files(job_id: uuid.UUID) -> list[str]:
    """The keys of every stored result object of ``job_id``."""
    return sorted(o.key for o in storage.list_objects(f"results/{job_id}"))


def stored_result(job: ConversionJob) -> list[str]:
    """What ``result_files`` holds for a published job: its result object, or none for an
    inline text result (its bytes are its checkpoint rows)."""
    return [] if is_inline_result(job.result_key) else [job.result_key or ""]


def object_bytes(key: str) -> bytes:
    """A stored object's bytes; for an inline text result's key (no object), the result's bytes
    read from its checkpoint rows."""
    if is_inline_result(key):
        parsed = storage.parse_key(key.removeprefix(INLINE_PREFIX))
        assert parsed is not None and parsed.job_id is not None
        joined = inline_result_bytes(job_id=parsed.job_id, result_key=key)
        assert joined is not None
        return joined
    with storage.open_object(key) as body:
        return body.read()


def object_sha256(key: str) -> str:
    return hashlib.sha256(object_bytes(key)).hexdigest()


def converter_children(job_id: uuid.UUID) -> list[int]:
    """Live converter child processes working for ``job_id``: their cwd is their private
    directory, in one of the job's attempt directories (sandbox off) or in a converter sandbox
    under WORK_DIR (the tests run one job at a time)."""
    work_dir = Path(settings.QUIRE["WORK_DIR"]).resolve()
    places = (str(work_dir / str(job_id)) + ".", str(work_dir / ".sandbox") + "/")
    engine_host = engines.host_pgid()  # the warm engine serves attempts, it is not one
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == engine_host:
            continue
        try:
            with open(f"/proc/{entry.name}/comm", "rb") as fh:
                name = fh.read().strip()
            if name != CHILD_NAME.encode():
                continue
            if os.readlink(f"/proc/{entry.name}/cwd").startswith(places):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def unique_text(prefix: str = "Quire") -> Callable[[int], str]:
    """Page texts unique to this call (a document's content identity must be new)."""
    salt = uuid.uuid4().hex[:8]
    return lambda n: f"{prefix} {salt} page {n}"
