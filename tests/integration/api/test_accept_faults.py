"""Crash windows of acceptance, by named fault injection (conversion_jobs/faults.py)."""

from __future__ import annotations

import pytest
from rest_framework.test import APIClient

from conversion_jobs import faults
from conversion_jobs.models import ConversionOutbox
from tests.conftest import token
from tests.integration.api.conftest import row_counts, submit


def _client() -> APIClient:
    client = APIClient(raise_request_exception=False)
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token()}")
    return client


@pytest.mark.django_db(transaction=True)
def test_submit__fault_after_job_insert_leaves_no_row(pdf_file, settings_quire, no_broker_publish):
    """The insert's transaction (a reused stored source: checked under its lock in the same
    transaction) fails after the insert: nothing of it stays. (A fresh or inline source's
    acceptance is the insert statement alone, in autocommit: all or nothing by itself.)"""
    settings_quire(INLINE_SOURCE_MAX_BYTES=0)
    path = pdf_file()
    assert submit(_client(), path, output="png").status_code == 202  # the source is stored
    before = row_counts()
    with faults.armed("accept.after_job_insert"):
        response = submit(_client(), path, key="k1")
    assert response.status_code == 500
    assert response["Content-Type"] == "application/problem+json"
    assert response.json()["code"] == "internal_error"
    assert row_counts() == before
    assert len(no_broker_publish) == 1  # the first job's only
    # The client's retry with the same key is a fresh, successful submit.
    retry = submit(_client(), path, key="k1")
    assert retry.status_code == 202


@pytest.mark.postgres  # on SQLite every acceptance is one ORM transaction (and the fault fires)
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("inline_max", [65536, 0], ids=["inline", "stored"])
def test_submit__fresh_source_is_accepted_in_one_autocommitted_statement(
    pdf_file, settings_quire, no_broker_publish, inline_max
):
    """No transaction of its own around the insert: the fault point inside that transaction is
    never reached, and the job, its outbox row, key and audit event are all committed (a
    fresh stored source, or an inline one with its bytes)."""
    settings_quire(INLINE_SOURCE_MAX_BYTES=inline_max)
    with faults.armed("accept.after_job_insert"):
        response = submit(_client(), pdf_file(), key="k1")
    assert response.status_code == 202
    assert row_counts() == {
        "jobs": 1,
        "outbox": 1,
        "idempotency": 1,
        "audit": 1,
        "cancellations": 0,
    }


@pytest.mark.django_db(transaction=True)
def test_submit__fault_after_commit_leaves_a_recoverable_queued_job(pdf_file, no_broker_publish):
    path = pdf_file()
    with faults.armed("accept.after_commit"):
        response = submit(_client(), path, key="k1")
    assert response.status_code == 500
    assert response["Content-Type"] == "application/problem+json"

    client = _client()
    listed = client.get("/api/v1/jobs").json()["jobs"]
    assert len(listed) == 1
    job_id = listed[0]["id"]
    polled = client.get(f"/api/v1/jobs/{job_id}")
    assert polled.status_code == 200
    assert polled.json()["state"] == "queued"
    assert polled.json()["generation"] == 1
    outbox = ConversionOutbox.objects.get(job_id=job_id)
    assert outbox.generation == 1
    assert row_counts() == {
        "jobs": 1,
        "outbox": 1,
        "idempotency": 1,
        "audit": 1,
        "cancellations": 0,
    }
    # The commit happened, so the fast path ran; the sweeper would cover it had it not.
    assert no_broker_publish == [(job_id, 1)]
    # The client retries with its key and learns the job id.
    retry = submit(client, path, key="k1")
    assert retry.status_code == 200
    assert retry["Idempotent-Replayed"] == "true"
    assert retry.json()["id"] == job_id
