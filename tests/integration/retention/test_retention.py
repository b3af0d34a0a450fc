"""Retention: expired artifacts gone from rows and storage, unexpired untouched, a crash between
the row and the file deletion finished by the next sweep."""

from __future__ import annotations

import io
from datetime import timedelta

import pytest
from django.utils import timezone

from conversion_jobs import storage
from conversion_jobs.models import (
    ConversionJob,
    ConversionOutbox,
    ExecutionAuditEvent,
    PageCheckpoint,
)
from conversion_jobs.services import retention
from conversion_jobs.services.audit import audit_chain_verify, audit_event_append


def _with_files(make_job, *, finished_ago: timedelta, sha: str):
    job = make_job(state="succeeded", source_sha256=sha, finished_at=timezone.now() - finished_ago)
    for key in (job.source_key, f"results/{job.id}/result.g1.txt", f"pages/{job.id}/00001.g1.txt"):
        storage.put(key, io.BytesIO(b"x"))
    ConversionJob.objects.filter(id=job.id).update(result_key=f"results/{job.id}/result.g1.txt")
    PageCheckpoint.objects.create(
        job=job,
        page_number=1,
        state="done",
        artifact_key=f"pages/{job.id}/00001.g1.txt",
        artifact_sha256="0" * 64,
        generation=1,
    )
    return job


@pytest.mark.django_db(transaction=True)
def test_retention__expires_old_and_keeps_young(make_job, settings):
    settings.QUIRE = {**settings.QUIRE, "RESULT_RETENTION_S": 3600, "ORPHAN_GRACE_S": 0}
    old = _with_files(make_job, finished_ago=timedelta(hours=2), sha="a" * 64)
    young = _with_files(make_job, finished_ago=timedelta(minutes=5), sha="b" * 64)

    result = retention.retention_apply()

    assert result.jobs_expired == 1 and result.jobs_purged == 1
    old.refresh_from_db()
    young.refresh_from_db()
    assert old.expired_at is not None and old.purged_at is not None
    assert not PageCheckpoint.objects.filter(job=old).exists()
    assert not storage.exists(old.source_key)
    assert not list(storage.list_objects(f"results/{old.id}"))
    assert not list(storage.list_objects(f"pages/{old.id}"))
    assert young.expired_at is None and young.purged_at is None
    assert PageCheckpoint.objects.filter(job=young).count() == 1
    assert storage.exists(young.source_key)
    assert storage.exists(f"results/{young.id}/result.g1.txt")
    assert list(
        ExecutionAuditEvent.objects.filter(job_id=old.id).values_list("event_type", flat=True)
    ) == ["expired"]
    assert audit_chain_verify()[1] == []


@pytest.mark.django_db(transaction=True)
def test_retention__crash_between_rows_and_files_is_finished_by_next_sweep(make_job, settings):
    settings.QUIRE = {**settings.QUIRE, "RESULT_RETENTION_S": 60, "ORPHAN_GRACE_S": 0}
    job = _with_files(make_job, finished_ago=timedelta(hours=1), sha="c" * 64)

    # The first sweep dies after committing the rows, before touching a file.
    assert retention.conversion_jobs_expire_if_past_retention(batch=10) == 1
    job.refresh_from_db()
    assert job.expired_at is not None and job.purged_at is None
    assert storage.exists(job.source_key)

    result = retention.retention_apply()
    assert result.jobs_expired == 0 and result.jobs_purged == 1
    job.refresh_from_db()
    assert job.purged_at is not None
    assert not storage.exists(job.source_key)
    assert not list(storage.list_objects(f"results/{job.id}"))


@pytest.mark.django_db(transaction=True)
def test_retention__shared_source_kept_while_an_unexpired_job_uses_it(make_job, settings):
    settings.QUIRE = {**settings.QUIRE, "RESULT_RETENTION_S": 3600, "ORPHAN_GRACE_S": 0}
    old = _with_files(make_job, finished_ago=timedelta(hours=2), sha="d" * 64)
    make_job(state="queued", source_sha256="d" * 64, output="png")
    retention.retention_apply()
    old.refresh_from_db()
    assert old.purged_at is not None
    assert storage.exists(old.source_key)


@pytest.mark.django_db(transaction=True)
def test_retention__prunes_published_outbox_rows_only(make_job, settings):
    settings.QUIRE = {**settings.QUIRE, "OUTBOX_RETENTION_S": 60}
    job = make_job()
    published = ConversionOutbox.objects.create(job=job, generation=1)
    ConversionOutbox.objects.filter(id=published.id).update(
        published_at=timezone.now() - timedelta(hours=1)
    )
    fresh = ConversionOutbox.objects.create(job=job, generation=1)
    ConversionOutbox.objects.filter(id=fresh.id).update(published_at=timezone.now())
    unpublished = ConversionOutbox.objects.create(job=job, generation=1)

    assert retention.retention_apply().outbox_pruned == 1
    assert set(ConversionOutbox.objects.values_list("id", flat=True)) == {fresh.id, unpublished.id}


@pytest.mark.django_db(transaction=True)
def test_retention__purges_whole_old_audit_chains_through_the_trigger(make_job, settings):
    from django.db import transaction

    settings.QUIRE = {**settings.QUIRE, "AUDIT_RETENTION_S": 0}
    job = make_job()
    with transaction.atomic():
        audit_event_append(job_id=job.id, event_type="accepted", generation=1)
    assert retention.audit_chains_purge_if_past_retention(batch=10) == 1
    assert not ExecutionAuditEvent.objects.filter(job_id=job.id).exists()


@pytest.mark.django_db(transaction=True)
def test_retention__expired_job_leaves_the_content_identity(
    settings, api, pdf_file, no_broker_publish
):
    """A resubmission of an expired succeeded job's document is new work, not a duplicate of a
    job whose result is gone; an operator retry of an expired failed job is refused."""
    settings.QUIRE = {**settings.QUIRE, "RESULT_RETENTION_S": 60, "ORPHAN_GRACE_S": 0}
    client = api()
    done_doc, failed_doc = pdf_file(salt="done"), pdf_file(salt="failed")
    ids = []
    for path in (done_doc, failed_doc):
        with open(path, "rb") as fh:
            ids.append(
                client.post(
                    "/api/v1/jobs", {"file": fh, "output": "text"}, format="multipart"
                ).json()["id"]
            )
    long_ago = timezone.now() - timedelta(hours=1)
    ConversionJob.objects.filter(id=ids[0]).update(
        state="succeeded", result_key="results/x", result_sha256="0" * 64, finished_at=long_ago
    )
    ConversionJob.objects.filter(id=ids[1]).update(
        state="failed", error_code="invalid_input", finished_at=long_ago
    )
    with open(done_doc, "rb") as fh:  # before expiry: the succeeded job answers (duplicate)
        duplicate = client.post("/api/v1/jobs", {"file": fh, "output": "text"}, format="multipart")
    assert (duplicate.status_code, duplicate.json()["id"]) == (200, ids[0])

    assert retention.retention_apply().jobs_expired == 2

    with open(done_doc, "rb") as fh:
        again = client.post("/api/v1/jobs", {"file": fh, "output": "text"}, format="multipart")
    assert again.status_code == 202 and again.json()["id"] not in ids
    assert client.get(f"/api/v1/jobs/{ids[0]}").json()["result"] is None
    retry = client.post(f"/api/v1/jobs/{ids[1]}/retry")
    assert (retry.status_code, retry.json()["code"]) == (409, "not_retryable")


@pytest.mark.django_db(transaction=True)
def test_retention__prunes_finished_webhook_messages_only(make_job, settings):
    from conversion_jobs.models import WebhookAttempt, WebhookEndpoint, WebhookMessage

    settings.QUIRE = {**settings.QUIRE, "WEBHOOK_RETENTION_S": 60}
    job = make_job(state="succeeded")
    endpoint = WebhookEndpoint.objects.create(
        tenant="tenant-a", url="https://hooks.example.com/", events=["job.succeeded"]
    )
    old = timezone.now() - timedelta(hours=1)

    def message(state: str, created_at):
        made = WebhookMessage.objects.create(
            endpoint=endpoint,
            job_id=job.id,
            event_type="job.succeeded",
            state=state,
            created_at=created_at,
            next_attempt_at=created_at,
            delivered_at=created_at if state == "delivered" else None,
        )
        WebhookAttempt.objects.create(message=made, at=created_at, outcome="retry")
        return made

    message("delivered", old)
    message("failed", old)
    owed = message("pending", old)
    fresh = message("delivered", timezone.now())

    assert retention.retention_apply().webhook_messages_pruned == 2
    assert set(WebhookMessage.objects.values_list("id", flat=True)) == {owed.id, fresh.id}
    assert set(WebhookAttempt.objects.values_list("message_id", flat=True)) == {owed.id, fresh.id}
