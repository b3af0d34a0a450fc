"""Range claims, fencing and the one join under real concurrency (ADR 0023): threads with their
own database connections racing through a barrier, real converter children, real sweeps."""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.db import connection
from django.utils import timezone

from conversion_jobs.converters import process_group_members
from conversion_jobs.models import (
    ConversionJob,
    ConversionOutbox,
    ExecutionAuditEvent,
    JobRange,
    PageCheckpoint,
    WorkerLease,
)
from conversion_jobs.services import fanout, range_runner
from conversion_jobs.services.checkpoints import page_checkpoint_done, page_checkpoints_record
from conversion_jobs.services.leases import LeaseLost
from tests import testdocs
from tests.integration.execution.jobkit import converter_children, execute, submit, unique_text
from tests.integration.fanout.rangekit import RangeWorker, ranges_of, refused, run_range
from tests.polling import wait_for

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("fanout_quire", "no_broker_publish"),
]


def _planned(tmp_path: Path, pages: int = 12, **kwargs: Any) -> ConversionJob:
    tmp_path.mkdir(parents=True, exist_ok=True)
    source = testdocs.make_pdf(tmp_path / "d.pdf", pages=pages, text_of=unique_text("fence"))
    job = submit(source, output="text", **kwargs)
    assert execute(job) == "fanned_out"
    return ConversionJob.objects.get(id=job.id)


def _race(n: int, fn: Any) -> list[Any]:
    """``fn(i)`` in ``n`` threads released together; their results (or exceptions)."""
    barrier = threading.Barrier(n)
    results: list[Any] = [None] * n

    def run(i: int) -> None:
        try:
            barrier.wait()
            results[i] = fn(i)
        except BaseException as exc:
            results[i] = exc
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results


def _claim(job: ConversionJob, row: JobRange, worker: str = "w") -> fanout.RangeClaim | None:
    return fanout.range_claim(
        job_id=job.id,
        generation=row.job_generation,
        first=row.first_page,
        range_generation=row.generation,
        worker=worker,
    )


def _done(claim: fanout.RangeClaim, page: int) -> Any:
    return page_checkpoint_done(
        lease=claim.lease,
        page=page,
        attempts=1,
        artifact_key=f"inline:pages/{claim.lease.job_id}/{page:05d}.g1.txt",
        artifact_sha256="0" * 64,
        artifact_size=1,
        media_type="text/plain; charset=utf-8",
        content=b"x",
    )


def test_planner__job_lease_stops_expiring_and_ranges_are_queued(tmp_path):
    job = _planned(tmp_path)
    lease = WorkerLease.objects.get(job=job)
    assert lease.expires_at == fanout.FANNED_OUT_UNTIL
    assert job.state == "running" and job.source_page_count == 12
    assert [r.state for r in ranges_of(job.id)] == ["queued"] * 4
    assert ExecutionAuditEvent.objects.filter(job_id=job.id, event_type="fanned_out").count() == 1


def test_range_claim__eight_racing_claims__one_wins(tmp_path):
    job = _planned(tmp_path)
    row = ranges_of(job.id)[1]
    results = _race(8, lambda i: _claim(job, row, worker=f"w{i}"))
    won = [r for r in results if isinstance(r, fanout.RangeClaim)]
    assert len(won) == 1 and results.count(None) == 7, results
    row.refresh_from_db()
    assert (row.state, row.attempts, row.lease_token) == ("running", 1, won[0].range_lease.token)


def test_range_claim__stale_range_generation_or_job_not_running__loses(tmp_path):
    job = _planned(tmp_path)
    row = ranges_of(job.id)[0]
    assert (
        fanout.range_claim(
            job_id=job.id, generation=1, first=row.first_page, range_generation=2, worker="w"
        )
        is None
    )
    ConversionJob.objects.filter(id=job.id).update(state="cancelling")
    assert _claim(job, row) is None
    assert JobRange.objects.get(id=row.id).state == "queued"


def test_range_finish__last_two_ranges_racing__exactly_one_join(tmp_path, settings):
    settings.QUIRE = {**settings.QUIRE, "FANOUT_RANGE_MIN_PAGES": 3}  # 6 pages: 2 ranges
    for _round in range(5):
        job = _planned(tmp_path / str(_round), pages=6)
        rows = ranges_of(job.id)
        assert len(rows) == 2
        claims = [_claim(job, row) for row in rows]
        assert all(claims)

        def finish(i: int, claims: list[Any] = claims) -> bool:
            return fanout.range_finish(range_lease=claims[i].range_lease, lease=claims[i].lease)

        results = _race(2, finish)
        assert sorted(results) == [False, True], results
        # the join gave the job lease a real expiry again
        assert WorkerLease.objects.get(job=job).expires_at < timezone.now() + timedelta(hours=1)
        assert (
            ExecutionAuditEvent.objects.filter(job_id=job.id, event_type="ranges_joined").count()
            == 1
        )


def test_stale_range__after_recovery__writes_nothing(tmp_path):
    job = _planned(tmp_path)
    row = ranges_of(job.id)[0]
    stale = _claim(job, row)
    assert stale is not None
    page_checkpoints_record(
        lease=stale.lease, checkpoints=[_done(stale, 1)], range_lease=stale.range_lease
    )
    JobRange.objects.filter(id=row.id).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert fanout.job_ranges_recover_if_lease_expired() == 1
    row.refresh_from_db()
    assert (row.state, row.generation) == ("queued", 2)
    assert ConversionOutbox.objects.filter(job=job, range_first=1, range_generation=2).count() == 1
    before = refused("range_pages"), refused("range_done"), refused("range_heartbeat")
    with pytest.raises(LeaseLost):
        page_checkpoints_record(
            lease=stale.lease, checkpoints=[_done(stale, 2)], range_lease=stale.range_lease
        )
    with pytest.raises(LeaseLost):
        fanout.range_finish(range_lease=stale.range_lease, lease=stale.lease)
    assert fanout.range_heartbeat(range_lease=stale.range_lease, lease=stale.lease) == "lost"
    after = refused("range_pages"), refused("range_done"), refused("range_heartbeat")
    assert [a - b for a, b in zip(after, before, strict=True)] == [1, 1, 1]
    assert list(PageCheckpoint.objects.filter(job=job).values_list("page_number", flat=True)) == [1]
    assert ConversionJob.objects.get(id=job.id).pages_done == 1


def test_range__writes_only_its_own_pages(tmp_path):
    job = _planned(tmp_path)
    claim = _claim(job, ranges_of(job.id)[0])
    assert claim is not None
    with pytest.raises(ValueError, match="its own pages"):
        page_checkpoints_record(
            lease=claim.lease, checkpoints=[_done(claim, 4)], range_lease=claim.range_lease
        )


def test_lost_range_worker__rerun_converts_only_its_unfinished_pages(tmp_path):
    """A range worker that stalls (its lease expires while it converts) is fenced out; the
    sweep requeues that range alone and the rerun skips the pages checkpointed before."""
    job = _planned(tmp_path, fault={"kind": "slow", "seconds": 1.0})
    rows = ranges_of(job.id)
    for row in rows[1:]:
        assert run_range(job, row) == "range_done"
    first = rows[0]
    worker = RangeWorker(job, first)
    worker.start()
    wait_for(lambda: PageCheckpoint.objects.filter(job=job, page_number__lte=3).count() >= 1)
    JobRange.objects.filter(id=first.id).update(expires_at=timezone.now() - timedelta(seconds=1))
    wait_for(fanout.job_ranges_recover_if_lease_expired, timeout=10, what="range recovery")
    assert worker.result() == "lost"
    kept = dict(
        PageCheckpoint.objects.filter(job=job, page_number__lte=3).values_list(
            "page_number", "updated_at"
        )
    )
    assert 1 <= len(kept) < 3
    others = dict(
        PageCheckpoint.objects.filter(job=job, page_number__gt=3).values_list(
            "page_number", "updated_at"
        )
    )
    row = JobRange.objects.get(id=first.id)
    assert (row.state, row.generation) == ("queued", 2)
    assert run_range(job, row) == "succeeded"
    after = dict(PageCheckpoint.objects.filter(job=job).values_list("page_number", "updated_at"))
    assert {p: after[p] for p in kept} == kept  # not converted again
    assert {p: after[p] for p in others} == others  # other ranges untouched
    job.refresh_from_db()
    assert (job.state, job.pages_done) == ("succeeded", 12)


def test_two_finalizers__one_publishes_the_other_writes_nothing(tmp_path, monkeypatch, settings):
    settings.QUIRE = {**settings.QUIRE, "FANOUT_RANGE_MIN_PAGES": 3}  # 6 pages: 2 ranges
    job = _planned(tmp_path, pages=6)
    joins: list[dict[str, Any]] = []
    real_join = range_runner._join
    monkeypatch.setattr(range_runner, "_join", lambda **kw: joins.append(kw) or "joined")
    rows = ranges_of(job.id)
    assert [run_range(job, r) for r in rows] == ["range_done", "joined"]
    monkeypatch.setattr(range_runner, "_join", real_join)
    (join,) = joins
    before = refused("job_publish")
    results = _race(2, lambda i: range_runner._join(**join))
    assert sorted(results) == ["lost", "succeeded"], results
    assert refused("job_publish") - before == 1
    job.refresh_from_db()
    assert job.state == "succeeded"
    assert ExecutionAuditEvent.objects.filter(job_id=job.id, event_type="published").count() == 1


def test_range_lost_max_attempts_times__job_fails_attempts_exhausted(tmp_path):
    job = _planned(tmp_path)
    ConversionJob.objects.filter(id=job.id).update(max_attempts=1)
    row = ranges_of(job.id)[2]
    assert _claim(job, row) is not None
    JobRange.objects.filter(id=row.id).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert fanout.job_ranges_recover_if_lease_expired() == 1
    job.refresh_from_db()
    assert (job.state, job.error_code) == ("failed", "attempts_exhausted")
    assert not WorkerLease.objects.filter(job=job).exists()
    # every other range is fenced out: its claim loses
    assert _claim(job, ranges_of(job.id)[0]) is None


def _cancel(api: Any, job_id: Any) -> Any:
    return api(scopes=("jobs:read", "jobs:cancel")).post(f"/api/v1/jobs/{job_id}/cancel")


def test_cancel__every_range_stops_and_no_converter_is_left(tmp_path, api, settings):
    """Two ranges running in two workers, two queued: a cancel stops both workers within the
    heartbeat bound, kills their converters, cancels the queued ranges; the last range to stop
    ends the job CANCELLED."""
    job = _planned(tmp_path, fault={"kind": "slow", "seconds": 1.0})
    rows = ranges_of(job.id)
    workers = [RangeWorker(job, row) for row in rows[:2]]
    for worker in workers:
        worker.start()
    wait_for(lambda: PageCheckpoint.objects.filter(job_id=job.id).count() >= 2, timeout=30)
    children = wait_for(lambda: converter_children(job.id))
    pgids = {os.getpgid(pid) for pid in children}
    started = time.monotonic()
    response = _cancel(api, job.id)
    assert (response.status_code, response.json()["state"]) == (202, "cancelling")
    wait_for(
        lambda: ConversionJob.objects.get(id=job.id).state == "cancelled", timeout=10, interval=0.01
    )
    latency = time.monotonic() - started
    assert sorted(w.result() or "" for w in workers) == ["cancelled", "cancelled"]
    assert latency < settings.QUIRE["HEARTBEAT_S"] + 1.5, latency
    assert all(process_group_members(pgid) == [] for pgid in pgids)
    assert converter_children(job.id) == []
    assert {r.state for r in ranges_of(job.id)} == {"cancelled"}
    assert not WorkerLease.objects.filter(job_id=job.id).exists()
    # a queued range's message, delivered now, is a duplicate
    assert run_range(job, rows[3]) == "duplicate"


def test_cancel__no_range_running__the_sweep_ends_the_job(tmp_path, api):
    job = _planned(tmp_path)
    response = _cancel(api, job.id)
    assert (response.status_code, response.json()["state"]) == (202, "cancelling")
    assert fanout.job_ranges_recover_if_lease_expired() == 1
    job.refresh_from_db()
    assert job.state == "cancelled"
    assert {r.state for r in ranges_of(job.id)} == {"cancelled"}


def test_cancel__an_unsplit_attempt_after_a_fanned_out_generation__is_left_to_its_worker(
    tmp_path,
):
    """Ranges of an earlier generation do not make the range sweep end the cancel of a later,
    unsplit attempt: that attempt's own worker stops its converter and ends it."""
    import uuid

    job = _planned(tmp_path)
    token = uuid.uuid4()
    ConversionJob.objects.filter(id=job.id).update(
        generation=2, lease_token=token, state="cancelling"
    )
    WorkerLease.objects.filter(job_id=job.id).update(
        generation=2, token=token, expires_at=timezone.now() + timedelta(minutes=1)
    )
    assert fanout.job_ranges_recover_if_lease_expired() == 0
    assert ConversionJob.objects.get(id=job.id).state == "cancelling"
