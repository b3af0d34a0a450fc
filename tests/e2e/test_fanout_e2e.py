"""e2e: fan-out with real ``celery worker`` processes, sweeper and beat (ADR 0023, issue 26).
A fanned-out job's result is byte-identical to an unsplit run's (text, PNG, PDF); kill -9 of a
worker mid-run reruns only that worker's ranges, from their checkpoints; a cancel stops every
range and leaves no converter running."""

from __future__ import annotations

import hashlib
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from conversion_jobs import storage
from conversion_jobs.models import ConversionJob, ExecutionAuditEvent, JobRange, PageCheckpoint
from conversion_jobs.services.acceptance import StagedUpload, conversion_job_accept
from conversion_jobs.services.cancellation import conversion_job_cancel
from tests import testdocs
from tests.e2e import harness

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

#: Ranges of 4 pages above 8 pages (ceil(24 / 8) = 3, bounded to 4): a 24-page job has six.
FANOUT_ENV = {
    "QUIRE_FANOUT": "true",
    "QUIRE_FANOUT_MIN_PAGES": "8",
    "QUIRE_FANOUT_RANGE_MIN_PAGES": "4",
    "QUIRE_FANOUT_RANGE_MAX_PAGES": "6",
    "QUIRE_FANOUT_SLOTS": "2",
}
TERMINAL = {"succeeded", "partial", "failed", "cancelled"}


def _accept(source: Path, *, output: str, tenant: str, options: dict[str, Any] | None = None):
    fh, staged = storage.stage()
    with fh, open(source, "rb") as data:
        shutil.copyfileobj(data, fh)
    raw = source.read_bytes()
    accepted = conversion_job_accept(
        tenant=tenant,
        actor="e2e",
        upload=StagedUpload(path=staged, sha256=hashlib.sha256(raw).hexdigest(), size=len(raw)),
        output=output,
        raw_options=options or {},
        idempotency_key=None,
    )
    assert accepted.created
    return accepted.job


def _finished(job_id: uuid.UUID, timeout: float = 120) -> ConversionJob:
    harness.wait_until(
        lambda: ConversionJob.objects.get(id=job_id).state in TERMINAL,
        timeout=timeout,
        interval=0.2,
        what="the job to end",
    )
    return ConversionJob.objects.get(id=job_id)


def _result_bytes(job: ConversionJob) -> bytes:
    """The result as the web serves it (inline text, the PNG ZIP, or the stored object)."""
    from django.test import Client

    from tests.conftest import token

    response = Client().get(
        f"/api/v1/jobs/{job.id}/result",
        HTTP_AUTHORIZATION=f"Bearer {token(tenant=job.tenant)}",
    )
    assert response.status_code == 200, response.content
    return b"".join(response.streaming_content)


def test_fanout__results_byte_identical_to_unsplit_runs(start, cluster, tmp_path):
    salt = uuid.uuid4().hex[:8]
    pdf = testdocs.make_pdf(tmp_path / "d.pdf", pages=24, text_of=lambda n: f"{salt} page {n}")
    tiff = testdocs.make_tiff(tmp_path / "f.tiff", frames=12)
    inputs = [(pdf, "text", {}), (pdf, "png", {"dpi": 40}), (tiff, "pdf", {})]
    start("sweeper")
    start("beat")
    fanned_worker = start("worker", **FANOUT_ENV)
    fanned = [_accept(src, output=o, tenant="tenant-fan", options=opt) for src, o, opt in inputs]
    fanned = [_finished(j.id) for j in fanned]
    assert [j.state for j in fanned] == ["succeeded"] * 3
    assert all(JobRange.objects.filter(job_id=j.id).count() >= 3 for j in fanned)
    fanned_worker.stop()
    start("worker", QUIRE_FANOUT="false")
    unsplit = [_accept(src, output=o, tenant="tenant-one", options=opt) for src, o, opt in inputs]
    unsplit = [_finished(j.id) for j in unsplit]
    assert [j.state for j in unsplit] == ["succeeded"] * 3
    assert not JobRange.objects.filter(job_id__in=[j.id for j in unsplit]).exists()
    for a, b in zip(fanned, unsplit, strict=True):
        assert _result_bytes(a) == _result_bytes(b), a.output
        assert a.result_sha256 == b.result_sha256
    text = _result_bytes(fanned[0]).split(b"\f")
    assert [t.decode() for t in text] == [f"{salt} page {n}" for n in range(1, 25)]


def test_fanout__kill9_a_worker__only_its_ranges_rerun_from_their_checkpoints(
    start, cluster, tmp_path
):
    salt = uuid.uuid4().hex[:8]
    pdf = testdocs.make_pdf(tmp_path / "k.pdf", pages=24, text_of=lambda n: f"{salt} page {n}")
    start("sweeper")
    start("beat")
    doomed = start("worker", WORKER_CONCURRENCY="1", **FANOUT_ENV)
    start("worker", WORKER_CONCURRENCY="1", **FANOUT_ENV)
    job = _accept(
        pdf,
        output="text",
        tenant="tenant-a",
        options={"_test_fault": {"kind": "slow", "seconds": 0.4}},
    )

    def doomed_range_with_a_page() -> list[JobRange]:
        pids = {str(p) for p in doomed.tree()}
        held = [
            r
            for r in JobRange.objects.filter(job_id=job.id, state="running")
            if r.worker.rsplit(":", 1)[-1] in pids
        ]
        return [
            r
            for r in held
            if PageCheckpoint.objects.filter(
                job_id=job.id, page_number__gte=r.first_page, page_number__lte=r.last_page
            ).exists()
        ]

    killed = harness.wait_until(
        doomed_range_with_a_page, timeout=60, interval=0.05, what="a range of the doomed worker"
    )
    doomed.kill9()
    before = dict(
        PageCheckpoint.objects.filter(job_id=job.id).values_list("page_number", "updated_at")
    )
    killed_ids = {r.id for r in killed}
    job = _finished(job.id, timeout=180)
    assert job.state == "succeeded", job.error_code
    text = _result_bytes(job).split(b"\f")
    assert [t.decode() for t in text] == [f"{salt} page {n}" for n in range(1, 25)]
    after = dict(
        PageCheckpoint.objects.filter(job_id=job.id).values_list("page_number", "updated_at")
    )
    # pages checkpointed before the kill were never converted again
    assert {p: after[p] for p in before} == before
    ranges = list(JobRange.objects.filter(job_id=job.id))
    rerun = {r.id for r in ranges if r.generation > 1}
    # the killed worker's range(s) alone ran again (it held one at a time; one more only if
    # it claimed its next range between the snapshot and the kill)
    assert killed_ids <= rerun and len(rerun) <= len(killed_ids) + 1, (killed_ids, rerun)
    assert ExecutionAuditEvent.objects.filter(job_id=job.id, event_type="published").count() == 1
    assert {r.state for r in ranges} == {"done"}


def test_fanout__cancel_stops_every_range_and_no_converter_is_left(start, cluster, tmp_path):
    pdf = testdocs.make_pdf(tmp_path / "c.pdf", pages=24, text_of=lambda n: f"c page {n}")
    start("sweeper")
    start("beat")
    workers = [start("worker", **FANOUT_ENV) for _ in range(2)]
    job = _accept(
        pdf,
        output="text",
        tenant="tenant-a",
        options={"_test_fault": {"kind": "slow", "seconds": 1}},
    )
    harness.wait_until(
        lambda: JobRange.objects.filter(job_id=job.id, state="running").count() >= 2,
        timeout=60,
        what="two ranges running",
    )
    started = time.monotonic()
    conversion_job_cancel(job_id=job.id, tenant="tenant-a", actor="e2e")

    def stopped() -> bool:
        return (
            ConversionJob.objects.get(id=job.id).state == "cancelled"
            and not JobRange.objects.filter(job_id=job.id, state__in=["running", "queued"]).exists()
        )

    harness.wait_until(stopped, timeout=15, interval=0.02, what="every range stopped")
    latency = time.monotonic() - started
    assert latency <= 2.0 + float(harness.TEST_TIMINGS["QUIRE_HEARTBEAT_S"]), latency

    def working() -> list[int]:
        found = []
        for worker in workers:
            for pid in worker.tree():
                if harness.is_converter_child(pid):
                    try:
                        if ".isolated-" in str(Path(f"/proc/{pid}/cwd").readlink()):
                            found.append(pid)
                    except OSError:
                        pass
        return found

    harness.wait_until(lambda: working() == [], timeout=5, what="no converter working")
