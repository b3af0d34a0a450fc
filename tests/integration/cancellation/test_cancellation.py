"""Issue 5 in-process: cancellation of jobs in every state, against real Postgres, with the real
worker path (``conversion_job_execute``) and real converter child processes in threads."""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.db import connection
from django.utils import timezone

from conversion_jobs import storage
from conversion_jobs.converters import process_group_members
from conversion_jobs.models import (
    CancellationRequest,
    ConversionAttempt,
    ConversionJob,
    ConversionOutbox,
    ExecutionAuditEvent,
    PageCheckpoint,
    WorkerLease,
)
from conversion_jobs.services import execution
from conversion_jobs.services.checkpoints import inline_content
from conversion_jobs.services.leases import Lease
from conversion_jobs.services.recovery import (
    conversion_jobs_recover_if_lease_expired,
    conversion_jobs_requeue_if_retry_due,
)
from tests import testdocs
from tests.integration.execution.jobkit import (
    Worker,
    converter_children,
    execute,
    result_files,
    stored_result,
    submit,
    unique_text,
    wait_for,
    work_dir_entries,
)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("fast_quire")]


def _pdf_job(tmp_path, *, pages: int = 1, output: str = "text", **kwargs) -> ConversionJob:
    source = testdocs.make_pdf(
        tmp_path / f"{uuid.uuid4().hex}.pdf", pages=pages, text_of=unique_text()
    )
    return submit(source, output=output, **kwargs)


def _kept(checkpoint: PageCheckpoint) -> bool:
    """The page's artifact is still stored: inline in its row, or as the file it names."""
    return inline_content(checkpoint) is not None or storage.exists(checkpoint.artifact_key)


def _cancel(api, job_id, *, tenant: str = "tenant-a"):
    return api(tenant=tenant).post(f"/api/v1/jobs/{job_id}/cancel")


def _requests(job: ConversionJob) -> list[tuple[str, str, bool]]:
    return [
        (r.state_seen, r.outcome, r.resolved_at is not None)
        for r in CancellationRequest.objects.filter(job=job).order_by("id")
    ]


def _claim(job: ConversionJob) -> Lease:
    claim = execution.conversion_job_claim(job_id=job.id, generation=job.generation, worker="test")
    assert claim is not None
    return claim.lease


def test_cancel__queued_is_cancelled_at_once_and_its_delivery_is_stale(
    tmp_path, api, no_broker_publish
):
    job = _pdf_job(tmp_path)

    response = _cancel(api, job.id)

    assert response.status_code == 200
    assert response.json()["state"] == "cancelled"
    job.refresh_from_db()
    assert (job.state, job.generation, job.finished_at is not None) == ("cancelled", 1, True)
    assert _requests(job) == [("queued", "cancelled", True)]
    # The message of generation 1 arrives later: the claim CAS loses, nothing runs.
    assert execute(job, generation=1) == "duplicate"
    assert not ConversionAttempt.objects.filter(job=job).exists()
    job.refresh_from_db()
    assert (job.state, job.attempts) == ("cancelled", 0)


def test_cancel__retry_wait_is_cancelled_and_its_timer_never_dispatches(
    tmp_path, api, no_broker_publish
):
    job = _pdf_job(tmp_path, fault={"kind": "segv"})
    assert execute(job) == "retry_wait"
    # The timer is due: without the cancel, the sweep would re-dispatch the job now.
    ConversionJob.objects.filter(id=job.id).update(
        next_attempt_at=timezone.now() - timedelta(seconds=1)
    )
    outbox_before = ConversionOutbox.objects.filter(job=job).count()

    response = _cancel(api, job.id)

    assert (response.status_code, response.json()["state"]) == (200, "cancelled")
    assert conversion_jobs_requeue_if_retry_due() == 0
    job.refresh_from_db()
    assert (job.state, job.generation, job.next_attempt_at) == ("cancelled", 1, None)
    assert ConversionOutbox.objects.filter(job=job).count() == outbox_before
    assert _requests(job) == [("retry_wait", "cancelled", True)]
    assert execute(job, generation=2) == "duplicate"


def test_cancel__running_stops_the_worker_within_the_heartbeat_bound(
    tmp_path, api, no_broker_publish
):
    job = _pdf_job(tmp_path, pages=6, fault={"kind": "slow", "seconds": 1.0})
    worker = Worker(job.id, 1)
    worker.start()
    wait_for(lambda: PageCheckpoint.objects.filter(job=job, state="done").exists(), timeout=30)
    children = wait_for(lambda: converter_children(job.id))
    pgids = {os.getpgid(pid) for pid in children}

    started = time.monotonic()
    response = _cancel(api, job.id)
    assert (response.status_code, response.json()["state"]) == (202, "cancelling")
    wait_for(
        lambda: ConversionJob.objects.get(id=job.id).state == "cancelled", timeout=10, interval=0.01
    )
    latency = time.monotonic() - started

    assert worker.result() == "cancelled"
    assert latency < settings.QUIRE["HEARTBEAT_S"] + 1.5, latency
    assert all(process_group_members(pgid) == [] for pgid in pgids)
    assert converter_children(job.id) == []
    assert work_dir_entries() == []
    job.refresh_from_db()
    assert (job.result_key, job.result_sha256, job.lease_token) == (None, None, None)
    assert result_files(job.id) == []
    assert _requests(job) == [("running", "cancelled", True)]
    attempt = ConversionAttempt.objects.get(job=job)
    assert attempt.outcome == "cancelled"
    assert not WorkerLease.objects.filter(job=job).exists()
    events = list(
        ExecutionAuditEvent.objects.filter(job_id=job.id).values_list("event_type", flat=True)
    )
    assert "published" not in events
    assert events.count("cancelled") == 1
    # Policy: pages finished before the cancel stay checkpointed and stored, and are served
    # (allow_partial, the default, lets partial results survive cancellation).
    done = list(PageCheckpoint.objects.filter(job=job, state="done").order_by("page_number"))
    assert 1 <= len(done) < 6
    assert all(_kept(p) for p in done)
    page = api().get(f"/api/v1/jobs/{job.id}/pages/{done[0].page_number}")
    assert (page.status_code, page["ETag"]) == (200, f'"{done[0].artifact_sha256}"')
    assert api().get(f"/api/v1/jobs/{job.id}/result").json()["code"] == "no_result"


def test_cancel__all_or_nothing_job_keeps_no_served_pages(tmp_path, api, no_broker_publish):
    job = _pdf_job(
        tmp_path, pages=4, options={"allow_partial": False}, fault={"kind": "slow", "seconds": 0.5}
    )
    worker = Worker(job.id, 1)
    worker.start()
    done = wait_for(
        lambda: PageCheckpoint.objects.filter(job=job, state="done").first(), timeout=30
    )

    assert _cancel(api, job.id).status_code == 202
    assert worker.result() == "cancelled"

    assert api().get(f"/api/v1/jobs/{job.id}/pages/{done.page_number}").status_code == 404
    # Kept until retention (in its row, or the file the checkpoint names), but not published.
    assert _kept(done)


def test_cancel__twice_gives_the_same_answer_and_one_state_change(tmp_path, api, no_broker_publish):
    queued, running = _pdf_job(tmp_path), _pdf_job(tmp_path)
    lease = _claim(running)
    for job, status, state in ((queued, 200, "cancelled"), (running, 202, "cancelling")):
        version = ConversionJob.objects.get(id=job.id).state_version

        first, second = _cancel(api, job.id), _cancel(api, job.id)

        assert (first.status_code, second.status_code) == (status, status)
        assert first.json()["state"] == second.json()["state"] == state
        assert first.json()["state_version"] == second.json()["state_version"] == version + 1
    assert [o for _s, o, _r in _requests(queued)] == ["cancelled", "already_cancelled"]
    assert _requests(running) == [
        ("running", "cancelling", False),
        ("cancelling", "already_cancelled", True),
    ]
    # The worker ends it; the pending request resolves; a third cancel still agrees.
    assert execution.conversion_job_finish_cancel(lease=lease)
    assert _requests(running)[0] == ("running", "cancelled", True)
    third = _cancel(api, running.id)
    assert (third.status_code, third.json()["state"]) == (200, "cancelled")


@pytest.mark.parametrize("end", ["succeeded", "partial", "failed"])
def test_cancel__finished_job_is_too_late_and_its_result_stands(
    tmp_path, api, end, no_broker_publish
):
    fault = {"succeeded": None, "partial": {"kind": "fail", "page": 2}, "failed": {"kind": "fail"}}[
        end
    ]
    job = _pdf_job(tmp_path, pages=2, fault=fault)
    assert execute(job) == end
    # Everything but the audit chain head (the refused cancel is itself recorded).
    row = ConversionJob.objects.filter(id=job.id)
    before = row.values(
        *(
            f.attname
            for f in ConversionJob._meta.concrete_fields
            if not f.attname.startswith("audit_")
        )
    ).get()
    result_before = api().get(f"/api/v1/jobs/{job.id}/result")

    response = _cancel(api, job.id)

    assert response.status_code == 409
    assert response["Content-Type"] == "application/problem+json"
    assert response.json()["code"] == "too_late"
    assert row.values(*before).get() == before
    assert _requests(job) == [(end, "too_late", True)]
    result_after = api().get(f"/api/v1/jobs/{job.id}/result")
    assert result_after.status_code == result_before.status_code
    if end != "failed":
        assert result_after["ETag"] == result_before["ETag"] == f'"{before["result_sha256"]}"'


def test_cancel__lease_expiry_while_cancelling_ends_cancelled_not_redispatched(
    tmp_path, api, no_broker_publish
):
    job = _pdf_job(tmp_path)
    _claim(job)  # a worker claimed it and died without a word
    assert _cancel(api, job.id).status_code == 202
    WorkerLease.objects.filter(job=job).update(expires_at=timezone.now() - timedelta(seconds=1))

    assert conversion_jobs_recover_if_lease_expired() == 1

    job.refresh_from_db()
    assert (job.state, job.generation, job.lease_token) == ("cancelled", 1, None)
    assert ConversionOutbox.objects.filter(job=job).count() == 1
    assert _requests(job) == [("running", "cancelled", True)]
    assert ConversionAttempt.objects.get(job=job).outcome == "lease_lost"
    assert execute(job, generation=1) == execute(job, generation=2) == "duplicate"
    assert conversion_jobs_recover_if_lease_expired() == 0


def test_cancel__other_tenant_is_not_found_and_records_nothing(tmp_path, api, no_broker_publish):
    job = _pdf_job(tmp_path)
    events = ExecutionAuditEvent.objects.filter(job_id=job.id).count()

    response = _cancel(api, job.id, tenant="tenant-b")
    missing = _cancel(api, uuid.uuid4(), tenant="tenant-b")

    assert response.status_code == missing.status_code == 404
    assert response.content == missing.content
    assert response["Content-Type"] == missing["Content-Type"]
    assert not CancellationRequest.objects.exists()
    assert ExecutionAuditEvent.objects.filter(job_id=job.id).count() == events
    job.refresh_from_db()
    assert (job.state, job.state_version) == ("queued", 1)


def _cancelled_after_a_page(tmp_path, api) -> tuple[Path, ConversionJob]:
    """A 4-page job (slow pages) cancelled while running, once a page is checkpointed; its
    worker has ended it ``cancelled``."""
    source = testdocs.make_pdf(tmp_path / "doc.pdf", pages=4, text_of=unique_text())
    job = submit(source, output="text", fault={"kind": "slow", "seconds": 0.4})
    worker = Worker(job.id, 1)
    worker.start()
    wait_for(lambda: PageCheckpoint.objects.filter(job=job, state="done").exists(), timeout=30)
    assert _cancel(api, job.id).status_code == 202
    assert worker.result() == "cancelled"
    return source, job


def test_cancel__operator_retry_after_cancel_starts_clean(tmp_path, api, no_broker_publish):
    # Issue 5: an operator retry after a cancel starts a clean generation that no earlier
    # cancellation touches, and never sees the cancelled attempt's temporary files.
    _source, job = _cancelled_after_a_page(tmp_path, api)
    assert work_dir_entries() == []
    done_before = set(
        PageCheckpoint.objects.filter(job=job, state="done").values_list("page_number", flat=True)
    )

    response = api().post(f"/api/v1/jobs/{job.id}/retry")

    assert response.status_code == 202
    assert (response.json()["state"], response.json()["generation"]) == ("queued", 2)
    assert ConversionOutbox.objects.filter(job=job, generation=2).count() == 1
    assert execute(job, generation=1) == "duplicate"  # the old generation is stale
    assert execute(job, generation=2) == "succeeded"
    job.refresh_from_db()
    assert job.result_key is not None and job.state == "succeeded"
    # pages finished before the cancel were kept and not redone; the rest were done by gen 2
    gens = dict(PageCheckpoint.objects.filter(job=job).values_list("page_number", "generation"))
    assert {p for p, g in gens.items() if g == 1} == done_before
    assert {p for p, g in gens.items() if g == 2} == set(range(1, 5)) - done_before
    # no pending cancellation from generation 1 leaks into generation 2
    assert not CancellationRequest.objects.filter(job=job, resolved_at__isnull=True).exists()
    assert work_dir_entries() == []


def test_cancel__operator_retry_of_a_succeeded_job_is_refused(tmp_path, api, no_broker_publish):
    job = _pdf_job(tmp_path)
    assert execute(job) == "succeeded"
    response = api().post(f"/api/v1/jobs/{job.id}/retry")
    assert (response.status_code, response.json()["code"]) == (409, "not_retryable")


def test_cancel__resubmission_after_cancel_starts_clean(tmp_path, api, no_broker_publish):
    source, job = _cancelled_after_a_page(tmp_path, api)

    again = submit(source, output="text")

    assert again.id != job.id
    assert execute(again) == "succeeded"
    assert ConversionAttempt.objects.get(job=again).pages_converted == 4
    assert set(PageCheckpoint.objects.filter(job=again).values_list("generation", flat=True)) == {1}
    assert work_dir_entries() == []


class _Canceller(threading.Thread):
    def __init__(self, api, job_id, barrier: threading.Barrier, delay: float = 0.0):
        super().__init__(daemon=True)
        self.client, self.job_id, self.barrier, self.delay = api(), job_id, barrier, delay
        self.status: int | None = None

    def run(self) -> None:
        try:
            self.barrier.wait(timeout=30)
            time.sleep(self.delay)
            self.status = self.client.post(f"/api/v1/jobs/{self.job_id}/cancel").status_code
        finally:
            connection.close()


RACES = 200  # issue 5: "fires cancel and completion at the same instant 200 times"


def test_cancel__racing_completion_ends_in_one_consistent_terminal_state(
    tmp_path, api, monkeypatch, no_broker_publish
):
    """Cancel and completion fire at the same instant: at the publish CAS (most runs) or at the
    claim CAS (every fifth), with small spreads so that either side wins some runs. Whichever
    guarded UPDATE commits first wins, and the loser changes nothing."""
    publish = execution.conversion_job_publish
    gate: dict[str, Any] = {"publish": None, "delay": 0.0}

    def publish_at_the_barrier(**kwargs):
        barrier = gate["publish"]
        if barrier is not None:
            barrier.wait(timeout=30)
            # The cancel goes through the API first: spread the start so both sides win often.
            time.sleep(gate["delay"])
        return publish(**kwargs)

    monkeypatch.setattr(execution, "conversion_job_publish", publish_at_the_barrier)
    tally: Counter[tuple[str, str, str]] = Counter()
    for run in range(RACES):
        job = _pdf_job(tmp_path)
        barrier = threading.Barrier(2)
        at_claim = run % 5 == 0
        gate["publish"] = None if at_claim else barrier
        gate["delay"] = (run % 10) * 0.002
        worker = Worker(
            job.id, 1, before=(lambda b=barrier: b.wait(timeout=30)) if at_claim else None
        )
        canceller = _Canceller(api, job.id, barrier, delay=(run // 5 % 5) * 0.01 if at_claim else 0)
        worker.start()
        canceller.start()
        outcome = worker.result()
        canceller.join(30)

        job.refresh_from_db()
        (request,) = CancellationRequest.objects.filter(job=job)
        published = ExecutionAuditEvent.objects.filter(
            job_id=job.id, event_type="published"
        ).count()
        tally[("claim" if at_claim else "publish", job.state, request.outcome)] += 1
        assert request.resolved_at is not None, run
        if job.state == "cancelled":
            assert outcome in ("cancelled", "duplicate"), run
            assert canceller.status in (200, 202), run
            assert request.outcome == "cancelled", run
            assert (job.result_key, job.result_sha256, published) == (None, None, 0), run
            assert result_files(job.id) == [], run
        else:
            assert (job.state, outcome, canceller.status) == ("succeeded", "succeeded", 409), run
            assert request.outcome in ("too_late", "lost_to_completion"), run
            assert published == 1, run
            assert result_files(job.id) == stored_result(job), run
        assert not WorkerLease.objects.filter(job=job).exists(), run
        assert work_dir_entries() == [], run
    print(dict(tally))
    assert sum(tally.values()) == RACES
