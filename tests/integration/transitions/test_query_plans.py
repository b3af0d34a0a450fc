"""With history in the tables (finished jobs with their attempts, checkpoints, outbox rows,
idempotency records and audit events), every statement of the hot paths and the sweeps reaches
its rows through an index: ``EXPLAIN`` of each statement they actually run (captured, not
retyped) shows no sequential scan of a big table, and each sweep's candidate query uses its
partial index (issue 12 point 6)."""

from __future__ import annotations

import re
import shutil
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.db import connection
from django.utils import timezone

from bench.history import seed_history
from conversion_jobs import storage
from conversion_jobs.models import (
    ConversionJob,
    ConversionOutbox,
    WorkerLease,
)
from conversion_jobs.services import dispatch, recovery, retention, transitions
from conversion_jobs.services.acceptance import StagedUpload, conversion_job_accept
from conversion_jobs.services.admission import admission_snapshot_reset
from conversion_jobs.services.cancellation import conversion_job_cancel
from conversion_jobs.store import checkpoints
from conversion_jobs.store.prepared import as_written
from tests import testdocs
from tests.integration.transitions.builders import done_page, text_result

# Each test runs in a transaction rolled back after it, over history the module seeds once.
pytestmark = [pytest.mark.postgres, pytest.mark.django_db, pytest.mark.usefixtures("_history")]

BIG = (
    "conversion_job",
    "conversion_attempt",
    "page_checkpoint",
    "conversion_outbox",
    "idempotency_record",
    "execution_audit_event",
    "cancellation_request",
)
HISTORY = 20_000
AGO = timedelta(days=30)


def _plans(run: Callable[[], Any]) -> list[tuple[str, str]]:
    """(statement, plan) for every statement ``run`` executes that reads a table. Captured with
    their parameters by an execute wrapper, which sees the ORM's cursors and the hot
    statements' server-binding one (store/prepared.py) alike."""
    captured: list[tuple[str, Any]] = []

    def capture(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        captured.append(as_written(sql, params))  # the acceptance's runs in $n placeholders
        return execute(sql, params, many, context)

    with connection.execute_wrapper(capture):
        run()
    out = []
    with connection.cursor() as cursor:
        for sql, params in captured:
            if not re.match(r"\s*(WITH|SELECT|UPDATE|DELETE|INSERT)", sql, re.I):
                continue
            if re.match(r"\s*INSERT", sql, re.I) and " SELECT " not in sql.upper():
                continue  # a plain VALUES insert reads nothing
            cursor.execute("EXPLAIN " + sql, params)
            out.append((sql, "\n".join(row[0] for row in cursor.fetchall())))
    return out


def _assert_indexed(plans: list[tuple[str, str]], *, uses: str | tuple[str, ...] = ()) -> None:
    """No sequential scan of a table that grows with history; ``uses``: one of these (partial)
    indexes appears in some plan. Two partial indexes over the live set are equally small, so
    the planner may pick either."""
    for sql, plan in plans:
        scans = [t for t in BIG if re.search(rf"Seq Scan on {t}\b", plan)]
        assert not scans, f"sequential scan of {scans} in\n{sql}\n{plan}"
    wanted = (uses,) if isinstance(uses, str) else uses
    if wanted:
        assert any(name in plan for _sql, plan in plans for name in wanted), (
            f"no plan uses {wanted}:\n" + "\n\n".join(plan for _sql, plan in plans)
        )


@pytest.fixture(scope="module")
def _history(django_db_setup: None, django_db_blocker: Any) -> Iterator[None]:
    """``HISTORY`` finished jobs with what hangs off them, seeded, committed and analysed once
    for the module (about 3 s a seeding), and truncated after its last test."""
    with django_db_blocker.unblock():
        with connection.cursor() as cursor:
            seed_history(cursor, jobs=HISTORY, salt=uuid.uuid4().hex)
        yield
        with connection.cursor() as cursor:
            cursor.execute("TRUNCATE " + ", ".join(BIG) + " CASCADE")


@pytest.fixture
def history(make_job: Callable[..., ConversionJob]) -> Callable[..., ConversionJob]:
    """Makes one more job among the history."""
    return make_job


def _upload(tmp_path: Path) -> StagedUpload:
    source = testdocs.make_pdf(tmp_path / "doc.pdf", pages=1, text_of=lambda n: uuid.uuid4().hex)
    staged = Path(settings.QUIRE["STORAGE_DIR"]) / "staging" / uuid.uuid4().hex
    staged.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, staged)
    sha, size = storage.sha256_file(staged)
    return StagedUpload(path=staged, sha256=sha, size=size)


def test_plans__acceptance(history, tmp_path, no_broker_publish):
    admission_snapshot_reset()  # so this acceptance reads the live counts (job_live_tenant)
    plans = _plans(
        lambda: conversion_job_accept(
            tenant="history-3",
            actor="t",
            upload=_upload(tmp_path),
            output="text",
            raw_options={},
            idempotency_key="k-1",
        )
    )
    _assert_indexed(plans, uses="job_content_identity_live_or_succeeded")
    _assert_indexed(plans, uses="job_live_tenant")
    _assert_indexed(plans, uses="idempotency_tenant_key")


def test_plans__claim_checkpoint_publish(history, no_broker_publish):
    job = history()
    claim = transitions.claim(job_id=job.id, generation=1, worker="w")
    assert claim is not None
    page = done_page(job.id, 1)
    _assert_indexed(_plans(lambda: checkpoints.done_pages_record(claim.lease, [page])))
    result = text_result(pages_done=0)
    _assert_indexed(_plans(lambda: transitions.publish_succeeded(lease=claim.lease, result=result)))
    other = history()
    _assert_indexed(_plans(lambda: transitions.claim(job_id=other.id, generation=1, worker="w")))


def test_plans__cancel_and_operator_retry(history, no_broker_publish):
    job = history()
    _assert_indexed(
        _plans(lambda: conversion_job_cancel(job_id=job.id, tenant=job.tenant, actor="a")),
        uses="cancel_unresolved",
    )
    _assert_indexed(
        _plans(
            lambda: recovery.conversion_job_retry_failed(
                job_id=job.id, tenant=job.tenant, actor="a"
            )
        )
    )


SWEEPS: dict[
    str,
    tuple[Callable[[Callable[..., ConversionJob]], None], Callable[[], Any], str | tuple[str, ...]],
]
SWEEPS = {
    "requeue_due_retries": (
        lambda make: make(state="retry_wait", next_attempt_at=timezone.now() - AGO) and None,
        recovery.conversion_jobs_requeue_if_retry_due,
        ("job_retry_due", "job_live_tenant"),
    ),
    "republish_stale_queued": (
        lambda make: make(queued_at=timezone.now() - AGO) and None,
        dispatch.conversion_jobs_republish_if_dispatch_stale,
        ("job_queued_since", "job_live_tenant"),
    ),
    "publish_outbox": (
        lambda make: (
            ConversionOutbox.objects.filter(
                id=ConversionOutbox.objects.create(job=make(), generation=1).id
            ).update(created_at=timezone.now() - AGO)
            and None
        ),
        dispatch.outbox_rows_publish_unpublished,
        "outbox_unpublished",
    ),
    "recover_expired_leases": (
        lambda make: _expired_lease(make),
        recovery.conversion_jobs_recover_if_lease_expired,
        # worker_lease holds live leases only (one per running job): small by construction,
        # so a sequential scan of it is the right plan; the job rows go by primary key.
        (),
    ),
    "repair_leaseless_jobs": (
        lambda make: make(state="running") and None,  # a lease token, no lease or attempt row
        recovery.conversion_jobs_repair_if_leaseless,
        ("job_leased", "job_live_tenant"),
    ),
    "expire_past_retention": (
        lambda make: None,
        lambda: retention.conversion_jobs_expire_if_past_retention(batch=50),
        "job_finished_unexpired",
    ),
    "purge_expired_files": (
        lambda make: None,
        lambda: retention.conversion_jobs_purge_files_if_expired(batch=50),
        "job_expired_unpurged",
    ),
}


def _expired_lease(make: Callable[..., ConversionJob]) -> None:
    job = make()
    assert transitions.claim(job_id=job.id, generation=1, worker="w")
    WorkerLease.objects.filter(job_id=job.id).update(expires_at=timezone.now() - AGO)


@pytest.mark.parametrize("sweep", list(SWEEPS))
def test_plans__sweep_uses_its_index(sweep, history, no_broker_publish):
    arrange, run, index = SWEEPS[sweep]
    arrange(history)
    _assert_indexed(_plans(run), uses=index)
