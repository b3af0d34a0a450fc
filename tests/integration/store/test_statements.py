"""The store's driver suite (docs/ARCHITECTURE.md, "The store"), as River's driver tests: every
statement of ``conversion_jobs/store/`` runs here, its effect and its row count checked (a fenced
or guarded one: the winner 1, the loser 0, nothing written by the loser).

It runs in both profiles (``.ci/run``: the production pass on Postgres, the standalone pass on
SQLite). On Postgres each statement with an ORM twin runs twice, as its Postgres text
(``statement``) and as its twin (``twin``: ``store.db.postgres`` answers False); on SQLite the
twin is the statement. ``test_every_statement_is_driven_here`` fails when a statement of the
store is named nowhere in this file."""

from __future__ import annotations

import ast
import importlib
import inspect
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.db import IntegrityError, connection, transaction
from django.utils import timezone

from conversion_jobs import store
from conversion_jobs.converters import ConversionStarved
from conversion_jobs.ids import uuid7
from conversion_jobs.models import (
    CancellationRequest,
    ConversionAttempt,
    ConversionJob,
    ConversionOutbox,
    DispatchClock,
    DocumentQuarantine,
    ExecutionAuditEvent,
    IdempotencyRecord,
    InlineSource,
    JobRange,
    PageCheckpoint,
    PageState,
    RangeState,
    TenantShare,
    WebhookEndpoint,
    WebhookMessage,
    WorkerLease,
    WorkerSlot,
)
from conversion_jobs.services import transitions
from conversion_jobs.services.audit import audit_chain_verify
from conversion_jobs.services.leases import Lease, RangeLease
from conversion_jobs.states import TERMINAL_EFFECTS, State
from conversion_jobs.store import (
    audit,
    checkpoints,
    db,
    fair,
    jobs,
    leases,
    notify,
    outbox,
    quarantine,
    sources,
)
from tests.integration.transitions.builders import done_page, text_result

pytestmark = pytest.mark.django_db

POSTGRES = connection.vendor == "postgresql"
#: how a statement runs in this profile: its Postgres text and its ORM twin, or the twin alone
PATHS = ["statement", "twin"] if POSTGRES else ["twin"]
#: the modules whose every statement this suite drives (``db`` and ``prepared`` have their own
#: suites: tests/integration/test_db_health_check.py, test_prepared_statements.py)
DRIVEN = (audit, checkpoints, fair, jobs, leases, notify, outbox, quarantine, sources)


@pytest.fixture(params=PATHS)
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "twin":
        monkeypatch.setattr(db, "postgres", lambda: False)
    return str(request.param)


def _claimed(make_job: Callable[..., ConversionJob], **fields: Any) -> Lease:
    job = make_job(state=State.QUEUED, **fields)
    now = timezone.now()
    token = uuid.uuid4()
    won = jobs.claim(
        job_id=job.id,
        generation=job.generation,
        worker="w",
        token=token,
        now=now,
        expires=now + timedelta(minutes=5),
    )
    assert won is not None
    claimed, attempt_id, _source = won
    return Lease(job.id, job.generation, token, attempt_id, claimed.attempts, now)


def _stranger(lease: Lease) -> Lease:
    """``lease`` with another token: what a worker whose lease was recovered still holds."""
    return Lease(lease.job_id, lease.generation, uuid.uuid4(), lease.attempt_id, 1, None)


_FAILED = {"state": PageState.FAILED, "attempts": 3, "error_code": "page_timeout", "generation": 1}


def _failed_page(job_id: uuid.UUID, number: int) -> PageCheckpoint:
    return PageCheckpoint(job_id=job_id, page_number=number, **_FAILED)


# --- the one list of terminal effects ---------------------------------------------------------


def test_terminal_effects__the_hook_and_the_publish_statement_have_each_one():
    in_sql = set(jobs.PUBLISH_EFFECTS)
    after_commit = set(jobs.PUBLISH_AFTER_COMMIT)
    assert in_sql | after_commit == set(TERMINAL_EFFECTS)
    assert not in_sql & after_commit
    assert set(transitions._EFFECTS) == set(TERMINAL_EFFECTS)
    assert len(TERMINAL_EFFECTS) == len(set(TERMINAL_EFFECTS))
    for member in jobs.PUBLISH_EFFECTS.values():
        assert member in jobs.PUBLISH


# --- store/jobs.py ----------------------------------------------------------------------------


def test_claim__the_winner_gets_the_lease_the_loser_nothing(path, make_job):
    lease = _claimed(make_job)
    job = ConversionJob.objects.get(id=lease.job_id)
    assert (job.state, job.attempts, job.lease_token) == (State.RUNNING, 1, lease.token)
    attempt = ConversionAttempt.objects.get(id=lease.attempt_id)
    assert (attempt.job_id, attempt.generation, attempt.number) == (job.id, 1, 1)
    assert WorkerLease.objects.get(job_id=job.id).token == lease.token
    assert list(
        ExecutionAuditEvent.objects.filter(job_id=job.id).values_list("event_type", flat=True)
    ) == ["claimed"]
    now = timezone.now()
    again = jobs.claim(
        job_id=job.id, generation=1, worker="w2", token=uuid.uuid4(), now=now, expires=now
    )
    assert again is None
    assert ConversionAttempt.objects.filter(job_id=job.id).count() == 1
    assert ConversionJob.objects.get(id=job.id).lease_token == lease.token
    assert audit_chain_verify(job_id=job.id) == (1, [])


def test_claim__returns_an_inline_source_with_the_row(path, make_job):
    job = make_job(state=State.QUEUED)
    InlineSource.objects.create(job=job, content=b"%PDF inline")
    now = timezone.now()
    won = jobs.claim(
        job_id=job.id, generation=1, worker="w", token=uuid.uuid4(), now=now, expires=now
    )
    assert won is not None and won[2] == b"%PDF inline"


def test_move__guarded_winner_one_loser_zero(make_job):
    job = make_job(state=State.QUEUED)
    guard = jobs.of_tenant(job.id, job.tenant)
    assert jobs.move(guard, State.QUEUED, State.CANCELLED, finished_at=timezone.now()) == 1
    assert jobs.move(guard, State.QUEUED, State.CANCELLED, finished_at=timezone.now()) == 0
    moved = ConversionJob.objects.get(id=job.id)
    assert (moved.state, moved.state_version) == (State.CANCELLED, job.state_version + 1)
    with pytest.raises(LookupError):
        jobs.move(guard, State.SUCCEEDED, State.QUEUED)
    assert jobs.of_tenant(job.id, "another-tenant").count() == 0


def test_move_returning_generation__the_generation_it_moved_or_none(make_job):
    job = make_job(state=State.FAILED)
    guard = jobs.of_tenant(job.id, None)
    back = {"generation": 2, "finished_at": None, "error_code": None}
    assert jobs.move_returning_generation(guard, State.FAILED, State.QUEUED, **back) == 2
    assert jobs.move_returning_generation(guard, State.FAILED, State.QUEUED) is None


def test_lock_for_choice__the_row_locked_or_none(make_job):
    job = make_job(state=State.QUEUED)
    with transaction.atomic():
        row = jobs.lock_for_choice(job.id, job.tenant)
        assert row is not None
        held = dict(zip(jobs.LOCKED_COLUMNS, row, strict=True))
        assert (held["state"], held["generation"], held["lease_token"]) == ("queued", 1, None)
        assert jobs.lock_for_choice(job.id, "another-tenant") is None


def test_job_reads_and_outbox_insert(make_job):
    job = make_job(state=State.QUEUED, traceparent="00-trace-01")
    assert jobs.generation_of(job.id) == 1
    assert jobs.generation_of(uuid.uuid4()) is None
    assert jobs.traceparent_of(job.id) == "00-trace-01"
    outbox_id = jobs.outbox_insert(job_id=job.id, generation=1, traceparent="00-trace-01")
    row = ConversionOutbox.objects.get(id=outbox_id)
    assert (row.job_id, row.generation, row.published_at) == (job.id, 1, None)


def test_attempt_close__once_with_its_page_count(path, make_job):
    lease = _claimed(make_job)
    assert checkpoints.batch_record(lease, [done_page(lease.job_id, 1), done_page(lease.job_id, 2)])
    close = {
        "attempt_id": lease.attempt_id,
        "job_id": lease.job_id,
        "generation": 1,
        "outcome": "cancelled",
        "error_code": None,
    }
    assert jobs.attempt_close(**close) == 1
    assert jobs.attempt_close(**close) == 0
    attempt = ConversionAttempt.objects.get(id=lease.attempt_id)
    assert (attempt.outcome, attempt.pages_converted) == ("cancelled", 2)
    assert attempt.finished_at is not None


#: a cancellation request of a running job, pending
_PENDING = {"actor": "a", "generation_seen": 1, "state_seen": "running", "outcome": "cancelling"}


def _cancel_request(job: ConversionJob) -> CancellationRequest:
    return CancellationRequest.objects.create(job_id=job.id, tenant=job.tenant, **_PENDING)


def test_cancellations__lost_or_cancelled_once(make_job):
    lost, cancelled = make_job(state=State.RUNNING), make_job(state=State.CANCELLING)
    _cancel_request(lost)
    request = _cancel_request(cancelled)
    assert jobs.cancellations_lost(lost.id) == 1
    assert jobs.cancellations_lost(lost.id) == 0
    assert CancellationRequest.objects.get(job_id=lost.id).outcome == "lost_to_completion"
    now = timezone.now()
    assert jobs.cancellations_cancelled(cancelled.id, now) == [request.requested_at]
    assert jobs.cancellations_cancelled(cancelled.id, now) == []
    assert CancellationRequest.objects.get(id=request.id).outcome == "cancelled"


def _new_job(make_job: Callable[..., ConversionJob], **fields: Any) -> ConversionJob:
    """An unsaved queued job, as the acceptance builds it."""
    template = make_job(state=State.QUEUED, **fields)
    ConversionJob.objects.filter(id=template.id).delete()
    template.id = uuid7()
    return template


def _insert(
    job: ConversionJob,
    *,
    key: str | None = None,
    inline: bytes | None = None,
    send_if_idle: bool = False,
) -> Any:
    details = {"size": 1}
    return jobs.insert_queued(
        jobs.NewJob(job, "tester", key, "f" * 64, details, inline, engine_version="pdfium 1"),
        send_if_idle=send_if_idle,
    )


def test_insert_queued__every_row_or_a_unique_violation(path, make_job):
    job = _new_job(make_job)
    inserted = _insert(job, key="k1", inline=b"bytes")
    assert not inserted.sent
    assert ConversionOutbox.objects.get(id=inserted.outbox_id).job_id == job.id
    assert ConversionJob.objects.get(id=job.id).state == State.QUEUED
    assert IdempotencyRecord.objects.get(tenant=job.tenant, key="k1").job_id == job.id
    assert bytes(InlineSource.objects.get(job_id=job.id).content) == b"bytes"
    assert audit_chain_verify(job_id=job.id) == (1, [])
    other = _new_job(make_job)
    with pytest.raises(IntegrityError), transaction.atomic():
        _insert(other, key="k1")
    assert not ConversionJob.objects.filter(id=other.id).exists()


@pytest.mark.postgres
def test_insert_queued__the_statement_writes_nothing_for_a_quarantined_or_known_document(
    make_job,
):
    job = _new_job(make_job)
    DocumentQuarantine.objects.create(
        tenant=job.tenant,
        source_sha256=job.source_sha256,
        engine_version="pdfium 1",
        quarantined_at=timezone.now(),
        created_at=timezone.now(),
        updated_at=timezone.now(),
    )
    assert _insert(job) is None
    assert not ConversionJob.objects.filter(id=job.id).exists()
    known = make_job(state=State.QUEUED)
    twin = _new_job(make_job)
    twin.source_sha256, twin.options_digest = known.source_sha256, known.options_digest
    assert _insert(twin, inline=b"x") is None  # the inline form: ON CONFLICT DO NOTHING
    assert not ConversionJob.objects.filter(id=twin.id).exists()


@pytest.mark.parametrize("inline", [None, b"bytes"])
def test_insert_queued__sent_when_idle_by_the_statement_never_by_the_twin(
    path, make_job, settings, inline
):
    """``fair.ADMIT`` (with ``fair.ADMIT_SHARE`` and ``fair.admit_params``): an idle system's
    acceptance writes its unit sent, as the pick would (under ``fair.PICK_LOCK``); the twin
    leaves it to the pick. Not idle (a credit short): written waiting."""
    settings.QUIRE = {**settings.QUIRE, "FAIR_CAPACITY": 1}
    assert set(fair.admit_params()) == {"f_capacity", "f_lost", "f_ttl"}
    assert f"pg_try_advisory_xact_lock({fair.PICK_LOCK})" in fair.ADMIT
    pick_sql = importlib.import_module("conversion_jobs.migrations.0020_fair_pick_tenant_heads")
    assert f"pg_advisory_xact_lock({fair.PICK_LOCK})" in pick_sql.FAIR_PICK_SQL
    assert fair.ADMIT in jobs.accept_sql(False, True)
    assert fair.ADMIT_SHARE in jobs.accept_sql(True, True)
    assert fair.ADMIT not in jobs.accept_sql(False)
    job = _new_job(make_job, dispatch_cost=3)
    inserted = _insert(job, inline=inline, send_if_idle=True)
    row = ConversionOutbox.objects.get(id=inserted.outbox_id)
    fresh = ConversionJob.objects.get(id=job.id)
    if path == "twin":
        assert not inserted.sent and not inserted.no_credit  # the pick decides there
        assert (row.published_at, fresh.dispatched_at) == (None, None)
        return
    assert inserted.sent
    assert row.published_at == fresh.dispatched_at is not None
    assert (row.publish_attempts, fresh.dispatched_generation) == (1, 1)
    clock = DispatchClock.objects.get(id=1).vclock
    assert TenantShare.objects.get(tenant=job.tenant).vtime == pytest.approx(clock + 3)
    assert not inserted.no_credit
    second = _insert(_new_job(make_job), inline=inline, send_if_idle=True)
    assert not second.sent  # the one slot is held by the first, sent and not claimed
    assert second.no_credit
    assert ConversionOutbox.objects.get(id=second.outbox_id).published_at is None


def test_insert_alone__only_where_the_insert_is_one_statement(path):
    assert jobs.insert_alone() is (path == "statement")


def test_precheck__the_key_the_duplicate_and_the_quarantine(make_job):
    job = make_job(state=State.QUEUED, policy_version=7, output="text")
    IdempotencyRecord.objects.create(tenant=job.tenant, key="k", fingerprint="fp", job=job)
    params = {
        "tenant": job.tenant,
        "key": "k",
        "sha": job.source_sha256,
        "output": "text",
        "digest": job.options_digest,
        "policy": 7,
        "engine": "e1",
    }
    fingerprint, key_job, duplicate, quarantined = jobs.precheck(params)
    assert fingerprint == "fp" and not quarantined
    assert uuid.UUID(str(key_job)) == job.id == uuid.UUID(str(duplicate))
    none = jobs.precheck({**params, "key": "other", "sha": "0" * 64})
    assert none[:3] == (None, None, None) and not none[3]
    assert jobs.PRECHECK.strip().startswith("SELECT")


def test_job_insert_params__one_per_column(make_job):
    job = _new_job(make_job)
    params = jobs.job_insert_params(job)
    assert set(params) == {f"j_{f.column}" for f in ConversionJob._meta.concrete_fields}
    if POSTGRES:  # the statement's text, built once from the model's columns
        assert jobs.accept_sql(True) is jobs.accept_sql(True)
        assert jobs.ACCEPT_INLINE in jobs.accept_sql(True)
        assert jobs.ACCEPT_INLINE not in jobs.accept_sql(False)
        assert "ON CONFLICT DO NOTHING" in jobs.accept_sql(True)
        assert jobs.ACCEPT.split("{")[0] in jobs.accept_sql(False)
        # ... and in PostgreSQL's placeholders, each name once, as the raw cursor sends it
        statement = jobs.accept_statement(True, True)
        assert statement is jobs.accept_statement(True, True)
        assert statement.named == jobs.accept_sql(True, True)
        assert "%" not in statement.sql and f"${len(statement.names)}" in statement.sql
        assert set(statement.names) <= {
            *params,
            "inline",
            "now",
            "actor",
            "key",
            "fingerprint",
            "details",
            "genesis",
            "q_engine",
            *fair.admit_params(),
        }


def _publish_setup(make_job: Callable[..., ConversionJob]) -> Lease:
    lease = _claimed(make_job)
    job = ConversionJob.objects.get(id=lease.job_id)
    WebhookEndpoint.objects.create(
        tenant=job.tenant,
        url="https://hooks.example.com/quire",
        events=["job.succeeded"],
        secret_sealed="sealed",
    )
    _cancel_request(job)
    return lease


def test_publish__every_terminal_effect_then_the_loser_writes_nothing(path, make_job):
    """The publish edge on this path: ``PUBLISH`` (``statement``) or the edge's general path
    with the Python hook (``twin``): the same rows either way, one per terminal effect."""
    lease = _publish_setup(make_job)
    result = text_result(pages_done=1)
    won = transitions.publish_succeeded(
        lease=lease, result=result, checkpoints=[done_page(lease.job_id, 1)]
    )
    assert won is True
    job = ConversionJob.objects.get(id=lease.job_id)
    assert (job.state, job.pages_done, job.lease_token) == (State.SUCCEEDED, 1, None)
    assert PageCheckpoint.objects.get(job_id=job.id, page_number=1).state == PageState.DONE
    # lease_end
    assert not WorkerLease.objects.filter(job_id=job.id).exists()
    attempt = ConversionAttempt.objects.get(id=lease.attempt_id)
    assert (attempt.outcome, attempt.pages_converted) == ("succeeded", 1)
    # cancellations
    assert CancellationRequest.objects.get(job_id=job.id).outcome == "lost_to_completion"
    # audit
    assert list(
        ExecutionAuditEvent.objects.filter(job_id=job.id)
        .order_by("seq")
        .values_list("event_type", flat=True)
    ) == ["claimed", "published"]
    assert audit_chain_verify(job_id=job.id) == (2, [])
    # webhooks
    assert WebhookMessage.objects.filter(job_id=job.id, event_type="job.succeeded").count() == 1
    assert transitions.publish_succeeded(lease=lease, result=result) is False
    assert ExecutionAuditEvent.objects.filter(job_id=job.id).count() == 2


@pytest.mark.postgres
def test_publish__the_statement_counts_the_winner_and_the_loser(make_job):
    lease = _publish_setup(make_job)
    values = {
        "result_key": "results/x",
        "result_sha256": "a" * 64,
        "result_size": 1,
        "result_media_type": "text/plain",
    }
    call = {
        "attempt_id": lease.attempt_id,
        "state": State.SUCCEEDED,
        "event": "job.succeeded",
        "values": values,
        "details": {"state": "succeeded"},
        "checkpoints": [done_page(lease.job_id, 1)],
    }
    assert jobs.publish(_stranger(lease), **call) == (0, 0)
    assert ConversionJob.objects.get(id=lease.job_id).state == State.RUNNING
    assert jobs.publish(lease, **call) == (1, 1)
    assert jobs.publish(lease, **call) == (0, 0)
    assert audit_chain_verify(job_id=lease.job_id) == (2, [])


def test_webhook_messages__a_member_of_the_publish():
    assert jobs.WEBHOOK_MESSAGES in jobs.PUBLISH_EFFECTS["webhooks"]
    assert jobs.CLAIM_ASYNC_COMMIT.strip().startswith("WHERE set_config")
    assert "{hash}" in jobs.CLAIM and "{hash}" in jobs.PUBLISH


# --- store/leases.py --------------------------------------------------------------------------


def test_fence__the_holder_matches_a_stranger_does_not(make_job):
    lease = _claimed(make_job)
    assert leases.held(lease).count() == 1
    assert leases.held(lease, State.RUNNING).count() == 1
    assert leases.held(lease, State.CANCELLING).count() == 0
    assert leases.held(_stranger(lease)).count() == 0
    assert leases.fence_params(lease) == {
        "job": lease.job_id,
        "generation": 1,
        "token": lease.token,
    }
    assert leases.FENCE in checkpoints.DONE_PAGES and leases.FENCE in jobs.PUBLISH


def test_lease_extend__only_an_unexpired_lease_of_its_holder(make_job):
    lease = _claimed(make_job)
    now = timezone.now()
    later = now + timedelta(minutes=10)
    assert leases.lease_extend(lease, now=now, expires=later) == 1
    assert WorkerLease.objects.get(job_id=lease.job_id).expires_at == later
    assert leases.lease_extend(_stranger(lease), now=now, expires=later) == 0
    assert leases.lease_extend(lease, now=later + timedelta(seconds=1), expires=later) == 0


def test_state_under__the_state_or_none(make_job):
    lease = _claimed(make_job)
    assert leases.state_under(lease) == State.RUNNING
    assert leases.state_under(_stranger(lease)) is None


def test_attempt_heartbeat__an_open_attempt_only(make_job):
    lease = _claimed(make_job)
    assert leases.attempt_heartbeat(lease.attempt_id, now=timezone.now()) == 1
    closed = {"finished_at": timezone.now(), "outcome": "cancelled"}
    ConversionAttempt.objects.filter(id=lease.attempt_id).update(**closed)
    assert leases.attempt_heartbeat(lease.attempt_id, now=timezone.now()) == 0


def test_lease_delete__its_holder_once(make_job):
    lease = _claimed(make_job)
    assert leases.lease_delete(_stranger(lease)) == 0
    assert leases.lease_delete(lease) == 1
    assert leases.lease_delete(lease) == 0


def test_row_locks__the_job_then_its_range(make_job):
    lease = _claimed(make_job)
    token = uuid.uuid4()
    row = JobRange.objects.create(
        job_id=lease.job_id,
        job_generation=1,
        first_page=1,
        last_page=2,
        state=RangeState.RUNNING,
        lease_token=token,
        expires_at=timezone.now() + timedelta(minutes=5),
    )
    held_range = RangeLease(row.id, lease.job_id, 1, 2, 1, token)
    with transaction.atomic():
        assert leases.job_row_lock(lease) is True
        assert leases.job_row_lock(lease, State.CANCELLING) is False
        assert leases.job_row_lock(_stranger(lease)) is False
        assert leases.range_row_lock(held_range) is True
        assert leases.range_row_lock(RangeLease(row.id, lease.job_id, 1, 2, 2, token)) is False


# --- store/checkpoints.py ---------------------------------------------------------------------


def test_batch_record__the_holder_writes_a_stranger_writes_nothing(path, make_job):
    lease = _claimed(make_job)
    pages = [done_page(lease.job_id, 1), done_page(lease.job_id, 2)]
    assert checkpoints.one_statement(pages) is (path == "statement")
    assert checkpoints.batch_record(_stranger(lease), pages) == 0
    assert not PageCheckpoint.objects.filter(job_id=lease.job_id).exists()
    assert checkpoints.batch_record(lease, pages) == 1
    assert ConversionJob.objects.get(id=lease.job_id).pages_done == 2
    assert PageCheckpoint.objects.filter(job_id=lease.job_id, state=PageState.DONE).count() == 2
    again = [done_page(lease.job_id, 2)]
    assert checkpoints.batch_record(lease, again) == 1  # an upsert: the row is rewritten
    assert PageCheckpoint.objects.filter(job_id=lease.job_id).count() == 2


def test_batch_record__a_failed_page_runs_also_in_its_transaction(path, make_job):
    lease = _claimed(make_job)
    calls: list[bool] = []
    batch = [done_page(lease.job_id, 1), _failed_page(lease.job_id, 2)]
    assert checkpoints.one_statement(batch) is False
    assert checkpoints.batch_record(lease, batch, also=lambda: calls.append(True)) == 1
    assert calls == [True]
    job = ConversionJob.objects.get(id=lease.job_id)
    assert (job.pages_done, job.pages_failed) == (1, 1)
    assert checkpoints.counters(batch).keys() == {"pages_done", "pages_failed"}
    assert checkpoints.counters([]) == {}


@pytest.mark.postgres
def test_done_pages_record__winner_one_loser_zero(make_job):
    lease = _claimed(make_job)
    page = [done_page(lease.job_id, 1)]
    assert checkpoints.done_pages_record(_stranger(lease), page) == 0
    assert checkpoints.done_pages_record(lease, page) == 1
    stored = PageCheckpoint.objects.get(job_id=lease.job_id, page_number=1)
    assert (stored.state, bytes(stored.content or b""), stored.error_code) == ("done", b"x", None)
    assert set(checkpoints.done_pages_params(page)) == {
        "p_number",
        "p_attempts",
        "p_key",
        "p_sha",
        "p_size",
        "p_media",
        "p_content",
    }
    assert checkpoints.UPSERT_DONE_PAGES in checkpoints.DONE_PAGES
    assert checkpoints.UPSERT_DONE_PAGES in jobs.PUBLISH


def test_checkpoint_columns__the_model_and_both_upserts(make_job):
    assert checkpoints.CHECKPOINT_COLUMNS == tuple(
        f.attname for f in PageCheckpoint._meta.concrete_fields
    )
    for column in checkpoints.UPSERTED:
        assert f"{column} = EXCLUDED.{column}" in checkpoints.UPSERT_DONE_PAGES
    lease = _claimed(make_job)
    failed = _failed_page(lease.job_id, 1)
    checkpoints.upsert([failed])
    checkpoints.upsert([done_page(lease.job_id, 1)])
    stored = PageCheckpoint.objects.get(job_id=lease.job_id, page_number=1)
    assert (stored.state, stored.error_code, stored.attempts) == ("done", None, 1)


def test_pages_converted_by_and_failed_reset(make_job):
    lease = _claimed(make_job)
    checkpoints.upsert([done_page(lease.job_id, 1), _failed_page(lease.job_id, 2)])
    counted = ConversionJob.objects.filter(id=lease.job_id).annotate(
        n=checkpoints.pages_converted_by(job_id=lease.job_id, generation=1)
    )
    assert counted.values_list("n", flat=True).get() == 1
    assert checkpoints.failed_reset(lease.job_id) == 1
    assert checkpoints.failed_reset(lease.job_id) == 0
    page = PageCheckpoint.objects.get(job_id=lease.job_id, page_number=2)
    assert (page.state, page.attempts, page.error_code) == ("pending", 0, None)


# --- store/outbox.py --------------------------------------------------------------------------


def test_mark_published__once(path, make_job):
    job = make_job(state=State.QUEUED)
    ids = [jobs.outbox_insert(job_id=job.id, generation=1, traceparent="") for _ in range(2)]
    assert outbox.mark_published(ids[:1]) == 1
    assert outbox.mark_published(ids) == 1  # the first one is marked already
    assert outbox.mark_published(ids) == 0
    rows = ConversionOutbox.objects.filter(id__in=ids)
    assert all(r.published_at is not None and r.publish_attempts == 1 for r in rows)
    assert "synchronous_commit" in outbox.MARK_PUBLISHED


def test_failure_record__unpublished_rows_only(make_job):
    job = make_job(state=State.QUEUED)
    row = jobs.outbox_insert(job_id=job.id, generation=1, traceparent="")
    assert outbox.failure_record([row], "broker_unavailable") == 1
    stored = ConversionOutbox.objects.get(id=row)
    assert (stored.publish_attempts, stored.last_error_code) == (1, "broker_unavailable")
    outbox.mark_published([row])
    assert outbox.failure_record([row], "broker_unavailable") == 0


# --- store/audit.py ---------------------------------------------------------------------------


def test_event_append__chains_on_the_job_or_counts_zero(path, make_job):
    job = make_job(state=State.QUEUED)
    event = {
        "event_type": "note",
        "generation": 1,
        "attempt_id": None,
        "actor": audit.SYSTEM_ACTOR,
        "details": {"n": 1},
    }
    with transaction.atomic():
        assert audit.event_append(job_id=job.id, created_at=timezone.now(), **event) == 1
        assert audit.event_append(job_id=job.id, created_at=timezone.now(), **event) == 1
        assert audit.event_append(job_id=uuid.uuid4(), created_at=timezone.now(), **event) == 0
    first = ExecutionAuditEvent.objects.get(job_id=job.id, seq=1)
    assert first.prev_hash == audit.GENESIS
    assert audit_chain_verify(job_id=job.id) == (2, [])
    assert "{hash}" in audit.APPEND
    body = audit.event_body(job_id=job.id, created_at=first.created_at, seq=1, **event)
    assert (
        audit.event_hash(
            prev_hash=audit.GENESIS, job_id=job.id, seq=1, created_at=first.created_at, **event
        )
        == first.hash
    )
    params: dict[str, Any] = {}
    assert audit.chain_sql(prev="p", seq="1", body=body, params=params).startswith("encode(")
    assert audit.spliced_sql(f'"{audit.slot("x")}"', exprs={"x": "1"}, params=params)


def test_purge_on__the_one_path_that_deletes_events(make_job):
    job = make_job(state=State.QUEUED)
    with transaction.atomic():
        audit.event_append(
            job_id=job.id,
            event_type="note",
            generation=1,
            attempt_id=None,
            actor="system",
            details={},
            created_at=timezone.now(),
        )
    with transaction.atomic():
        audit.purge_on()
        assert ExecutionAuditEvent.objects.filter(job_id=job.id).delete()[0] == 1


# --- store/quarantine.py, store/sources.py, store/notify.py -----------------------------------


def test_crash_record__counts_each_attempt_once(make_job):
    job = make_job(state=State.RUNNING)
    crash = {
        "tenant": job.tenant,
        "source_sha256": job.source_sha256,
        "engine_version": "e1",
        "job_id": job.id,
        "attempt_id": 1,
        "host": "h1",
        "code": "converter_crashed",
    }
    with transaction.atomic():
        first = quarantine.crash_record(**crash, now=timezone.now())
        again = quarantine.crash_record(**crash, now=timezone.now())
        other = quarantine.crash_record(
            **{**crash, "attempt_id": 2, "host": "h2"}, now=timezone.now()
        )
    assert (first.counted, first.crashes, first.hosts, first.quarantined_at) == (True, 1, 1, None)
    assert (again.key_id, again.counted, again.crashes) == (first.key_id, False, 1)
    assert (other.counted, other.crashes, other.hosts) == (True, 2, 2)
    assert "ON CONFLICT" in quarantine.KEY_UPSERT and "ON CONFLICT" in quarantine.CRASH_INSERT
    assert "count(DISTINCT host)" in quarantine.CRASH_COUNT


def test_source_lock__held_until_the_transaction_ends(path):
    with transaction.atomic():
        sources.source_lock(sha256="ab" * 32, exclusive=False)
        sources.source_lock(sha256="ab" * 32, exclusive=True)
        if path == "statement":
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT mode FROM pg_locks WHERE locktype = 'advisory' AND classid = %s"
                    " AND pid = pg_backend_pid()",
                    [sources.SOURCE_LOCK_CLASS],
                )
                modes = {mode for (mode,) in cursor.fetchall()}
            assert modes == {"ShareLock", "ExclusiveLock"}
    assert "shared" in sources.LOCK_SHARED and "shared" not in sources.LOCK_EXCLUSIVE


def test_notify__sent_where_notifications_are_delivered(path):
    assert notify.notifies() is (path == "statement")
    assert notify.notify("quire_webhook") == (1 if path == "statement" else 0)
    assert notify.listen_sql("quire_webhook") == "LISTEN quire_webhook"
    with pytest.raises(ValueError):
        notify.listen_sql("x; DROP TABLE conversion_job")
    notify.ping()
    assert "dbname=" in notify.conninfo() or not POSTGRES
    if path == "twin":
        assert notify.listen_connection("quire_webhook") is None


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_listen_connection__receives_a_committed_notify():
    conn = notify.listen_connection("quire_store_test")
    assert conn is not None
    try:
        with transaction.atomic():
            notify.notify("quire_store_test")
        received = list(conn.notifies(timeout=5, stop_after=1))
        assert [n.channel for n in received] == ["quire_store_test"]
    finally:
        conn.close()


# --- the suite drives the whole store ---------------------------------------------------------


# --- the fair relay (store/fair.py) -------------------------------------------------------------


@pytest.fixture
def fair_slots(settings: Any) -> None:
    settings.QUIRE = {**settings.QUIRE, "FAIR_CAPACITY": 3}


def _unit(make_job: Callable[..., ConversionJob], tenant: str = "t") -> tuple[ConversionJob, int]:
    job = make_job(state=State.QUEUED, tenant=tenant, dispatch_cost=1)
    return job, ConversionOutbox.objects.create(job=job, generation=1).id


def test_fair_pick__marks_each_unit_sent_once_within_the_credits(path, make_job, fair_slots):
    assert "quire_fair_pick" in fair.PICK
    units = [_unit(make_job) for _ in range(4)]
    assert fair.capacity() == 3 and fair.waiting().count() == 4
    picked = fair.pick(limit=10)
    assert [p.job_id for p in picked] == [j.id for j, _ in units[:3]]
    assert fair.pick(limit=10) == []  # three sent, unclaimed: no credit left
    assert fair.busy_by_tenant() == {"t": 3} and fair.waiting().count() == 1
    job = ConversionJob.objects.get(id=units[0][0].id)
    assert job.dispatched_generation == 1
    assert ConversionOutbox.objects.get(id=units[0][1]).published_at == job.dispatched_at


def _age_pick(job_id: uuid.UUID, seconds: float) -> None:
    at = timezone.now() - timedelta(seconds=seconds)
    ConversionJob.objects.filter(id=job_id).update(dispatched_at=at)
    ConversionOutbox.objects.filter(job_id=job_id).update(published_at=at)


def test_fair_confirm_and_return_unconfirmed__an_unconfirmed_unit_waits_again(
    path, make_job, fair_slots
):
    assert "published_at" in fair.CONFIRM and "unconfirmed" in fair.RETURN_UNCONFIRMED
    (job, row), (confirmed, _) = _unit(make_job), _unit(make_job)
    fair.pick(limit=10)
    _age_pick(job.id, 10)
    _age_pick(confirmed.id, 10)
    fair.confirm([ConversionOutbox.objects.get(job=confirmed).id])
    assert fair.return_unconfirmed(after_s=1.0, batch=10) == 1  # the confirmed one stays sent
    outbox_row = ConversionOutbox.objects.get(id=row)
    assert (outbox_row.published_at, outbox_row.last_error_code) == (None, "unconfirmed")
    assert ConversionJob.objects.get(id=job.id).dispatched_at is None
    assert fair.return_unconfirmed(after_s=1.0, batch=10) == 0


def test_every_statement_is_driven_here():
    """Each public function and statement constant of the store is named in this file."""
    text = Path(__file__).read_text()
    missing = []
    for module in DRIVEN:
        short = module.__name__.rsplit(".", 1)[1]
        for name in _statements_and_functions(module):
            if f"{short}.{name}" not in text:
                missing.append(f"{short}.{name}")
    assert missing == []
    assert store.__doc__


def _statements_and_functions(module: Any) -> list[str]:
    """The public functions and UPPER_CASE constants ``module`` itself defines."""
    names = []
    for node in ast.parse(inspect.getsource(module)).body:
        if isinstance(node, ast.FunctionDef):
            names.append(node.name)
        targets = [node.target] if isinstance(node, ast.AnnAssign) else []
        targets += node.targets if isinstance(node, ast.Assign) else []
        names += [t.id for t in targets if isinstance(t, ast.Name) and t.id.isupper()]
    return [name for name in names if not name.startswith("_")]


def test_fair_others_unsent__sees_other_tenants_rows_on_both_sides_never_the_askers(
    path, make_job, fair_slots
):
    assert not fair.anything_unsent()
    _unit(make_job, tenant="m")
    assert fair.anything_unsent()
    assert not fair.others_unsent(tenant="m")  # its own backlog is not another's
    _, below = _unit(make_job, tenant="a")
    assert fair.others_unsent(tenant="m") and fair.others_unsent(tenant="a")
    ConversionOutbox.objects.filter(id=below).update(published_at=timezone.now())
    assert not fair.others_unsent(tenant="m")  # sent: not waiting
    _unit(make_job, tenant="z")
    assert fair.others_unsent(tenant="m")


def _spare(name: str = "host:9") -> None:
    WorkerSlot.objects.create(name=name, slots=0, seen_at=timezone.now())


def test_fair_step_aside__fenced_one_per_spare_only_while_a_unit_waits(path, make_job, fair_slots):
    """``STEP_ASIDE``: the holder of the lease hands its slot back (the busy count and the pick
    skip it) while a unit waits and a spare is free; a stranger, a second attempt with one
    spare, and an attempt with nothing waiting get False and write nothing."""
    assert "aside_lease" in fair.STEP_ASIDE
    first, second = _claimed(make_job, tenant="t"), _claimed(make_job, tenant="t")
    assert fair.busy_by_tenant() == {"t": 2}
    step = fair.step_aside
    assert not step(job_id=first.job_id, lease=first.token)  # no spare announced
    _spare()
    assert not step(job_id=first.job_id, lease=first.token)  # nothing waits
    _unit(make_job, tenant="u")
    assert not step(job_id=first.job_id, lease=_stranger(first).token)  # not its holder
    assert ConversionJob.objects.get(id=first.job_id).aside_lease is None
    assert step(job_id=first.job_id, lease=first.token)
    assert step(job_id=first.job_id, lease=first.token)  # again: it already has
    assert not step(job_id=second.job_id, lease=second.token)  # the one spare is taken
    assert fair.busy_by_tenant() == {"t": 1}
    assert [p.tenant for p in fair.pick(limit=10)] == ["u"]  # 3 slots, 1 busy, 1 sent now
    _spare("host:10")
    assert not step(job_id=second.job_id, lease=second.token)  # sent: nothing waits again
    _unit(make_job, tenant="v")
    assert step(job_id=second.job_id, lease=second.token)
    assert fair.busy_by_tenant() == {"u": 1}


def test_fair_step_aside__ends_with_the_lease(path, make_job, fair_slots):
    """A new claim's token ends the mark without a write: the job's slot counts again."""
    lease = _claimed(make_job, tenant="t")
    _spare()
    _unit(make_job, tenant="u")
    assert fair.step_aside(job_id=lease.job_id, lease=lease.token)
    ConversionJob.objects.filter(id=lease.job_id).update(lease_token=uuid.uuid4())
    assert fair.busy_by_tenant() == {"t": 1}


def test_fair_step_aside__never_again_for_a_job_starved_aside_once(path, make_job, fair_slots):
    """A job whose earlier attempt yielded ``conversion_starved`` keeps its slot from then on."""
    assert f"'{fair.STARVED}'" in fair.STEP_ASIDE and fair.STARVED == ConversionStarved.code
    lease = _claimed(make_job, tenant="t")
    _spare()
    _unit(make_job, tenant="u")
    ConversionAttempt.objects.filter(id=lease.attempt_id).update(error_code=fair.STARVED)
    assert not fair.step_aside(job_id=lease.job_id, lease=lease.token)
    assert fair.busy_by_tenant() == {"t": 1}
