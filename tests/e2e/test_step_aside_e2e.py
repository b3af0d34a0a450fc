"""e2e: stepping aside (ADR 0022) with a real worker, sweeper, beat, RabbitMQ and LibreOffice.

One worker with one slot and one spare pool process. A DOCX that keeps LibreOffice busy past its
limit is claimed first; one-page PDFs of the same tenant submitted behind it wait for the one
slot. Half a second into the conversion the attempt steps aside: its job's ``aside_lease`` is
its lease, LibreOffice's threads run under ``SCHED_IDLE``, the relay sends a PDF to the spare,
and every PDF succeeds while the DOCX still converts. The DOCX then ends ``conversion_timeout``
on its CPU time (converters/aside.py; tests/integration/converters/test_conv_aside.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from django.db.models import F

from conversion_jobs.models import ConversionAttempt, ConversionJob, DocumentCrash
from conversion_jobs.services import fair
from tests import testdocs
from tests.e2e import harness

pytestmark = [pytest.mark.e2e, pytest.mark.fair_credits, pytest.mark.django_db(transaction=True)]

ASIDE = {
    "QUIRE_FAIR_CAPACITY": "0",
    "QUIRE_PREPARE_TIMEOUT_S": "4",
    "QUIRE_STEP_ASIDE_AFTER_S": "0.5",
}


def _submit_docx(tmp_path: Path, *, pages: int) -> ConversionJob:
    source = testdocs.make_docx(
        tmp_path / "long.docx",
        paragraphs=[f"Paragraph {i} " + "lorem ipsum dolor " * 40 for i in range(pages)],
        page_break_after_each=True,
    )
    return harness.accept_path(source, tenant="tenant-a").job


def _stack_with_a_spare(start, tmp_path: Path, **env: str) -> tuple[harness.Proc, ConversionJob]:
    """A worker of one slot and one spare, the sweeper and beat; the long DOCX, claimed."""
    worker = start("worker", WORKER_CONCURRENCY="1", QUIRE_WORKER_SPARES="1", **env)
    start("sweeper", **env)
    start("beat", **env)
    harness.wait_until(
        lambda: fair.capacity() == 1, timeout=20, what="the worker's one slot announced"
    )
    docx = _submit_docx(tmp_path, pages=6000)
    harness.wait_until(
        lambda: ConversionJob.objects.filter(id=docx.id, state="running").exists(),
        timeout=30,
        what="the DOCX claimed",
    )
    return worker, docx


def _soffice_threads(worker: harness.Proc) -> list[tuple[int, int]]:
    """(tid, scheduling policy) of every thread of the worker tree's soffice processes."""
    found = []
    for pid in worker.tree():
        try:
            if b"soffice" not in Path(f"/proc/{pid}/comm").read_bytes():
                continue
            for tid in os.listdir(f"/proc/{pid}/task"):
                found.append((int(tid), os.sched_getscheduler(int(tid))))
        except OSError:
            continue
    return found


def _finished(job_id) -> bool:
    return ConversionJob.objects.filter(id=job_id, finished_at__isnull=False).exists()


def test_step_aside__the_spare_runs_the_queue_while_libreoffice_converts_at_idle_priority(
    start, submit, tmp_path
):
    worker, docx = _stack_with_a_spare(start, tmp_path, **ASIDE)
    pdfs = [submit(pages=1, tenant="tenant-a") for _ in range(5)]
    harness.wait_until(
        lambda: ConversionJob.objects.filter(
            id=docx.id, state="running", aside_lease=F("lease_token")
        ).exists(),
        timeout=30,
        what="the DOCX's attempt stepped aside",
    )
    threads = _soffice_threads(worker)
    assert threads and all(policy == os.SCHED_IDLE for _, policy in threads), threads
    harness.wait_until(
        lambda: all(_finished(p.id) for p in pdfs), timeout=60, what="the PDFs, on the spare"
    )
    assert not _finished(docx.id)  # still converting when the queue behind it was done
    assert {ConversionJob.objects.get(id=p.id).state for p in pdfs} == {"succeeded"}
    harness.wait_until(lambda: _finished(docx.id), timeout=90, what="the DOCX's end")
    row = ConversionJob.objects.get(id=docx.id)
    assert (row.state, row.error_code) == ("failed", "conversion_timeout")
    assert fair.busy_by_tenant() == {}


SLOW = {"_test_fault": {"kind": "slow", "seconds": 0.2}}


def test_step_aside__starved_by_a_backlog_it_yields_once_then_keeps_its_slot(
    start, submit, tmp_path
):
    """A conversion aside that a backlog keeps paused to its wall clock cap (4 x a 2 s limit)
    yields ``conversion_starved``: no crash, no attempt counted; the job's next attempt does
    not step aside again."""
    env = {**ASIDE, "QUIRE_PREPARE_TIMEOUT_S": "2", "QUIRE_ENABLE_TEST_FAULTS": "1"}
    _, docx = _stack_with_a_spare(start, tmp_path, **env)
    backlog = [submit(pages=1, options=SLOW, tenant="tenant-b") for _ in range(80)]
    harness.wait_until(
        lambda: ConversionAttempt.objects.filter(
            job_id=docx.id, outcome="yielded", error_code="conversion_starved"
        ).exists(),
        timeout=60,
        what="the DOCX's attempt starved aside, yielded",
    )
    assert DocumentCrash.objects.filter(job_id=docx.id).count() == 0
    harness.wait_until(
        lambda: ConversionAttempt.objects.filter(job_id=docx.id).count() == 2,
        timeout=120,
        what="the DOCX's next attempt",
    )
    harness.wait_until(lambda: _finished(docx.id), timeout=120, what="the DOCX's end")
    row = ConversionJob.objects.get(id=docx.id)
    second = ConversionAttempt.objects.filter(job_id=docx.id).order_by("id").last()
    assert second is not None and second.error_code == "conversion_timeout"
    assert row.aside_lease is not None and row.attempts == 1  # the yield was not an attempt
    assert (row.state, row.error_code) == ("failed", "conversion_timeout")
    harness.wait_until(
        lambda: all(_finished(p.id) for p in backlog), timeout=120, what="the backlog"
    )
