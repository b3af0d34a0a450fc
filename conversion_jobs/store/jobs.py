"""The statements of the job row and what hangs off it (docs/ARCHITECTURE.md §3, ADR 0017): the
guarded move of an edge, the row lock a choosing caller takes, and the three hot statements, each
one round trip on Postgres with its ORM twin beside it (SQLite, the standalone profile, one
writer at a time under ``BEGIN IMMEDIATE``):

* ``ACCEPT`` (none -> queued): the job, its outbox row, idempotency record, inline source and
  first audit event (:func:`insert_queued`); ``PRECHECK``, the read before it;
* ``CLAIM`` (queued -> running): the move, the attempt, the lease, the audit event (:func:`claim`);
* ``PUBLISH`` (running -> succeeded | partial): the move, the last done pages and the terminal
  hook in SQL, one CTE member per effect of ``states.TERMINAL_EFFECTS`` (:func:`publish`; its
  twin is the edge's general path in ``services/transitions.py``).

Which edge and which hook is the services' choice; this module only runs the statements."""

from __future__ import annotations

import functools
import re
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NamedTuple

from django.conf import settings
from django.db import connection, models, transaction
from django.db.models import F, QuerySet
from django.db.models.functions import Coalesce, Now
from django.utils import timezone

from conversion_jobs.canonical import canonical_json
from conversion_jobs.models import (
    CancellationOutcome,
    CancellationRequest,
    ConversionAttempt,
    ConversionJob,
    ConversionOutbox,
    ExecutionAuditEvent,
    IdempotencyRecord,
    InlineSource,
    PageCheckpoint,
    WorkerLease,
)
from conversion_jobs.states import TERMINAL_EFFECTS, TRANSITIONS, State
from conversion_jobs.store import audit, db, fair
from conversion_jobs.store.checkpoints import (
    UPSERT_DONE_PAGES,
    done_pages_params,
    pages_converted_by,
)
from conversion_jobs.store.leases import FENCE, Fence, fence_params
from conversion_jobs.store.prepared import Positional, positional, prepared_cursor

# --- the guarded move of an edge and the lock of a choosing caller ----------------------------


def move(guard: QuerySet[ConversionJob], source: State, target: State, **values: Any) -> int:
    """The guarded UPDATE of one edge: ``guard`` narrows the row, ``source`` is the state it must
    still be in; ``state_version`` moves (the ``asgi`` NOTIFY trigger fires on it). Row count: 1
    this call moved it, 0 it lost."""
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


def move_returning_generation(
    guard: QuerySet[ConversionJob], source: State, target: State, **values: Any
) -> int | None:
    """:func:`move` that also says which generation it moved (read under the lock it took)."""
    if not move(guard, source, target, **values):
        return None
    return int(guard.values_list("generation", flat=True).get())


def of_tenant(job_id: uuid.UUID, tenant: str | None) -> QuerySet[ConversionJob]:
    """The job row (of ``tenant``; None: any tenant)."""
    jobs = ConversionJob.objects.filter(id=job_id)
    return jobs if tenant is None else jobs.filter(tenant=tenant)


#: What a caller that chooses an edge reads under the row lock, in this order.
LOCKED_COLUMNS = (
    "state",
    "generation",
    "lease_token",
    "attempts",
    "max_attempts",
    "expired_at",
    "traceparent",
)


def lock_for_choice(job_id: uuid.UUID, tenant: str | None) -> tuple[Any, ...] | None:
    """``SELECT … FOR UPDATE`` of the job row (SQLite: the transaction's write lock, ``BEGIN
    IMMEDIATE``), its ``LOCKED_COLUMNS``; None: no such job."""
    return of_tenant(job_id, tenant).select_for_update().values_list(*LOCKED_COLUMNS).first()


def generation_of(job_id: uuid.UUID) -> int | None:
    return ConversionJob.objects.filter(id=job_id).values_list("generation", flat=True).first()


def traceparent_of(job_id: uuid.UUID) -> str:
    return str(ConversionJob.objects.filter(id=job_id).values_list("traceparent", flat=True).get())


def outbox_insert(*, job_id: uuid.UUID, generation: int, traceparent: str) -> int:
    """A new outbox row for ``generation`` (a message to send). Its id."""
    return int(
        ConversionOutbox.objects.create(
            job_id=job_id, generation=generation, traceparent=traceparent
        ).id
    )


# --- the terminal hook's statements (the ORM edges) -------------------------------------------


def attempt_close(
    *, attempt_id: int, job_id: uuid.UUID, generation: int, outcome: str, error_code: str | None
) -> int:
    """Close the attempt if it is still open, its page count computed. Row count."""
    return int(
        ConversionAttempt.objects.filter(id=attempt_id, finished_at__isnull=True).update(
            outcome=outcome,
            error_code=error_code,
            finished_at=Now(),
            pages_converted=Coalesce(pages_converted_by(job_id=job_id, generation=generation), 0),
        )
    )


def cancellations_lost(job_id: uuid.UUID) -> int:
    """The job's pending cancellation requests lost to its completion. Row count."""
    return int(
        CancellationRequest.objects.filter(job_id=job_id, resolved_at__isnull=True).update(
            outcome=CancellationOutcome.LOST_TO_COMPLETION, resolved_at=Now()
        )
    )


def cancellations_cancelled(job_id: uuid.UUID, now: datetime) -> list[datetime]:
    """The job's pending cancellation requests resolved cancelled at ``now``: when each was
    requested (empty: none was pending)."""
    pending = CancellationRequest.objects.filter(job_id=job_id, resolved_at__isnull=True)
    requested = list(pending.values_list("requested_at", flat=True))
    if not pending.update(resolved_at=now, outcome=CancellationOutcome.CANCELLED):
        return []
    return requested


# --- (none) -> queued: acceptance -------------------------------------------------------------

#: The acceptance pre-checks in one read (both profiles): the key's binding, the live or
#: succeeded job with this content identity and whether the tenant quarantined the document
#: under this engine version (index lookups, O(1) in the table's size). Races past it are
#: settled by the unique constraints in the insert, never by this read.
PRECHECK = """
SELECT
    (SELECT fingerprint FROM idempotency_record WHERE tenant = %(tenant)s AND key = %(key)s),
    (SELECT job_id FROM idempotency_record WHERE tenant = %(tenant)s AND key = %(key)s),
    (SELECT id FROM conversion_job
     WHERE tenant = %(tenant)s AND source_sha256 = %(sha)s AND output = %(output)s
       AND options_digest = %(digest)s AND policy_version = %(policy)s
       AND state IN ('queued', 'running', 'retry_wait', 'cancelling', 'succeeded')
       AND expired_at IS NULL
     LIMIT 1),
    EXISTS (SELECT 1 FROM document_quarantine
            WHERE tenant = %(tenant)s AND source_sha256 = %(sha)s
              AND engine_version = %(engine)s AND quarantined_at IS NOT NULL)
"""


def precheck(params: dict[str, Any]) -> tuple[Any, Any, Any, Any]:
    """``PRECHECK``'s one row: (key's fingerprint, key's job, duplicate job, quarantined)."""
    with prepared_cursor() as cursor:
        cursor.execute(PRECHECK, params)
        fingerprint, key_job, duplicate, quarantined = cursor.fetchone()
    return fingerprint, key_job, duplicate, quarantined


def insert_alone() -> bool:
    """The acceptance insert is one statement here (Postgres, ``ACCEPT``): alone in autocommit
    it commits whole or not at all, and its inline form settles a content-identity duplicate
    itself (no pre-check read needed). SQLite: several statements in the caller's transaction."""
    return db.postgres()


#: (none) -> queued in one round trip: the job row, then what hangs off it. A document this
#: tenant has quarantined under the engine version (services/quarantine.py) inserts nothing and
#: returns no row (one probe of ``quarantine_key``; the caller tells why). A unique violation
#: (content identity, idempotency key) aborts the whole statement. The inline form (``{conflict}``
#: and ``{inline}`` filled in) also writes the source's bytes, and a content-identity conflict
#: of the job row writes nothing and returns no row: every other part selects from ``job``.
#: (Postgres waits for an uncommitted conflicting row's transaction first, so "no row" means a
#: committed job holds the identity.) The key's own conflict still aborts the statement. With
#: fair dispatch (``{admit}`` and ``{admit_share}``: ``store.fair.ADMIT``) an idle system's
#: acceptance sends its own unit: the job and its outbox row are written sent, and the second
#: column says so; the third says whether a credit was free (without one, a pick after the
#: commit could send nothing).
ACCEPT = """
WITH {admit}job AS (
    INSERT INTO conversion_job ({columns})
    SELECT {values}
    WHERE NOT EXISTS (
        SELECT 1 FROM document_quarantine
        WHERE tenant = %(j_tenant)s AND source_sha256 = %(j_source_sha256)s
          AND engine_version = %(q_engine)s AND quarantined_at IS NOT NULL
    ){conflict}
    RETURNING id, traceparent, audit_head
){inline}{admit_share}, outbox AS (
    INSERT INTO conversion_outbox
        (job_id, generation, traceparent, created_at, publish_attempts, published_at)
    SELECT id, 1, traceparent, %(now)s, {attempts}, {sent_at} FROM job RETURNING id
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
SELECT id, {sent}, {free} FROM outbox
"""

ACCEPT_INLINE = """, inline AS (
    INSERT INTO inline_source (job_id, content) SELECT id, %(inline)s FROM job
)"""


@dataclass(frozen=True)
class NewJob:
    """What the acceptance inserts: the job (unsaved) and what hangs off it."""

    job: ConversionJob
    actor: str
    idempotency_key: str | None
    fingerprint: str
    details: dict[str, Any]
    #: the source's bytes when it is stored inline (``inline_source``), else None
    inline_content: bytes | None = None
    #: ``converters.engine_version`` of the source's type: a quarantined document is refused
    engine_version: str = ""


class Inserted(NamedTuple):
    """What ``ACCEPT`` wrote: the outbox row, whether it was written sent, and whether a pick
    after the commit could send anything."""

    outbox_id: int
    #: the acceptance sent its own unit (fair dispatch on an idle system, ``store.fair.ADMIT``):
    #: the caller publishes it without a pick
    sent: bool = False
    #: no credit was free at the statement's snapshot (``store.fair.ADMIT``'s ``credit``): a
    #: pick would send nothing, the next slot freed wakes the relay (False: not known)
    no_credit: bool = False


def insert_queued(new: NewJob, *, send_if_idle: bool = False) -> Inserted | None:
    """``ACCEPT`` (SQLite: its twin, in the caller's transaction): the job (its timestamps and
    audit head set here), its outbox row, idempotency record, inline source and first audit event
    (``accepted``); ``send_if_idle`` (fair dispatch): on Postgres, the unit written sent when
    the pick would send it now (``store.fair.ADMIT``; SQLite: never, the pick sends it). None:
    the statement wrote nothing (a quarantined document, or the inline form met the content
    identity of a committed job). A unique violation propagates."""
    job, first_event = new.job, _first_event(new)
    if not db.postgres():
        job.save(force_insert=True)
        if new.inline_content is not None:
            InlineSource.objects.create(job=job, content=new.inline_content)
        outbox_id = outbox_insert(job_id=job.id, generation=1, traceparent=job.traceparent)
        if new.idempotency_key is not None:
            IdempotencyRecord.objects.create(
                tenant=job.tenant, key=new.idempotency_key, fingerprint=new.fingerprint, job=job
            )
        ExecutionAuditEvent.objects.create(
            **first_event, prev_hash=audit.GENESIS, hash=job.audit_head
        )
        return Inserted(outbox_id)
    params = job_insert_params(job)
    params.update(
        now=first_event["created_at"],
        actor=new.actor,
        key=new.idempotency_key,
        fingerprint=new.fingerprint,
        details=canonical_json(new.details),
        genesis=audit.GENESIS,
        q_engine=new.engine_version,
    )
    if new.inline_content is not None:
        params["inline"] = new.inline_content
    if send_if_idle:
        params.update(fair.admit_params())
    statement = accept_statement(new.inline_content is not None, send_if_idle)
    # prepared: parsed and planned once per connection; raw: psycopg sends it as it is
    with prepared_cursor(raw=True) as cursor:
        cursor.execute(statement.sql, statement.params(params))
        row = cursor.fetchone()
    return None if row is None else Inserted(int(row[0]), bool(row[1]), not row[2])


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
    job.audit_head = audit.event_hash(prev_hash=audit.GENESIS, **first_event)
    return first_event


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


#: The job's columns an acceptance that sends its own unit fills from ``ADMIT``'s gate.
_SENT_COLUMNS = {
    "dispatched_at": "(SELECT now() FROM gate)",
    "dispatched_generation": "(SELECT 1 FROM gate)",
}


@functools.cache
def accept_sql(inline: bool, send_if_idle: bool = False) -> str:
    """``ACCEPT`` with the job's columns filled in (inline form or not, sent when idle or
    not): built once each."""
    fields = ConversionJob._meta.concrete_fields
    sent = _SENT_COLUMNS if send_if_idle else {}
    return ACCEPT.format(
        admit=fair.ADMIT if send_if_idle else "",
        columns=", ".join(str(f.column) for f in fields),
        # typed as their columns (without a length: too long is an error, not a truncation):
        # a SELECT list does not take its parameters' types from the INSERT's columns
        values=", ".join(
            sent.get(
                str(f.column),
                f"%(j_{f.column})s::{re.sub(r'[(].*[)]', '', str(f.db_type(connection)))}",
            )
            for f in fields
        ),
        conflict=" ON CONFLICT DO NOTHING" if inline else "",
        inline=ACCEPT_INLINE if inline else "",
        admit_share=fair.ADMIT_SHARE if send_if_idle else "",
        attempts="(SELECT count(*) FROM gate)::integer" if send_if_idle else "0",
        sent_at="(SELECT now() FROM gate)" if send_if_idle else "NULL::timestamptz",
        sent="EXISTS (SELECT 1 FROM gate)" if send_if_idle else "false",
        free="(SELECT free FROM credit)" if send_if_idle else "true",
    )


@functools.cache
def accept_statement(inline: bool, send_if_idle: bool = False) -> Positional:
    """:func:`accept_sql` in PostgreSQL's placeholders, made once each: with ``ADMIT`` it is
    past what psycopg keeps converted (``store/prepared.py``)."""
    return positional(accept_sql(inline, send_if_idle))


# --- queued -> running: the claim -------------------------------------------------------------

#: queued -> running in one round trip. ``locked`` takes the row lock with the guard (after a
#: wait it sees the newest row, so a claim that lost the race matches nothing and writes nothing);
#: the attempt id is drawn first so the audit hash can cover it. An inline source's bytes come
#: back with the row (the join finds nothing for a stored one): no second read for them.
CLAIM = """
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
CLAIM_ASYNC_COMMIT = " WHERE set_config('synchronous_commit', 'off', true) IS NOT NULL"

#: A won claim: the job row as the claim left it, the attempt's id, an inline source's bytes.
Claimed = tuple[ConversionJob, int, bytes | None]


def claim(
    *,
    job_id: uuid.UUID,
    generation: int,
    worker: str,
    token: uuid.UUID,
    now: datetime,
    expires: datetime,
) -> Claimed | None:
    """``CLAIM`` (SQLite: :func:`_claim_orm`). None: the guard matched nothing (written nothing)."""
    params: dict[str, Any] = {
        "job": job_id,
        "generation": generation,
        "token": token,
        "now": now,
        "expires": expires,
        "worker": worker,
    }
    if not db.postgres():
        return _claim_orm(params)
    details = canonical_json({"attempt": audit.slot("attempt_number")})
    exprs = {"attempt": "att.id", "attempt_number": "l.attempts + 1"}
    sql = CLAIM.format(
        columns=_job_columns(),
        commit=CLAIM_ASYNC_COMMIT if settings.QUIRE["CLAIM_ASYNC_COMMIT"] else "",
        hash=audit.chain_sql(
            prev="l.audit_head",
            seq="l.audit_seq + 1",
            body=audit.event_body(
                job_id=job_id,
                event_type="claimed",
                generation=generation,
                attempt_id=audit.slot("attempt"),
                actor=audit.SYSTEM_ACTOR,
                details={"attempt": audit.slot("attempt_number")},
                created_at=now,
            ),
            params=params,
            exprs=exprs,
        ),
        details=audit.spliced_sql(details, exprs={"attempt_number": "attempts"}, params=params),
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


def _claim_orm(params: dict[str, Any]) -> Claimed | None:
    """``CLAIM``'s twin (its ``params``): the same rows in one transaction."""
    job_id, generation, now = params["job"], params["generation"], params["now"]
    with transaction.atomic():
        won = move(
            ConversionJob.objects.filter(id=job_id, generation=generation),
            State.QUEUED,
            State.RUNNING,
            attempts=F("attempts") + 1,
            lease_token=params["token"],
        )
        if not won:
            return None
        job = ConversionJob.objects.get(id=job_id)
        attempt = ConversionAttempt.objects.create(
            job_id=job_id,
            generation=generation,
            number=job.attempts,
            worker=params["worker"],
            heartbeat_at=now,
        )
        WorkerLease.objects.update_or_create(
            job_id=job_id,
            defaults={
                "generation": generation,
                "attempt": attempt,
                "token": params["token"],
                "expires_at": params["expires"],
            },
        )
        audit.event_append(
            job_id,
            "claimed",
            generation,
            attempt.id,
            audit.SYSTEM_ACTOR,
            {"attempt": job.attempts},
            now,
        )
        source = InlineSource.objects.filter(job_id=job_id).values_list("content", flat=True)
        content = source.first()
    return job, attempt.id, None if content is None else bytes(content)


# --- running -> succeeded | partial: the publish ----------------------------------------------

#: The publish statement's part for the webhook messages (a CTE member after ``moved``, which
#: returns the job's id and tenant): one message per enabled endpoint of the tenant subscribed to
#: ``%(event)s``, its payload left NULL (rendered by the notifier at its first claim:
#: ``webhooks/outbox.py``'s ``payload_render``; ``messages_enqueue`` is its ORM twin).
WEBHOOK_MESSAGES = """
    INSERT INTO webhook_message
        (id, endpoint_id, job_id, event_type, payload, state, attempts, created_at,
         next_attempt_at)
    SELECT gen_random_uuid(), e.id, m.id, %(event)s::text, NULL, 'pending', 0, now(), now()
    FROM moved m JOIN webhook_endpoint e ON e.tenant = m.tenant
    WHERE e.enabled AND e.events @> jsonb_build_array(%(event)s::text)
"""

#: The terminal hook in SQL: one CTE member (or two) per effect of ``states.TERMINAL_EFFECTS``,
#: each writing only when ``moved`` has a row. A publish never meets a cancellation it
#: could honour (the job is running, not cancelling): pending requests are lost to completion.
PUBLISH_EFFECTS: dict[str, str] = {
    "lease_end": """lease_end AS (
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
)""",
    "cancellations": """cancels AS (
    UPDATE cancellation_request SET outcome = 'lost_to_completion', resolved_at = now()
    WHERE job_id = %(job)s AND resolved_at IS NULL AND EXISTS (SELECT 1 FROM moved)
)""",
    "audit": """audit AS (
    INSERT INTO execution_audit_event
        (job_id, seq, event_type, generation, attempt_id, actor, details, created_at,
         prev_hash, hash)
    SELECT id, audit_seq, 'published', %(generation)s, %(attempt)s, 'system', %(details)s::jsonb,
           %(at)s, audit_prev, audit_head
    FROM moved
)""",
    "webhooks": f"hooks AS ({WEBHOOK_MESSAGES})",
}
#: The effects the publish's caller runs after its commit (a metric is no row).
PUBLISH_AFTER_COMMIT = ("metric",)

#: running -> succeeded | partial in one round trip: the job (fenced on generation, token and
#: state, under its row lock), its last done page checkpoints, then the terminal hook's
#: ``PUBLISH_EFFECTS``. Zero rows from ``moved``: the publish lost and every other part wrote
#: nothing. Row: (jobs moved, attempts closed).
PUBLISH = f"""
WITH locked AS (
    SELECT id, audit_seq, audit_head FROM conversion_job
    WHERE {FENCE} AND state = 'running'
    FOR UPDATE
), moved AS (
    UPDATE conversion_job j SET
        state = %(state)s, result_key = %(result_key)s, result_sha256 = %(result_sha256)s,
        result_size = %(result_size)s, result_media_type = %(result_media_type)s,
        finished_at = now(), pages_done = j.pages_done + %(n_done)s, lease_token = NULL,
        source_page_count = COALESCE(%(source_page_count)s, j.source_page_count),
        state_version = j.state_version + 1, updated_at = now(),
        audit_seq = l.audit_seq + 1, audit_head = {{hash}}
    FROM locked l WHERE j.id = l.id
    RETURNING j.id, j.tenant, j.audit_seq, j.audit_head, l.audit_head AS audit_prev
), pages AS ({UPSERT_DONE_PAGES}), {
    ", ".join(
        PUBLISH_EFFECTS[effect] for effect in TERMINAL_EFFECTS if effect not in PUBLISH_AFTER_COMMIT
    )
}
SELECT (SELECT count(*) FROM moved), (SELECT count(*) FROM attempt)
"""  # noqa: S608 (text built from this module's constants)


def publish(
    fence: Fence,
    *,
    attempt_id: int | None,
    state: State,
    event: str,
    values: dict[str, Any],
    details: dict[str, Any],
    checkpoints: list[PageCheckpoint],
) -> tuple[int, int]:
    """``PUBLISH`` (Postgres, every page of ``checkpoints`` done: ``checkpoints.one_statement``):
    (jobs moved, attempts closed), each 1 or 0."""
    now = timezone.now()
    params: dict[str, Any] = {
        **fence_params(fence),
        "attempt": attempt_id,
        "state": state.value,
        "event": event,
        "n_done": len(checkpoints),
        "details": canonical_json(details),
        "at": now,
        **done_pages_params(checkpoints),
        "source_page_count": None,
        **values,
    }
    sql = PUBLISH.format(
        hash=audit.chain_sql(
            prev="l.audit_head",
            seq="l.audit_seq + 1",
            body=audit.event_body(
                job_id=fence.job_id,
                event_type="published",
                generation=fence.generation,
                attempt_id=attempt_id,
                actor=audit.SYSTEM_ACTOR,
                details=details,
                created_at=now,
            ),
            params=params,
        )
    )
    with prepared_cursor() as cursor:
        cursor.execute(sql, params)
        moved, closed = cursor.fetchone()
    return int(moved), int(closed)
