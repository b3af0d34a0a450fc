"""e2e: tenant erasure killed with ``kill -9`` in the middle and run again (issue 24 point 4).

Tenant A has converted jobs (page objects, stored sources, audit chains, a webhook endpoint)
and 600 queued ones; tenant B has a converted job too, one of its documents the same bytes as
one of A's (a shared, content-addressed source). ``manage.py erase_tenant tenant-a`` runs as
its own process. The middle is made reachable deterministically: once the first batch of rows
has committed (the record says so), the test locks the erasure's record row, so the process's
next batch waits on that lock inside its transaction, and the process is killed there. A
second run must finish: no row and no object of A left, B untouched. Runs on S3 too
(``.ci/run``'s s3_e2e suite).
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from django.db import transaction

from conversion_jobs.models import ConversionJob, TenantErasure
from conversion_jobs.pseudonym import pseudonym
from conversion_jobs.webhooks import endpoints
from tests.e2e import harness
from tests.erasure_check import footprint, objects_left, rows_left

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

QUEUED_JOBS = 600


def _erase(cluster: harness.Cluster, tenant: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "manage.py", "erase_tenant", tenant],
        cwd=harness.REPO,
        env=cluster.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def _succeeded(job_ids: list) -> bool:
    return ConversionJob.objects.filter(id__in=job_ids, state="succeeded").count() == len(job_ids)


def test_erase_tenant__killed_mid_rows_then_run_again_leaves_nothing_of_the_tenant(
    cluster, start, submit, settings
):
    settings.QUIRE = {
        **settings.QUIRE,
        "INLINE_SOURCE_MAX_BYTES": 0,  # stored sources
        "TENANT_QUOTA": 10 * QUEUED_JOBS,
    }
    worker = start("worker")
    start("sweeper")
    start("beat")
    converted = [submit(tenant="tenant-a", pages=2, output="png").id for _ in range(3)]
    converted += [submit(tenant="tenant-b", pages=2, output="png").id]
    harness.wait_until(lambda: _succeeded(converted), timeout=90, what="the first jobs")
    # B converts a document A has too: the same bytes, one stored source.
    shared = ConversionJob.objects.get(id=converted[0])
    ConversionJob.objects.filter(id=converted[3]).update(
        source_key=shared.source_key, source_sha256=shared.source_sha256
    )
    worker.stop()
    # A's endpoint: each cancel below writes it a job.cancelled message.
    endpoints.webhook_endpoint_create(
        tenant="tenant-a",
        actor="e2e",
        url="https://hooks.example.com/a",
        events=["job.cancelled"],
        description="",
    )
    for _ in range(QUEUED_JOBS):
        submit(tenant="tenant-a", pages=1)
    a, b = footprint("tenant-a"), footprint("tenant-b")
    b_rows, b_objects = rows_left(b), objects_left(b)
    assert len(a.jobs) == QUEUED_JOBS + 3 and objects_left(a)
    assert b_rows["conversion_job"] == 1 and b_objects

    first = _erase(cluster, "tenant-a")
    record = harness.wait_until(
        lambda: TenantErasure.objects.filter(jobs_deleted__gte=1).first(),
        timeout=120,
        interval=0.02,
        what="the first batch of rows committed",
    )
    with transaction.atomic():
        # The process's next batch updates this row in its own transaction: it waits here.
        held = TenantErasure.objects.select_for_update().get(id=record.id)
        assert held.finished_at is None and held.jobs_deleted < QUEUED_JOBS + 3, (
            "the erasure must still be in its rows step when it is killed"
        )
        time.sleep(1.0)
        first.kill()  # SIGKILL
        first.wait(10)
    assert first.returncode == -9
    middle = rows_left(a)
    assert 0 < middle["conversion_job"] < QUEUED_JOBS + 3, middle
    unfinished = TenantErasure.objects.get(id=record.id)
    assert unfinished.finished_at is None and unfinished.step == "rows"

    second = _erase(cluster, "tenant-a")
    out, _ = second.communicate(timeout=300)
    assert second.returncode == 0, out.decode(errors="replace")[-2000:]
    done = TenantErasure.objects.get()
    assert done.id == record.id and done.finished_at is not None and done.runs == 2
    assert done.tenant_pseudonym == pseudonym("tenant", "tenant-a")
    assert b"tenant-a" not in out
    assert done.jobs_deleted == QUEUED_JOBS + 3
    assert rows_left(a) == dict.fromkeys(rows_left(a), 0)
    # The shared source is B's too: it stays; nothing else of A is stored.
    assert objects_left(a) == [shared.source_key]
    assert rows_left(b) == b_rows and objects_left(b) == b_objects

    third = _erase(cluster, "tenant-a")
    assert third.wait(60) == 0
    assert TenantErasure.objects.count() == 1
