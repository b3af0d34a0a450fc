"""Poison documents (issue 24 point 3, services/quarantine.py): the crash count and its decision,
the hosts rule, two recorders at once (Postgres, a second real connection), a real converter
crashing twice in the real worker path, the 422 at submit with nothing written, tenants kept
apart, an engine version change and an operator's lift. Both profiles unless marked."""

from __future__ import annotations

import threading
import time
import uuid
from datetime import timedelta
from typing import Any

import pytest
from django.core.management import call_command
from django.db import connection, connections, transaction
from django.utils import timezone

from conversion_jobs import converters
from conversion_jobs.models import (
    ConversionAttempt,
    ConversionJob,
    DocumentCrash,
    DocumentQuarantine,
    ExecutionAuditEvent,
)
from conversion_jobs.services import quarantine, recovery
from tests.integration.api.conftest import problem, row_counts, submit
from tests.integration.execution.jobkit import execute
from tests.integration.execution.jobkit import submit as submit_job

PDF = "application/pdf"
ENGINE = converters.engine_version(PDF)


def _record(
    *, tenant: str = "tenant-a", sha: str = "a" * 64, attempt: int, worker: str = "h1:1"
) -> quarantine.Verdict:
    return quarantine.document_crash_record(
        tenant=tenant,
        source_sha256=sha,
        engine_version=ENGINE,
        job_id=uuid.uuid4(),
        attempt_id=attempt,
        worker=worker,
        code="converter_crashed",
    )


def _attempts_on(make_job: Any, *workers: str) -> None:
    """Recent attempts that ran on these workers (the hosts the quarantine knows of)."""
    job = make_job(state="failed")
    for generation, worker in enumerate(workers, start=1):
        ConversionAttempt.objects.create(
            job=job,
            generation=generation,
            number=generation,
            worker=worker,
            started_at=timezone.now(),
            heartbeat_at=timezone.now(),
            finished_at=timezone.now(),
            outcome="terminal_error",
        )


@pytest.mark.django_db(transaction=True)
def test_crash_record__second_crash_quarantines():
    first = _record(attempt=1)
    assert (first.quarantined, first.crashes) == (False, 1)
    second = _record(attempt=2)
    assert (second.quarantined, second.crashes, second.hosts) == (True, 2, 1)
    row = DocumentQuarantine.objects.get()
    assert row.quarantined_at is not None and row.crashes == 2
    assert quarantine.document_quarantined(
        tenant="tenant-a", source_sha256="a" * 64, engine_version=ENGINE
    )
    assert not quarantine.document_quarantined(
        tenant="tenant-b", source_sha256="a" * 64, engine_version=ENGINE
    )


@pytest.mark.django_db(transaction=True)
def test_crash_record__one_attempt_counts_once(settings):
    _record(attempt=7)
    again = _record(attempt=7)
    assert (again.quarantined, again.crashes) == (False, 1)
    assert DocumentCrash.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_crash_record__the_setting_decides(settings):
    settings.QUIRE = {**settings.QUIRE, "QUARANTINE_AFTER_CRASHES": 3}
    assert not _record(attempt=1).quarantined
    assert not _record(attempt=2).quarantined
    assert _record(attempt=3).quarantined


@pytest.mark.django_db(transaction=True)
def test_crash_record__several_hosts_known_needs_crashes_on_two(make_job):
    _attempts_on(make_job, "node-1:10", "node-2:20")
    assert not _record(attempt=1, worker="node-1:10").quarantined
    on_one_host = _record(attempt=2, worker="node-1:11")
    assert (on_one_host.quarantined, on_one_host.crashes, on_one_host.known_hosts) == (False, 2, 2)
    second_host = _record(attempt=3, worker="node-2:20")
    assert (second_host.quarantined, second_host.hosts) == (True, 2)


@pytest.mark.django_db(transaction=True)
def test_crash_record__tenants_never_share_a_key():
    _record(tenant="tenant-a", attempt=1)
    other = _record(tenant="tenant-b", attempt=2)
    assert (other.quarantined, other.crashes) == (False, 1)
    assert DocumentQuarantine.objects.count() == 2


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_crash_record__two_recorders_at_once_lose_no_count():
    """A holds its crash uncommitted while B records another crash of the same document: B
    waits on the key's row lock and, once A commits, counts both. (A read-modify-write or an
    unlocked count would let each see one crash, and nobody would quarantine.)"""
    recorded_a, release_a = threading.Event(), threading.Event()
    verdicts: dict[str, quarantine.Verdict] = {}

    def a() -> None:
        try:
            with transaction.atomic():
                verdicts["a"] = _record(attempt=1)
                recorded_a.set()
                release_a.wait(30)
        finally:
            connections.close_all()

    def b() -> None:
        try:
            verdicts["b"] = _record(attempt=2, worker="h1:2")
        finally:
            connections.close_all()

    ta = threading.Thread(target=a)
    ta.start()
    assert recorded_a.wait(30)
    tb = threading.Thread(target=b)
    tb.start()
    deadline = time.monotonic() + 30
    with connection.cursor() as cursor:
        while True:  # B is waiting on A's lock (not done already, not failed)
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                " AND datname = current_database()"
            )
            if cursor.fetchone()[0] >= 1:
                break
            assert time.monotonic() < deadline, "B never waited on A's lock"
            time.sleep(0.02)
    assert "b" not in verdicts
    release_a.set()
    ta.join(30)
    tb.join(30)
    assert verdicts["a"].crashes == 1 and not verdicts["a"].quarantined
    assert (verdicts["b"].crashes, verdicts["b"].quarantined) == (2, True)


@pytest.mark.django_db(transaction=True)
def test_execute__a_converter_crashing_twice_quarantines_the_job(
    fast_quire, no_broker_publish, pdf_file
):
    job = submit_job(pdf_file(salt="poison"), output="text", fault={"kind": "segv"})
    assert execute(job) == "retry_wait"
    ConversionJob.objects.filter(id=job.id).update(
        next_attempt_at=timezone.now() - timedelta(seconds=1)
    )
    assert recovery.conversion_jobs_requeue_if_retry_due() == 1
    job.refresh_from_db()
    assert execute(job) == "failed"
    job.refresh_from_db()
    assert (job.state, job.error_code, job.attempts) == ("failed", "document_quarantined", 2)
    assert job.error_retryable is False
    assert ConversionAttempt.objects.filter(job=job).count() == 2
    row = DocumentQuarantine.objects.get()
    assert (row.tenant, row.source_sha256, row.engine_version) == (
        "tenant-a",
        job.source_sha256,
        ENGINE,
    )
    assert (row.crashes, row.job_id) == (2, job.id)
    event = ExecutionAuditEvent.objects.filter(job_id=job.id).order_by("-seq").first()
    assert event is not None and event.event_type == "document_quarantined"
    assert event.details["crashes"] == 2 and "tenant" not in event.details


@pytest.mark.django_db(transaction=True)
def test_submit__quarantined_document_is_422_with_nothing_written(api, pdf_file, no_broker_publish):
    path = pdf_file(salt="bad")
    first = submit(api(), path, key="k-first")
    assert first.status_code == 202
    job = ConversionJob.objects.get()
    for attempt in (1, 2):
        quarantine.document_crash_record(
            tenant="tenant-a",
            source_sha256=job.source_sha256,
            engine_version=ENGINE,
            job_id=job.id,
            attempt_id=attempt,
            worker="h:1",
            code="converter_crashed",
        )
    before = row_counts()
    # The live job still answers its own identity and its key's replay ...
    assert submit(api(), path, key="k-first").status_code == 200
    # ... once it has failed, every new submission of the bytes is refused, nothing written.
    ConversionJob.objects.filter(id=job.id).update(
        state="failed", error_code="document_quarantined", finished_at=timezone.now()
    )
    problem(submit(api(), path), 422, "document_quarantined")
    problem(submit(api(), path, output="png"), 422, "document_quarantined")
    problem(submit(api(), path, key="k-new"), 422, "document_quarantined")
    assert row_counts() == before
    assert submit(api(), path, key="k-first").status_code == 200  # the replay still answers
    # Another tenant's same bytes are its own business.
    assert submit(api(tenant="tenant-b"), path).status_code == 202


@pytest.mark.django_db(transaction=True)
def test_submit__quarantine_of_another_engine_version_does_not_refuse(
    api, pdf_file, no_broker_publish
):
    path = pdf_file(salt="old-engine")
    import hashlib

    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    DocumentQuarantine.objects.create(
        tenant="tenant-a",
        source_sha256=sha,
        engine_version="pdfium 1.0 (the release before)",
        crashes=2,
        quarantined_at=timezone.now(),
        created_at=timezone.now(),
        updated_at=timezone.now(),
    )
    assert submit(api(), path).status_code == 202


@pytest.mark.django_db(transaction=True)
def test_lift__operator_lift_by_command_admits_the_document_again(
    api, pdf_file, no_broker_publish, capsys
):
    path = pdf_file(salt="lift")
    import hashlib

    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    for attempt in (1, 2):
        quarantine.document_crash_record(
            tenant="tenant-a",
            source_sha256=sha,
            engine_version=ENGINE,
            job_id=uuid.uuid4(),
            attempt_id=attempt,
            worker="h:1",
            code="conversion_timeout",
        )
    problem(submit(api(), path), 422, "document_quarantined")
    row = DocumentQuarantine.objects.get()
    call_command("quarantine", "list")
    listed = capsys.readouterr().out
    assert str(row.id) in listed and "tenant-a" not in listed and sha not in listed
    call_command("quarantine", "lift", str(row.id))
    row.refresh_from_db()
    assert row.quarantined_at is None and row.lifted_at is not None and row.crashes == 0
    assert not DocumentCrash.objects.exists()
    assert submit(api(), path).status_code == 202
    # lifting again changes nothing
    assert not quarantine.document_quarantine_lift(quarantine_id=row.id, actor="op")
