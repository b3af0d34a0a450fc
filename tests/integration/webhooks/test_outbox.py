"""The webhook outbox (docs/API_CONTRACT.md §9): every terminal edge writes one message per
enabled endpoint of the job's tenant subscribed to its event, in the terminal transaction; the
publish statement (``store.jobs.PUBLISH``) and the ORM terminal hook (``_terminal``) are held in
step (both built from ``states.TERMINAL_EFFECTS``: tests/integration/store/test_statements.py)."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection, transaction

from conversion_jobs.models import (
    ConversionJob,
    PageCheckpoint,
    PageState,
    WebhookEndpoint,
    WebhookMessage,
    WorkerLease,
)
from conversion_jobs.representation import job_representation
from conversion_jobs.services import recovery, transitions
from conversion_jobs.states import TERMINAL_STATES, State
from conversion_jobs.store import db as store_db
from conversion_jobs.webhooks.outbox import EVENT_OF_STATE, payload_render
from tests.integration.transitions.test_edges import CASES, _setup

ALL_EVENTS = [e.value for e in EVENT_OF_STATE.values()]
TERMINAL_EDGES = [edge for edge in CASES if edge[1] in TERMINAL_STATES]
#: each terminal edge, and the publish edges once more through the ORM path on Postgres
PATHS = [(edge, "default") for edge in TERMINAL_EDGES] + [
    (edge, "orm") for edge in TERMINAL_EDGES if edge[0] == State.RUNNING and edge[1] != State.FAILED
]


def endpoint(tenant: str = "tenant-a", events: list[str] | None = None, **fields: Any):
    return WebhookEndpoint.objects.create(
        tenant=tenant,
        url="https://hooks.example.com/quire",
        events=ALL_EVENTS if events is None else events,
        secret_sealed="sealed",
        **fields,
    )


def _run(edge, path: str, make_job, monkeypatch) -> ConversionJob:
    source, call = CASES[edge]
    job, lease = _setup(make_job, source)
    if path == "orm":  # the ORM statements of the standalone profile, on this database
        monkeypatch.setattr(store_db, "postgres", lambda: False)
    assert call(job, lease)
    return ConversionJob.objects.get(id=job.id)


def test_outbox__every_terminal_edge_is_covered():
    terminal = {edge for edge in transitions.EDGES if edge[1] in TERMINAL_STATES}
    assert set(TERMINAL_EDGES) == terminal
    assert set(EVENT_OF_STATE) == set(TERMINAL_STATES)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("edge", "path"), PATHS, ids=[f"{a.value}->{b.value}-{p}" for (a, b), p in PATHS]
)
def test_outbox__terminal_edge_writes_one_message_per_subscribed_endpoint(
    edge, path, make_job, monkeypatch, no_broker_publish
):
    event = EVENT_OF_STATE[edge[1]].value
    subscribed = [endpoint(), endpoint(events=[event])]
    endpoint(events=[e for e in ALL_EVENTS if e != event])  # not subscribed to this event
    endpoint(enabled=False, disabled_reason="by_tenant", disabled_at="2026-01-01T00:00Z")
    endpoint(tenant="tenant-b")  # another tenant's

    job = _run(edge, path, make_job, monkeypatch)

    messages = list(WebhookMessage.objects.filter(job_id=job.id))
    assert sorted(m.endpoint_id for m in messages) == sorted(e.id for e in subscribed)
    for message in messages:
        assert message.event_type == event
        assert message.state == "pending"
        assert message.attempts == 0
        body = payload_render(message)
        assert body == {
            "type": event,
            "timestamp": job_representation(job)["finished_at"],
            "data": job_representation(job),
        }
        # rendered once, kept for every retry
        assert WebhookMessage.objects.get(id=message.id).payload == body


@pytest.mark.django_db(transaction=True)
def test_outbox__lease_sweep_attempts_exhausted_writes_job_failed(make_job, no_broker_publish):
    hook = endpoint(events=["job.failed"])
    job, _ = _setup(make_job, State.RUNNING)
    ConversionJob.objects.filter(id=job.id).update(max_attempts=1)
    WorkerLease.objects.filter(job_id=job.id).update(expires_at="2000-01-01T00:00Z")

    assert recovery.conversion_jobs_recover_if_lease_expired() == 1

    job.refresh_from_db()
    assert (job.state, job.error_code) == ("failed", "attempts_exhausted")
    (message,) = WebhookMessage.objects.filter(job_id=job.id)
    assert (message.endpoint_id, message.event_type) == (hook.id, "job.failed")
    assert payload_render(message)["data"]["error"]["code"] == "attempts_exhausted"


@pytest.mark.django_db(transaction=True)
def test_outbox__no_endpoint_no_message(make_job, no_broker_publish):
    for edge in TERMINAL_EDGES:
        source, call = CASES[edge]
        job, lease = _setup(make_job, source)
        assert call(job, lease)
    assert WebhookMessage.objects.count() == 0


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("edge", "path"), PATHS, ids=[f"{a.value}->{b.value}-{p}" for (a, b), p in PATHS]
)
def test_outbox__rolled_back_terminal_transaction_writes_none(
    edge, path, make_job, monkeypatch, no_broker_publish
):
    endpoint()
    source, call = CASES[edge]
    job, lease = _setup(make_job, source)
    if path == "orm":
        monkeypatch.setattr(store_db, "postgres", lambda: False)

    class Abort(Exception):
        pass

    with pytest.raises(Abort), transaction.atomic():
        assert call(job, lease)
        assert WebhookMessage.objects.filter(job_id=job.id).count() == 1
        raise Abort

    assert ConversionJob.objects.get(id=job.id).state == source.value
    assert WebhookMessage.objects.filter(job_id=job.id).count() == 0


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_outbox__publish_statement_with_failed_pages_goes_the_orm_way(make_job, no_broker_publish):
    """A partial publish carrying a failed page runs the ORM statements even on Postgres; the
    message it writes carries its body from the start."""
    if connection.vendor != "postgresql":
        pytest.fail("production profile only")
    endpoint()
    job, lease = _setup(make_job, State.RUNNING)
    failed = PageCheckpoint(
        job_id=job.id, page_number=1, state=PageState.FAILED, attempts=3, generation=1
    )
    assert transitions.publish_partial(
        lease=lease,
        result=transitions.Result(
            key="results/x",
            sha256="a" * 64,
            size=1,
            media_type="text/plain",
            pages_done=0,
            pages_failed=1,
        ),
        checkpoints=[failed],
    )
    (message,) = WebhookMessage.objects.filter(job_id=job.id)
    assert message.payload is not None
    assert message.payload["data"]["state"] == "partial"
