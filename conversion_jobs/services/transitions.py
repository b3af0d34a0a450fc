"""The job state machine's one home (docs/ARCHITECTURE.md §3, ADR 0017): the only code that writes
``conversion_job.state``.

One function per edge of ``states.TRANSITIONS``, bound to its edge by ``@edge`` (a test checks
that every edge has exactly one function and every function an edge). Each is one guarded
UPDATE whose row count is the answer; ``_move`` bumps ``state_version`` (the ``asgi`` NOTIFY
trigger fires on it). Callers that must choose an edge (cancel, lease recovery, the repair
sweep, operator retry) lock the job row first (``job_lock_for_choice``) and call the one edge
the state they hold allows, in the same transaction: trying edges one after another let a
commit between two tries make every edge miss (docs/ARCHITECTURE.md, "Lock, then choose").
The worker's retryable error tries two edges whose guards split on ``attempts``, a column
nobody else changes while the worker holds the lease, so their order alone decides there.

Every edge that leaves a leased state ends the attempt and its lease (``_lease_ends``); every
edge into a terminal state runs ``_terminal`` (lease end, pending cancellation requests
resolved, the terminal metric, the audit event, the webhook messages). No caller repeats them.

The hot edges (claim, publish) and the acceptance insert are one SQL statement each on Postgres
(a CTE that moves the job and writes its attempt, lease, checkpoints, outbox and audit rows in
one round trip, the hook included). SQLite (the standalone profile, one writer at a time under
``BEGIN IMMEDIATE``) runs the same edges as the ORM statements below; both paths are tested.
"""

from __future__ import annotations

import functools
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, TypeVar

from django.conf import settings
from django.db import connection, models, transaction
from django.db.models import F, Q, QuerySet
from django.db.models.functions import Coalesce, Now
from django.utils import timezone

from conversion_jobs import storage
from conversion_jobs.models import (
    AttemptOutcome,
    CancellationOutcome,
    CancellationRequest,
    ConversionAttempt,
    ConversionJob,
    ConversionOutbox,
    ExecutionAuditEvent,
    IdempotencyRecord,
    InlineSource,
    PageCheckpoint,
    PageState,
    WorkerLease,
)
from conversion_jobs.observability import metrics
from conversion_jobs.options import canonical_json
from conversion_jobs.services.audit import (
    GENESIS,
    SYSTEM_ACTOR,
    audit_event_append,
    chain_sql,
    event_body,
    event_hash,
    slot,
    spliced_sql,
)
from conversion_jobs.services.checkpoints import (
    UPSERT_DONE_PAGES,
    checkpoints_upsert,
    done_pages_params,
    page_counters,
    pages_converted_by,
)
from conversion_jobs.services.dispatch import outbox_publish_after_commit
from conversion_jobs.services.leases import Lease, lease_ttl
from conversion_jobs.services.prepared import prepared_cursor
from conversion_jobs.states import (
    LEASED_STATES,
    NAMED_TRANSITIONS,
    TERMINAL_STATES,
    TRANSITIONS,
    State,
)
from conversion_jobs.webhooks.outbox import EVENT_OF_STATE, PUBLISH_MESSAGES, messages_enqueue

Fn = TypeVar("Fn", bound=Callable[..., Any])

#: (from, to) or (from, to, name) -> the function that makes that move.
EDGES: dict[tuple[Any, ...], Callable[..., Any]] = {}


def edge(source: State, target: State, name: str | None = None) -> Callable[[Fn], Fn]:
    """Bind a function to its edge of ``TRANSITIONS`` (or, with ``name``, of
    ``NAMED_TRANSITIONS``); at import: a stray edge fails loudly."""
    key: tuple[Any, ...] = (source, target) if name is None else (source, target, name)

    def bind(fn: Fn) -> Fn:
        if (source, target) not in TRANSITIONS:
            raise LookupError(f"{source} -> {target} is not an edge of states.TRANSITIONS")
        if name is not None and key not in NAMED_TRANSITIONS:
            raise LookupError(f"{key} is not an edge of states.NAMED_TRANSITIONS")
        if key in EDGES:
            raise LookupError(f"{key} already has {EDGES[key]}")
        EDGES[key] = fn
        fn.edge = key  # type: ignore[attr-defined]
        return fn

    return bind


def _postgres() -> bool:
    return connection.vendor == "postgresql"


def _move(guard: QuerySet[ConversionJob], source: State, target: State, **values: Any) -> int:
    """The guarded UPDATE of one edge: ``guard`` narrows the row, ``source`` is the state it must
    still be in. Returns the row count (1: this call moved it; 0: it lost)."""
    if (source, target) not in TRANSITIONS:
        raise LookupError(f"{source} -> {target} is not an edge of states.TRANSITIONS")
    return int(
        guard.filter(state=source).update(
            state=target,
            state_version=F("state_version") + 1,
            updated_at=Now(),
            **values,
        )
    )


def _fenced(lease: Lease) -> QuerySet[ConversionJob]:
    return ConversionJob.objects.filter(
        id=lease.job_id, generation=lease.generation, lease_token=lease.token
    )


# --- callers that choose: lock, then choose ----------------------------------------------------


@dataclass(frozen=True)
class Held:
    """The job row as a caller that may take one of several edges holds it, locked."""

    state: State
    generation: int
    lease_token: uuid.UUID | None
    #: attempts >= max_attempts: a RUNNING job whose lease is gone fails instead of running again
    exhausted: bool
    #: retention expired its source and result (an operator retry is refused)
    expired: bool
    traceparent: str

    def holds(self, lease: Lease) -> bool:
        """The job is still leased under ``lease`` (its generation and token)."""
        return (
            self.state in LEASED_STATES
            and self.generation == lease.generation
            and self.lease_token == lease.token
        )


class ChoiceLost(RuntimeError):
    """An edge chosen under the job row's lock matched no row: the choice and the edge's guard
    disagree. A defect, never a race (nobody else can move a locked row)."""


def job_lock_for_choice(*, job_id: uuid.UUID, tenant: str | None = None) -> Held | None:
    """Lock the job row and return the state a caller chooses its one edge from, the way
    procrastinate's ``procrastinate_cancel_job_v1`` and River's ``JobCancel`` do. The caller
    then calls that edge in the same transaction; its guard cannot lose, because nobody else
    moves the row before the commit (a competing edge waits on the lock and then matches zero
    rows). Postgres: ``SELECT … FOR UPDATE`` (it waits for a competing uncommitted move and
    returns the row as that move left it). SQLite (standalone): every transaction is ``BEGIN
    IMMEDIATE`` (``project/settings.py``), so the caller holds the database's one write lock
    from before this read. Must run inside ``transaction.atomic()``: the lock lasts until its
    commit. None: no such job (for ``tenant``; None means any tenant)."""
    if not connection.in_atomic_block:
        raise RuntimeError("job_lock_for_choice runs inside the caller's transaction.atomic()")
    row = (
        _tenant_job(job_id, tenant)
        .select_for_update()
        .values_list(
            "state",
            "generation",
            "lease_token",
            "attempts",
            "max_attempts",
            "expired_at",
            "traceparent",
        )
        .first()
    )
    if row is None:
        return None
    state, generation, token, attempts, max_attempts, expired_at, traceparent = row
    return Held(
        state=State(state),
        generation=generation,
        lease_token=token,
        exhausted=attempts >= max_attempts,
        expired=expired_at is not None,
        traceparent=traceparent,
    )


def chosen(won: object) -> None:
    """The row count of an edge chosen under ``job_lock_for_choice``: it must have won."""
    if won is None or won is False or won == 0:
        raise ChoiceLost("an edge chosen under the job row's lock matched no row")


# --- the hooks every edge out of a leased state / into a terminal state runs -----------------


def _lease_ends(lease: Lease, *, outcome: AttemptOutcome, error_code: str | None) -> None:
    """The lease row goes, the attempt closes (its page count computed, its duration observed
    after commit). Runs inside the transaction that moved the job."""
    WorkerLease.objects.filter(job_id=lease.job_id, token=lease.token).delete()
    attempt_close(lease=lease, outcome=outcome, error_code=error_code)


def attempt_close(*, lease: Lease, outcome: AttemptOutcome, error_code: str | None) -> bool:
    """Close the attempt if it is still open (bookkeeping on the attempt row only)."""
    if lease.attempt_id is None:  # the repair sweep's lease of a job with no attempt row
        return False
    closed = ConversionAttempt.objects.filter(id=lease.attempt_id, finished_at__isnull=True).update(
        outcome=outcome,
        error_code=error_code,
        finished_at=Now(),
        pages_converted=Coalesce(
            pages_converted_by(job_id=lease.job_id, generation=lease.generation), 0
        ),
    )
    if closed:
        _observe_attempt(lease, outcome)
    return bool(closed)


def _observe_attempt(lease: Lease, outcome: str) -> None:
    started = lease.started_at
    if started is not None:
        transaction.on_commit(
            lambda: metrics.ATTEMPT_DURATION.labels(outcome=outcome).observe(
                (timezone.now() - started).total_seconds()
            )
        )


def _terminal(
    *,
    job_id: uuid.UUID,
    generation: int,
    state: State,
    lease: Lease | None,
    outcome: AttemptOutcome | None,
    error_code: str | None,
    event_type: str,
    details: dict[str, Any],
    actor: str = SYSTEM_ACTOR,
) -> None:
    """The terminal hook: lease ended and attempt closed (if the job held one), pending
    cancellation requests resolved (cancelled: with their latency; anything else: lost to
    completion), the audit event, the webhook messages of the endpoints subscribed now
    (``webhooks/outbox.py``), the terminal metric after commit. Runs inside the
    transaction whose guarded UPDATE won. (``_PUBLISH_SQL`` is this hook in SQL.)"""
    if state not in TERMINAL_STATES:
        raise ValueError(f"{state} is not terminal")
    if lease is not None and outcome is not None:
        _lease_ends(lease, outcome=outcome, error_code=error_code)
    _cancellations_resolve(job_id=job_id, cancelled=state == State.CANCELLED)
    audit_event_append(
        job_id=job_id,
        event_type=event_type,
        generation=generation,
        attempt_id=lease.attempt_id if lease else None,
        actor=actor,
        details=details,
    )
    messages_enqueue(job_id=job_id, state=state)
    transaction.on_commit(lambda: metrics.TERMINAL.labels(state=state.value).inc())


def _cancellations_resolve(*, job_id: uuid.UUID, cancelled: bool) -> None:
    pending = CancellationRequest.objects.filter(job_id=job_id, resolved_at__isnull=True)
    if not cancelled:
        pending.update(outcome=CancellationOutcome.LOST_TO_COMPLETION, resolved_at=Now())
        return
    now = timezone.now()
    requested = pending.values_list("requested_at", flat=True)
    latencies = [(now - at).total_seconds() for at in requested]
    if pending.update(resolved_at=now, outcome=CancellationOutcome.CANCELLED):

        def observe() -> None:
            for seconds in latencies:
                metrics.CANCELLATION_LATENCY.observe(seconds)

        transaction.on_commit(observe)


def _redispatch(*, job_id: uuid.UUID, generation: int, traceparent: str, reason: str) -> None:
    """A new generation needs a message: its outbox row, and the fast path after commit."""
    outbox = ConversionOutbox.objects.create(
        job_id=job_id, generation=generation, traceparent=traceparent
    )
    outbox_publish_after_commit(
        outbox_id=outbox.id, job_id=job_id, generation=generation, traceparent=traceparent
    )
    transaction.on_commit(lambda: metrics.REDISPATCHES.labels(reason=reason).inc())


# --- (none) -> queued: acceptance --------------------------------------------------------------


@dataclass(frozen=True)
class NewJob:
    job: ConversionJob
    actor: str
    idempotency_key: str | None
    fingerprint: str
    details: dict[str, Any]
    #: the source's bytes when it is stored inline (``inline_source``), else None
    inline_content: bytes | None = None
    #: ``converters.engine_version`` of the source's type: a quarantined document is refused
    engine_version: str = ""


def job_insert_queued(new: NewJob) -> bool:
    """(none) -> QUEUED, generation 1: the job, its outbox row, its idempotency record (when a
    key was sent), its inline source (when it has one) and its first audit event. On Postgres
    one statement (``_ACCEPT_SQL``), which the caller runs inside its transaction or, when it
    is the whole acceptance, alone in autocommit. A unique violation (a concurrent identical job
    or key) propagates: everything the statement (or the caller's transaction) wrote rolls back
    and the caller answers from the winner — except that an inline job on Postgres that meets
    a job with its content identity writes nothing and returns False (``ON CONFLICT DO
    NOTHING``: the acceptance runs no pre-check read for it, so the conflict is its common
    duplicate case, answered without an error) - and that any job whose document the tenant
    has quarantined (``services/quarantine.py``) writes nothing and returns False. True:
    inserted; registers the fast-path publish for after commit."""
    job = new.job
    first_event = _first_event(new)
    if _postgres():
        sql, params = _accept_statement(new, first_event)
        with prepared_cursor() as cursor:  # prepared: parsed and planned once per connection
            cursor.execute(sql, params)
            row = cursor.fetchone()
        if row is None:  # the inline statement met the content identity of another job
            return False
        outbox_id = row[0]
    else:
        job.save(force_insert=True)
        if new.inline_content is not None:
            InlineSource.objects.create(job=job, content=new.inline_content)
        outbox_id = ConversionOutbox.objects.create(
            job=job, generation=1, traceparent=job.traceparent
        ).id
        if new.idempotency_key is not None:
            IdempotencyRecord.objects.create(
                tenant=job.tenant, key=new.idempotency_key, fingerprint=new.fingerprint, job=job
            )
        ExecutionAuditEvent.objects.create(**first_event, prev_hash=GENESIS, hash=job.audit_head)
    outbox_publish_after_commit(
        outbox_id=outbox_id, job_id=job.id, generation=1, traceparent=job.traceparent
    )
    return True


def _first_event(new: NewJob) -> dict[str, Any]:
    """The job's timestamps and audit head set, and its first audit event (``accepted``)."""
    job = new.job
    now = timezone.now()
    job.created_at = job.updated_at = now
    job.audit_seq = 1
    first_event: dict[str, Any] = {
        "job_id": job.id,
        "seq": 1,
        "event_type": "accepted",
        "generation": 1,
        "attempt_id": None,
        "actor": new.actor,
        "details": new.details,
        "created_at": now,
    }
    job.audit_head = event_hash(prev_hash=GENESIS, **first_event)
    return first_event


def _accept_statement(new: NewJob, first_event: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """``_ACCEPT_SQL`` (inline form or not) and its parameters: one text for both drivers."""
    params = job_insert_params(new.job)
    params.update(
        now=first_event["created_at"],
        actor=new.actor,
        key=new.idempotency_key,
        fingerprint=new.fingerprint,
        details=canonical_json(new.details),
        genesis=GENESIS,
        q_engine=new.engine_version,
    )
    inline = new.inline_content is not None
    if inline:
        params["inline"] = new.inline_content
    return _accept_sql(inline), params


def job_insert_params(job: ConversionJob) -> dict[str, Any]:
    """The job row's insert parameters (``j_<column>``), as ``Field.get_db_prep_save`` makes
    them: a value its field would hand the driver unchanged (a ``str`` for a text column, a
    ``bool``, a ``UUID``, an aware ``datetime``, ``None``) is taken as it is, an ``int`` is
    wrapped in the column's psycopg integer type as Django does (``adapt_integerfield_value``);
    any other value (the JSON options, a lazy string, an expression) goes through its field.
    Forty ``get_db_prep_save`` calls were ≈ 4 % of an acceptance's web CPU (ADR 0017, session
    6, branch ``accept2``); ``tests/unit/test_job_insert_params.py`` holds the two equal."""
    params: dict[str, Any] = {}
    for name, attname, plain, wrap, field in _insert_fields():
        value = getattr(job, attname)
        if plain is None:
            params[name] = field.get_db_prep_save(value, connection)
        elif value is None:
            params[name] = None
        elif wrap is not None and type(value) is int:
            params[name] = wrap(value)
        elif wrap is None and isinstance(value, plain) and getattr(value, "tzinfo", 0) is not None:
            params[name] = value
        else:
            params[name] = field.get_db_prep_save(value, connection)
    return params


@functools.cache
def _insert_fields() -> tuple[tuple[str, str, type | None, Any, Any], ...]:
    """Per column: its parameter's name, the attribute, the Python type its field passes
    through (None: every value goes through the field), the integer wrapper."""
    plain: dict[type, type] = {
        models.CharField: str,
        models.TextField: str,
        models.UUIDField: uuid.UUID,
        models.BooleanField: bool,
        models.DateTimeField: datetime,
        models.IntegerField: int,
        models.PositiveIntegerField: int,
        models.BigIntegerField: int,
    }
    integer = getattr(connection.ops, "integerfield_type_map", {})
    fields = []
    for f in ConversionJob._meta.concrete_fields:
        kind = plain.get(type(f))
        wrap = integer.get(f.get_internal_type()) if kind is int else None
        if kind is int and wrap is None:  # no wrapper known here: let the field decide
            kind = None
        fields.append((f"j_{f.column}", f.attname, kind, wrap, f))
    return tuple(fields)


@functools.cache
def _accept_sql(inline: bool) -> str:
    fields = ConversionJob._meta.concrete_fields
    return _ACCEPT_SQL.format(
        columns=", ".join(str(f.column) for f in fields),
        # typed as their columns (without a length: too long is an error, not a truncation):
        # a SELECT list does not take its parameters' types from the INSERT's columns
        values=", ".join(
            f"%(j_{f.column})s::{re.sub(r'[(].*[)]', '', str(f.db_type(connection)))}"
            for f in fields
        ),
        conflict=" ON CONFLICT DO NOTHING" if inline else "",
        inline=_ACCEPT_INLINE if inline else "",
    )


#: (none) -> queued in one round trip: the job row, then what hangs off it. A document this
#: tenant has quarantined under the engine version (services/quarantine.py) inserts nothing and
#: returns no row (one probe of ``quarantine_key``; the caller tells why). A unique violation
#: (content identity, idempotency key) aborts the whole statement. The inline form (``{conflict}``
#: and ``{inline}`` filled in) also writes the source's bytes, and a content-identity conflict
#: of the job row writes nothing and returns no row: every other part selects from ``job``.
#: (Postgres waits for an uncommitted conflicting row's transaction first, so "no row" means a
#: committed job holds the identity.) The key's own conflict still aborts the statement.
_ACCEPT_SQL = """
WITH job AS (
    INSERT INTO conversion_job ({columns})
    SELECT {values}
    WHERE NOT EXISTS (
        SELECT 1 FROM document_quarantine
        WHERE tenant = %(j_tenant)s AND source_sha256 = %(j_source_sha256)s
          AND engine_version = %(q_engine)s AND quarantined_at IS NOT NULL
    ){conflict}
    RETURNING id, traceparent, audit_head
){inline}, outbox AS (
    INSERT INTO conversion_outbox (job_id, generation, traceparent, created_at, publish_attempts)
    SELECT id, 1, traceparent, %(now)s, 0 FROM job RETURNING id
), idempotency AS (
    INSERT INTO idempotency_record (tenant, key, fingerprint, job_id, created_at)
    SELECT %(j_tenant)s, %(key)s::text, %(fingerprint)s, id, %(now)s FROM job
    WHERE %(key)s::text IS NOT NULL
), audit AS (
    INSERT INTO execution_audit_event
        (job_id, seq, event_type, generation, attempt_id, actor, details, created_at,
         prev_hash, hash)
    SELECT id, 1, 'accepted', 1, NULL, %(actor)s, %(details)s::jsonb, %(now)s, %(genesis)s,
           audit_head
    FROM job
)
SELECT id FROM outbox
"""

_ACCEPT_INLINE = """, inline AS (
    INSERT INTO inline_source (job_id, content) SELECT id, %(inline)s FROM job
)"""


# --- queued -> running: the claim --------------------------------------------------------------


@dataclass(frozen=True)
class Claim:
    """A won claim: the lease and the job row as the claim left it."""

    lease: Lease
    job: ConversionJob
    #: the source's bytes when the job's source is inline (read by the claim itself), else None
    source: bytes | None = None


@edge(State.QUEUED, State.RUNNING)
def claim(*, job_id: uuid.UUID, generation: int, worker: str) -> Claim | None:
    """QUEUED -> RUNNING for this generation: attempts + 1, the attempt, the lease, the audit
    event. None: a duplicate or stale delivery (counted; the caller acks it)."""
    token = uuid.uuid4()
    now = timezone.now()
    expires = now + lease_ttl()
    worker = worker[:128]
    claim = _claim_postgres if _postgres() else _claim_orm
    won = claim(
        job_id=job_id, generation=generation, worker=worker, token=token, now=now, expires=expires
    )
    if won is None:
        current = (
            ConversionJob.objects.filter(id=job_id).values_list("generation", flat=True).first()
        )
        reason = "stale" if current is not None and current > generation else "duplicate"
        metrics.DUPLICATE_DELIVERIES.labels(reason=reason).inc()
        return None
    job, attempt_id, source = won
    metrics.CLAIMS.inc()
    lease = Lease(job_id, generation, token, attempt_id, job.attempts, now)
    return Claim(lease, job, source)


#: queued -> running in one round trip. ``locked`` takes the row lock with the guard (after a
#: wait it sees the newest row, so a claim that lost the race matches nothing and writes nothing);
#: the attempt id is drawn first so the audit hash can cover it. An inline source's bytes come
#: back with the row (the join finds nothing for a stored one): no second read for them.
_CLAIM_SQL = """
WITH locked AS (
    SELECT id, attempts, audit_seq, audit_head FROM conversion_job
    WHERE id = %(job)s AND state = 'queued' AND generation = %(generation)s
    FOR UPDATE
), att AS (
    SELECT nextval(pg_get_serial_sequence('conversion_attempt', 'id')) AS id FROM locked
), moved AS (
    UPDATE conversion_job j SET
        state = 'running', attempts = l.attempts + 1, lease_token = %(token)s,
        state_version = j.state_version + 1, updated_at = %(now)s,
        audit_seq = l.audit_seq + 1, audit_head = {hash}
    FROM locked l, att
    WHERE j.id = l.id
    RETURNING {columns}, att.id AS attempt_id, l.audit_head AS audit_prev
), attempt AS (
    INSERT INTO conversion_attempt
        (id, job_id, generation, number, worker, started_at, heartbeat_at, pages_converted)
    SELECT attempt_id, id, %(generation)s, attempts, %(worker)s, %(now)s, %(now)s, 0 FROM moved
), lease AS (
    INSERT INTO worker_lease (job_id, generation, attempt_id, token, expires_at)
    SELECT id, %(generation)s, attempt_id, %(token)s, %(expires)s FROM moved
    ON CONFLICT (job_id) DO UPDATE SET generation = EXCLUDED.generation,
        attempt_id = EXCLUDED.attempt_id, token = EXCLUDED.token, expires_at = EXCLUDED.expires_at
), audit AS (
    INSERT INTO execution_audit_event
        (job_id, seq, event_type, generation, attempt_id, actor, details, created_at,
         prev_hash, hash)
    SELECT id, audit_seq, 'claimed', %(generation)s, attempt_id, 'system', ({details})::jsonb,
           %(now)s, audit_prev, audit_head
    FROM moved
)
SELECT moved.*, s.content AS inline_source
FROM moved LEFT JOIN inline_source s ON s.job_id = moved.id{commit}
"""

#: The claim's own commit does not wait for its WAL flush (``QUIRE_CLAIM_ASYNC_COMMIT``; ADR
#: 0017 session 5). Durability comes with the attempt's next synchronous commit (heartbeat,
#: checkpoint batch, publish, failure), which flushes the WAL up to and including the claim. A
#: claim lost with a Postgres crash before that flush loses nothing: the job is ``queued`` in
#: its claimed generation again, every fenced write of the attempt matches nothing, and the
#: dispatch-timeout sweep sends it again. ``set_config(..., true)`` is local to the statement's
#: own (autocommit) transaction and runs only when ``moved`` has a row.
_CLAIM_ASYNC_COMMIT = " WHERE set_config('synchronous_commit', 'off', true) IS NOT NULL"


def _claim_postgres(
    *,
    job_id: uuid.UUID,
    generation: int,
    worker: str,
    token: uuid.UUID,
    now: datetime,
    expires: datetime,
) -> tuple[ConversionJob, int, bytes | None] | None:
    params: dict[str, Any] = {
        "job": job_id,
        "generation": generation,
        "token": token,
        "now": now,
        "expires": expires,
        "worker": worker,
    }
    details = canonical_json({"attempt": slot("attempt_number")})
    exprs = {"attempt": "att.id", "attempt_number": "l.attempts + 1"}
    sql = _CLAIM_SQL.format(
        columns=_job_columns(),
        commit=_CLAIM_ASYNC_COMMIT if settings.QUIRE["CLAIM_ASYNC_COMMIT"] else "",
        hash=chain_sql(
            prev="l.audit_head",
            seq="l.audit_seq + 1",
            body=event_body(
                job_id=job_id,
                event_type="claimed",
                generation=generation,
                attempt_id=slot("attempt"),
                actor=SYSTEM_ACTOR,
                details={"attempt": slot("attempt_number")},
                created_at=now,
            ),
            params=params,
            exprs=exprs,
        ),
        details=spliced_sql(details, exprs={"attempt_number": "attempts"}, params=params),
    )
    with prepared_cursor() as cursor:
        cursor.execute(sql, params)
        row = cursor.fetchone()
    if row is None:
        return None
    job, attempt_id = _job_from_row(_claim_names(), row)
    source = row[-1]
    return job, attempt_id, None if source is None else bytes(source)


@functools.cache
def _job_columns() -> str:
    """The job's columns the claim returns, named (not ``j.*``): a column added by a later
    migration changes neither the statement's result nor a connection's prepared plan of it."""
    return ", ".join(
        f"j.{connection.ops.quote_name(f.column or '')}"
        for f in ConversionJob._meta.concrete_fields
    )


@functools.cache
def _claim_names() -> tuple[str, ...]:
    """The names of the claim's result columns, in order (``_job_columns`` and two more): known
    without asking the cursor for its description."""
    return (
        *(f.column or "" for f in ConversionJob._meta.concrete_fields),
        "attempt_id",
        "audit_prev",
        "inline_source",
    )


#: per column list: (attnames, their positions, converters, position of attempt_id)
_ROW_PLANS: dict[tuple[str, ...], tuple[list[str], list[int], dict[int, Any], int]] = {}


def _job_from_row(names: tuple[str, ...], row: tuple[Any, ...]) -> tuple[ConversionJob, int]:
    """The claimed job as ``ConversionJob.objects.raw`` would build it (the fields' database
    converters applied), without its per-query column mapping: the plan is computed once."""
    plan = _ROW_PLANS.get(names)
    if plan is None:
        position = {name: i for i, name in enumerate(names)}
        fields = [f for f in ConversionJob._meta.concrete_fields if (f.column or "") in position]
        compiler = ConversionJob.objects.all().query.get_compiler(using=connection.alias)
        cols = [f.get_col(ConversionJob._meta.db_table) for f in fields]
        plan = (
            [f.attname for f in fields],
            [position[f.column or ""] for f in fields],
            compiler.get_converters(cols),
            position["attempt_id"],
        )
        _ROW_PLANS[names] = plan
    attnames, positions, converters, attempt_at = plan
    values = [row[i] for i in positions]
    for index, (functions, expression) in converters.items():  # as SQLCompiler.apply_converters
        value = values[index]
        for function in functions:
            value = function(value, expression, connection)
        values[index] = value
    job = ConversionJob.from_db(connection.alias, attnames, values)
    return job, int(row[attempt_at])


def _claim_orm(
    *,
    job_id: uuid.UUID,
    generation: int,
    worker: str,
    token: uuid.UUID,
    now: datetime,
    expires: datetime,
) -> tuple[ConversionJob, int, bytes | None] | None:
    with transaction.atomic():
        won = _move(
            ConversionJob.objects.filter(id=job_id, generation=generation),
            State.QUEUED,
            State.RUNNING,
            attempts=F("attempts") + 1,
            lease_token=token,
        )
        if not won:
            return None
        job = ConversionJob.objects.get(id=job_id)
        attempt = ConversionAttempt.objects.create(
            job_id=job_id,
            generation=generation,
            number=job.attempts,
            worker=worker,
            heartbeat_at=now,
        )
        WorkerLease.objects.update_or_create(
            job_id=job_id,
            defaults={
                "generation": generation,
                "attempt": attempt,
                "token": token,
                "expires_at": expires,
            },
        )
        audit_event_append(
            job_id=job_id,
            event_type="claimed",
            generation=generation,
            attempt_id=attempt.id,
            details={"attempt": job.attempts},
        )
        source = (
            InlineSource.objects.filter(job_id=job_id).values_list("content", flat=True).first()
            if storage.is_inline_source(job.source_key)
            else None
        )
    return job, attempt.id, None if source is None else bytes(source)


# --- running -> succeeded | partial: the publish -------------------------------------------------


@dataclass(frozen=True)
class Result:
    key: str
    sha256: str
    size: int
    media_type: str
    pages_done: int
    pages_failed: int
    #: the document's page count when the attempt has not recorded it yet (a one-page job
    #: records it with its publish instead of one more fenced UPDATE); None: leave it
    page_count: int | None = None


@edge(State.RUNNING, State.SUCCEEDED)
def publish_succeeded(
    *, lease: Lease, result: Result, checkpoints: list[PageCheckpoint] | None = None
) -> bool:
    """RUNNING -> SUCCEEDED, fenced, with the attempt's last page ``checkpoints``. False: the
    lease was lost or the job was cancelled first; nothing is written."""
    return _publish(lease, State.SUCCEEDED, result, checkpoints or [])


@edge(State.RUNNING, State.PARTIAL)
def publish_partial(
    *, lease: Lease, result: Result, checkpoints: list[PageCheckpoint] | None = None
) -> bool:
    """RUNNING -> PARTIAL (some pages failed permanently), as ``publish_succeeded``."""
    return _publish(lease, State.PARTIAL, result, checkpoints or [])


def _publish(lease: Lease, state: State, result: Result, checkpoints: list[PageCheckpoint]) -> bool:
    details = {
        "state": state.value,
        "pages_done": result.pages_done,
        "pages_failed": result.pages_failed,
        "result_sha256": result.sha256,
        "result_size": result.size,
    }
    values = {
        "result_key": result.key,
        "result_sha256": result.sha256,
        "result_size": result.size,
        "result_media_type": result.media_type,
    }
    if result.page_count is not None:
        values["source_page_count"] = result.page_count
    if _postgres() and all(c.state == PageState.DONE for c in checkpoints):
        won = _publish_postgres(lease, state, values, details, checkpoints)
    else:
        with transaction.atomic():
            won = _leave_lease(
                lease,
                State.RUNNING,
                state,
                values={**values, "finished_at": Now()},
                checkpoints=checkpoints,
                outcome=AttemptOutcome.SUCCEEDED,
                error_code=None,
                event_type="published",
                details=details,
            )
    if won:
        for checkpoint in checkpoints:
            metrics.PAGES.labels(outcome=checkpoint.state).inc()
    return won


#: running -> succeeded | partial in one round trip, with the terminal hook in SQL: the job
#: (fenced on generation, token and state, under its row lock), its last page checkpoints, the
#: lease ended, the attempt closed, pending cancellation requests lost to completion, the audit
#: event, the webhook messages of the subscribed endpoints (``webhooks/outbox.py``). Zero rows
#: from ``moved``: the publish lost and every other part wrote nothing.
_PUBLISH_SQL = """
WITH locked AS (
    SELECT id, audit_seq, audit_head FROM conversion_job
    WHERE id = %(job)s AND generation = %(generation)s AND lease_token = %(token)s
      AND state = 'running'
    FOR UPDATE
), moved AS (
    UPDATE conversion_job j SET
        state = %(state)s, result_key = %(result_key)s, result_sha256 = %(result_sha256)s,
        result_size = %(result_size)s, result_media_type = %(result_media_type)s,
        finished_at = now(), pages_done = j.pages_done + %(n_done)s, lease_token = NULL,
        source_page_count = COALESCE(%(source_page_count)s, j.source_page_count),
        state_version = j.state_version + 1, updated_at = now(),
        audit_seq = l.audit_seq + 1, audit_head = {hash}
    FROM locked l WHERE j.id = l.id
    RETURNING j.id, j.tenant, j.audit_seq, j.audit_head, l.audit_head AS audit_prev
), pages AS ({upsert_done_pages}), hooks AS ({publish_messages}), lease_end AS (
    DELETE FROM worker_lease
    WHERE job_id = %(job)s AND token = %(token)s AND EXISTS (SELECT 1 FROM moved)
), attempt AS (
    UPDATE conversion_attempt SET
        outcome = 'succeeded', error_code = NULL, finished_at = now(),
        pages_converted = cardinality(%(p_number)b::int[]) + (
            SELECT count(*) FROM page_checkpoint c
            WHERE c.job_id = %(job)s AND c.generation = %(generation)s AND c.state = 'done'
              AND NOT (c.page_number = ANY(%(p_number)b::int[])))
    WHERE id = %(attempt)s AND finished_at IS NULL AND EXISTS (SELECT 1 FROM moved)
    RETURNING id
), cancels AS (
    UPDATE cancellation_request SET outcome = 'lost_to_completion', resolved_at = now()
    WHERE job_id = %(job)s AND resolved_at IS NULL AND EXISTS (SELECT 1 FROM moved)
), audit AS (
    INSERT INTO execution_audit_event
        (job_id, seq, event_type, generation, attempt_id, actor, details, created_at,
         prev_hash, hash)
    SELECT id, audit_seq, 'published', %(generation)s, %(attempt)s, 'system', %(details)s::jsonb,
           %(at)s, audit_prev, audit_head
    FROM moved
)
SELECT (SELECT count(*) FROM moved), (SELECT count(*) FROM attempt)
""".replace("{upsert_done_pages}", UPSERT_DONE_PAGES).replace(
    "{publish_messages}", PUBLISH_MESSAGES
)


def _publish_postgres(
    lease: Lease,
    state: State,
    values: dict[str, Any],
    details: dict[str, Any],
    checkpoints: list[PageCheckpoint],
) -> bool:
    at = timezone.now()
    params: dict[str, Any] = {
        "job": lease.job_id,
        "generation": lease.generation,
        "token": lease.token,
        "attempt": lease.attempt_id,
        "state": state.value,
        "event": EVENT_OF_STATE[state].value,
        "n_done": len(checkpoints),
        "details": canonical_json(details),
        "at": at,
        **done_pages_params(checkpoints),
        "source_page_count": None,
        **values,
    }
    sql = _PUBLISH_SQL.format(
        hash=chain_sql(
            prev="l.audit_head",
            seq="l.audit_seq + 1",
            body=event_body(
                job_id=lease.job_id,
                event_type="published",
                generation=lease.generation,
                attempt_id=lease.attempt_id,
                actor=SYSTEM_ACTOR,
                details=details,
                created_at=at,
            ),
            params=params,
        )
    )
    with prepared_cursor() as cursor:
        cursor.execute(sql, params)
        moved, closed = cursor.fetchone()
    if not moved:
        return False
    # One callback after commit for both metrics (each ``on_commit`` registration costs
    # ≈ 1 % of a pool process's Python time per one-page job: ADR 0017, session 10).
    started = lease.started_at if closed else None

    def observe() -> None:
        if started is not None:
            metrics.ATTEMPT_DURATION.labels(outcome=AttemptOutcome.SUCCEEDED).observe(
                (timezone.now() - started).total_seconds()
            )
        metrics.TERMINAL.labels(state=state.value).inc()

    transaction.on_commit(observe)
    return True


# --- the other edges out of running / cancelling ------------------------------------------------


def _leave_lease(
    lease: Lease,
    source: State,
    target: State,
    *,
    values: dict[str, Any],
    outcome: AttemptOutcome,
    error_code: str | None,
    event_type: str,
    details: dict[str, Any],
    guard: Q | None = None,
    checkpoints: list[PageCheckpoint] | None = None,
) -> bool:
    """One fenced move out of a leased state with its bookkeeping; the caller holds the
    transaction. The terminal hook for terminal targets, the lease end and the audit event for
    the others. False: lost, nothing written."""
    fence = _fenced(lease)
    if guard is not None:
        fence = fence.filter(guard)
    if not _move(
        fence, source, target, lease_token=None, **values, **page_counters(checkpoints or [])
    ):
        return False
    if checkpoints:
        checkpoints_upsert(lease, checkpoints)
    if target in TERMINAL_STATES:
        _terminal(
            job_id=lease.job_id,
            generation=lease.generation,
            state=target,
            lease=lease,
            outcome=outcome,
            error_code=error_code,
            event_type=event_type,
            details=details,
        )
        return True
    _lease_ends(lease, outcome=outcome, error_code=error_code)
    audit_event_append(
        job_id=lease.job_id,
        event_type=event_type,
        generation=lease.generation,
        attempt_id=lease.attempt_id,
        details=details,
    )
    return True


_EXHAUSTED = Q(attempts__gte=F("max_attempts"))


@edge(State.RUNNING, State.FAILED)
def fail(
    *,
    lease: Lease,
    code: str,
    detail: str = "",
    retryable: bool = False,
    outcome: AttemptOutcome = AttemptOutcome.TERMINAL_ERROR,
    attempt_error: str | None = None,
    event_type: str = "failed",
    details: dict[str, Any] | None = None,
    only_if_exhausted: bool = False,
) -> bool:
    """RUNNING -> FAILED, fenced: a terminal error (``code``), or with ``only_if_exhausted`` the
    dead letter (``attempts_exhausted``, guarded on attempts >= max_attempts: the worker's
    retryable error and the lease sweep both try it first). False: lost."""
    with transaction.atomic():
        return _leave_lease(
            lease,
            State.RUNNING,
            State.FAILED,
            values={
                "error_code": code,
                "error_retryable": retryable,
                "error_detail": detail[:256],
                "finished_at": Now(),
            },
            guard=_EXHAUSTED if only_if_exhausted else None,
            outcome=outcome,
            error_code=attempt_error if attempt_error is not None else code,
            event_type=event_type,
            details=details if details is not None else {"code": code},
        )


@edge(State.RUNNING, State.RETRY_WAIT)
def retry_later(*, lease: Lease, code: str, delay: timedelta) -> bool:
    """RUNNING -> RETRY_WAIT with ``next_attempt_at`` = now + ``delay`` (a Postgres timestamp),
    fenced and guarded on attempts < max_attempts. False: lost (or the budget is spent)."""
    with transaction.atomic():
        won = _leave_lease(
            lease,
            State.RUNNING,
            State.RETRY_WAIT,
            values={"next_attempt_at": Now() + delay, "error_code": code, "error_retryable": True},
            guard=~_EXHAUSTED,
            outcome=AttemptOutcome.RETRYABLE_ERROR,
            error_code=code,
            event_type="retry_scheduled",
            details={"code": code, "attempt": lease.attempt_number},
        )
    if won:
        transaction.on_commit(lambda: metrics.RETRY_DELAY.observe(delay.total_seconds()))
    return won


@edge(State.RUNNING, State.QUEUED)
def requeue_lost_lease(*, lease: Lease, traceparent: str) -> bool:
    """RUNNING -> QUEUED (generation + 1, new outbox row) for an expired lease with attempts
    left (guarded on attempts < max_attempts); the attempt's outcome is ``lease_lost``."""
    with transaction.atomic():
        if not _move(
            _fenced(lease).filter(~_EXHAUSTED),
            State.RUNNING,
            State.QUEUED,
            generation=F("generation") + 1,
            queued_at=Now(),
            error_code="lease_lost",
            error_retryable=True,
            lease_token=None,
        ):
            return False
        _lease_ends(lease, outcome=AttemptOutcome.LEASE_LOST, error_code="lease_lost")
        _redispatch(
            job_id=lease.job_id,
            generation=lease.generation + 1,
            traceparent=traceparent,
            reason="lease_expired",
        )
        audit_event_append(
            job_id=lease.job_id,
            event_type="lease_expired",
            generation=lease.generation,
            attempt_id=lease.attempt_id,
            details={"result": "requeued"},
        )
    return True


@edge(State.RUNNING, State.QUEUED, name="yield")
def yield_slice(*, lease: Lease, traceparent: str, cost: int) -> bool:
    """RUNNING -> QUEUED "yielded" (generation + 1, new outbox row of ``cost`` page units): the
    attempt used its fair-share slice while another tenant waits with no free slot
    (docs/ARCHITECTURE.md §2b). Not a failure and not an attempt: ``attempts`` goes back down,
    the attempt closes ``yielded``; the job resumes from its checkpoints when the fair order
    sends it again. Fenced like every worker write. False: lost, nothing written."""
    with transaction.atomic():
        if not _move(
            _fenced(lease),
            State.RUNNING,
            State.QUEUED,
            generation=F("generation") + 1,
            attempts=F("attempts") - 1,
            queued_at=Now(),
            lease_token=None,
            dispatch_cost=max(1, cost),
        ):
            return False
        _lease_ends(lease, outcome=AttemptOutcome.YIELDED, error_code=None)
        _redispatch(
            job_id=lease.job_id,
            generation=lease.generation + 1,
            traceparent=traceparent,
            reason="yielded",
        )
        audit_event_append(
            job_id=lease.job_id,
            event_type="yielded",
            generation=lease.generation,
            attempt_id=lease.attempt_id,
            details={"attempt": lease.attempt_number, "cost": max(1, cost)},
        )
        transaction.on_commit(metrics.FAIR_YIELDS.inc)
    return True


@edge(State.CANCELLING, State.CANCELLED)
def finish_cancel(*, lease: Lease, by_sweep: bool = False) -> bool:
    """CANCELLING -> CANCELLED, fenced: by the worker that holds the lease (at a page boundary
    or heartbeat), or by the lease sweep when that lease expired. False: lost."""
    with transaction.atomic():
        return _leave_lease(
            lease,
            State.CANCELLING,
            State.CANCELLED,
            values={"finished_at": Now()},
            outcome=AttemptOutcome.LEASE_LOST if by_sweep else AttemptOutcome.CANCELLED,
            error_code="lease_lost" if by_sweep else None,
            event_type="lease_expired" if by_sweep else "cancelled",
            details={"result": "cancelled"} if by_sweep else {"by": "worker"},
        )


# --- cancel API --------------------------------------------------------------------------------


def _tenant_job(job_id: uuid.UUID, tenant: str | None) -> QuerySet[ConversionJob]:
    jobs = ConversionJob.objects.filter(id=job_id)
    return jobs if tenant is None else jobs.filter(tenant=tenant)


def _move_returning_generation(
    guard: QuerySet[ConversionJob], source: State, target: State, **values: Any
) -> int | None:
    """``_move`` that also says which generation it moved (read under the lock it took)."""
    if not _move(guard, source, target, **values):
        return None
    return int(guard.values_list("generation", flat=True).get())


def _cancel_immediately(job_id: uuid.UUID, tenant: str, actor: str, source: State) -> int | None:
    with transaction.atomic():
        generation = _move_returning_generation(
            _tenant_job(job_id, tenant),
            source,
            State.CANCELLED,
            next_attempt_at=None,
            finished_at=Now(),
        )
        if generation is None:
            return None
        _terminal(
            job_id=job_id,
            generation=generation,
            state=State.CANCELLED,
            lease=None,
            outcome=None,
            error_code=None,
            event_type="cancelled",
            details={"by": "api", "state_seen": source.value},
            actor=actor,
        )
    return generation


@edge(State.QUEUED, State.CANCELLED)
def cancel_queued(*, job_id: uuid.UUID, tenant: str, actor: str) -> int | None:
    """QUEUED -> CANCELLED (its message, when it comes, is a stale delivery). Returns the
    generation it cancelled, or None (not queued)."""
    return _cancel_immediately(job_id, tenant, actor, State.QUEUED)


@edge(State.RETRY_WAIT, State.CANCELLED)
def cancel_retry_wait(*, job_id: uuid.UUID, tenant: str, actor: str) -> int | None:
    """RETRY_WAIT -> CANCELLED (the timer is cleared). Generation or None."""
    return _cancel_immediately(job_id, tenant, actor, State.RETRY_WAIT)


@edge(State.RUNNING, State.CANCELLING)
def cancel_running(*, job_id: uuid.UUID, tenant: str, actor: str) -> int | None:
    """RUNNING -> CANCELLING: the lease holder stops at its next page or heartbeat (or the
    lease sweep ends it). Generation or None."""
    with transaction.atomic():
        generation = _move_returning_generation(
            _tenant_job(job_id, tenant), State.RUNNING, State.CANCELLING
        )
        if generation is not None:
            audit_event_append(
                job_id=job_id,
                event_type="cancelling",
                generation=generation,
                actor=actor,
                details={"state_seen": State.RUNNING.value},
            )
    return generation


# --- beat: a due retry timer -----------------------------------------------------------------


@edge(State.RETRY_WAIT, State.QUEUED)
def requeue_due_retry(*, job_id: uuid.UUID, generation: int, traceparent: str) -> bool:
    """RETRY_WAIT whose timer has passed -> QUEUED, generation + 1, new outbox row."""
    with transaction.atomic():
        if not _move(
            ConversionJob.objects.filter(
                id=job_id, generation=generation, next_attempt_at__lte=Now()
            ),
            State.RETRY_WAIT,
            State.QUEUED,
            generation=F("generation") + 1,
            next_attempt_at=None,
            queued_at=Now(),
        ):
            return False
        _redispatch(
            job_id=job_id, generation=generation + 1, traceparent=traceparent, reason="retry_due"
        )
        audit_event_append(job_id=job_id, event_type="retry_dispatched", generation=generation + 1)
    return True


# --- operator retry ----------------------------------------------------------------------------


def _operator_retry(job_id: uuid.UUID, tenant: str | None, actor: str, source: State) -> int | None:
    """FAILED | CANCELLED -> QUEUED, generation + 1, attempts reset, failed pages get a fresh
    budget (done pages stay done), new outbox row. Guarded on ``expired_at IS NULL`` (an
    expired job's source is gone). A unique violation (an identical live job) propagates."""
    with transaction.atomic():
        generation = _move_returning_generation(
            _tenant_job(job_id, tenant).filter(expired_at__isnull=True),
            source,
            State.QUEUED,
            generation=F("generation") + 1,
            attempts=0,
            error_code=None,
            error_retryable=False,
            error_detail="",
            finished_at=None,
            pages_failed=0,
            queued_at=Now(),
        )
        if generation is None:
            return None
        PageCheckpoint.objects.filter(job_id=job_id, state=PageState.FAILED).update(
            state=PageState.PENDING, attempts=0, error_code=None
        )
        traceparent = (
            ConversionJob.objects.filter(id=job_id).values_list("traceparent", flat=True).get()
        )
        _redispatch(
            job_id=job_id,
            generation=generation,
            traceparent=traceparent,
            reason="operator_retry",
        )
        audit_event_append(
            job_id=job_id, event_type="operator_retry", generation=generation, actor=actor
        )
    return generation


@edge(State.FAILED, State.QUEUED)
def retry_failed(*, job_id: uuid.UUID, tenant: str | None, actor: str) -> int | None:
    """Operator retry of a FAILED job. Returns the new generation, or None (not failed)."""
    return _operator_retry(job_id, tenant, actor, State.FAILED)


@edge(State.CANCELLED, State.QUEUED)
def retry_cancelled(*, job_id: uuid.UUID, tenant: str | None, actor: str) -> int | None:
    """Operator retry of a CANCELLED job. Returns the new generation, or None."""
    return _operator_retry(job_id, tenant, actor, State.CANCELLED)
