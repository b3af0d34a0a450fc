"""Acceptance under concurrency: Idempotency-Key replays and content identity (issue 2)."""

from __future__ import annotations

import json

import pytest
from rest_framework.test import APIClient

from conversion_jobs.models import (
    ConversionJob,
    ConversionOutbox,
    ExecutionAuditEvent,
    IdempotencyRecord,
    InlineSource,
)
from conversion_jobs.representation import job_etag_of
from tests.conftest import token
from tests.integration.api.conftest import problem, row_counts, run_concurrently, submit

THREADS = 20


def _client(tenant: str = "tenant-a") -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token(tenant=tenant)}")
    return client


@pytest.mark.django_db(transaction=True)
def test_submit__20_concurrent_same_idempotency_key_make_one_job(pdf_file, no_broker_publish):
    path = pdf_file()
    calls = [lambda: submit(_client(), path, key="order-42") for _ in range(THREADS)]
    responses = run_concurrently(calls)

    statuses = sorted(r.status_code for r in responses)
    assert statuses == [200] * (THREADS - 1) + [202], [r.content[:200] for r in responses]
    ids = {r.json()["id"] for r in responses}
    assert len(ids) == 1
    job_id = ids.pop()
    for r in responses:
        if r.status_code == 202:
            assert r["Location"] == f"/api/v1/jobs/{job_id}"
            assert "Idempotent-Replayed" not in r
        else:
            assert r["Idempotent-Replayed"] == "true"
        assert r["ETag"] == job_etag_of(ConversionJob.objects.get(id=job_id))
    assert ConversionJob.objects.count() == 1
    assert ConversionOutbox.objects.filter(job_id=job_id).count() == 1
    assert ConversionOutbox.objects.count() == 1
    assert IdempotencyRecord.objects.count() == 1
    assert IdempotencyRecord.objects.get().job_id == ConversionJob.objects.get().id
    assert ExecutionAuditEvent.objects.filter(job_id=job_id).count() == 1
    assert no_broker_publish == [(job_id, 1)]


@pytest.mark.django_db(transaction=True)
def test_submit__20_concurrent_same_content_without_key_make_one_job(pdf_file, no_broker_publish):
    path = pdf_file()
    responses = run_concurrently([lambda: submit(_client(), path) for _ in range(THREADS)])

    statuses = sorted(r.status_code for r in responses)
    assert statuses == [200] * (THREADS - 1) + [202], [r.content[:200] for r in responses]
    assert len({r.json()["id"] for r in responses}) == 1
    assert all("Idempotent-Replayed" not in r for r in responses)
    assert row_counts() == {
        "jobs": 1,
        "outbox": 1,
        "idempotency": 0,
        "audit": 1,
        "cancellations": 0,
    }
    assert len(no_broker_publish) == 1


@pytest.mark.django_db(transaction=True)
def test_submit__replay_with_key_answers_200_replayed(api, pdf_file, no_broker_publish):
    client, path = api(), pdf_file()
    first = submit(client, path, key="k1")
    assert first.status_code == 202
    again = submit(client, path, key="k1")
    assert again.status_code == 200
    assert again["Idempotent-Replayed"] == "true"
    assert again.json()["id"] == first.json()["id"]
    assert row_counts()["jobs"] == 1
    # The small PDF is an inline source (ADR 0017 session 10): the replay wrote no second copy.
    assert InlineSource.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_submit__same_key_different_file_is_422_and_writes_nothing(
    api, pdf_file, no_broker_publish
):
    client = api()
    assert submit(client, pdf_file(salt="one"), key="k1").status_code == 202
    before = row_counts()
    body = problem(submit(client, pdf_file(salt="two"), key="k1"), 422, "idempotency_key_reused")
    assert body["detail"]
    assert row_counts() == before
    assert len(no_broker_publish) == 1


@pytest.mark.django_db(transaction=True)
def test_submit__same_key_different_options_is_422_and_writes_nothing(
    api, pdf_file, no_broker_publish
):
    client, path = api(), pdf_file()
    assert submit(client, path, key="k1", options={"pages": "1-1"}).status_code == 202
    before = row_counts()
    problem(submit(client, path, key="k1", options={"pages": "1-2"}), 422, "idempotency_key_reused")
    problem(submit(client, path, key="k1", output="png"), 422, "idempotency_key_reused")
    assert row_counts() == before


@pytest.mark.django_db(transaction=True)
def test_submit__same_key_equivalent_options_is_a_replay(api, pdf_file, no_broker_publish):
    client, path = api(), pdf_file()
    first = submit(client, path, key="k1", options={"pages": "2-2"})
    again = submit(
        client, path, key="k1", options=json.dumps({"pages": [2], "allow_partial": True})
    )
    assert (first.status_code, again.status_code) == (202, 200)
    assert again["Idempotent-Replayed"] == "true"
    assert again.json()["id"] == first.json()["id"]


@pytest.mark.django_db(transaction=True)
def test_submit__same_key_is_per_tenant(pdf_file, no_broker_publish):
    path = pdf_file()
    a = submit(_client("tenant-a"), path, key="shared")
    b = submit(_client("tenant-b"), path, key="shared")
    assert (a.status_code, b.status_code) == (202, 202)
    assert a.json()["id"] != b.json()["id"]


@pytest.mark.django_db(transaction=True)
def test_submit__content_duplicate_binds_a_new_key(api, pdf_file, no_broker_publish):
    """A keyed submit answered by a content-identity duplicate binds its key to that job, so the
    key is then protected: another payload under it is 422, the same payload a replay."""
    client, path = api(), pdf_file()
    first = submit(client, path)
    assert first.status_code == 202
    dup = submit(client, path, key="late-key")
    assert dup.status_code == 200
    assert dup.json()["id"] == first.json()["id"]
    record = IdempotencyRecord.objects.get(key="late-key")
    assert str(record.job_id) == first.json()["id"]
    problem(submit(client, pdf_file(salt="other"), key="late-key"), 422, "idempotency_key_reused")
    replay = submit(client, path, key="late-key")
    assert replay.status_code == 200 and replay["Idempotent-Replayed"] == "true"


@pytest.mark.django_db(transaction=True)
def test_submit__concurrent_keyed_and_unkeyed_same_content_bind_every_key(
    pdf_file, no_broker_publish
):
    """Racing submits of the same bytes under different keys all land on one job, and every key
    ends up bound to it (no key is lost by a rolled-back race)."""
    path = pdf_file()
    keys = [f"key-{i}" for i in range(8)]
    responses = run_concurrently([lambda k=k: submit(_client(), path, key=k) for k in keys])
    assert sorted(r.status_code for r in responses) == [200] * 7 + [202]
    job_ids = {r.json()["id"] for r in responses}
    assert len(job_ids) == 1
    assert ConversionJob.objects.count() == 1
    bound = dict(IdempotencyRecord.objects.values_list("key", "job_id"))
    assert set(bound) == set(keys)
    assert {str(v) for v in bound.values()} == job_ids


@pytest.mark.django_db(transaction=True)
def test_submit__finished_failed_job_does_not_block_a_new_one(api, pdf_file, no_broker_publish):
    client, path = api(), pdf_file()
    first = submit(client, path)
    ConversionJob.objects.filter(id=first.json()["id"]).update(
        state="failed",
        error_code="invalid_input",
        finished_at=ConversionJob.objects.get().created_at,
    )
    again = submit(client, path)
    assert again.status_code == 202
    assert again.json()["id"] != first.json()["id"]
