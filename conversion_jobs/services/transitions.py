"""The job state machine's one home (docs/ARCHITECTURE.md §3, ADR 0017): the only code that writes
``conversion_job.state``.

One function per edge of ``states.TRANSITIONS``, bound to its edge by ``@edge`` (a test checks
that every edge has exactly one function and every function an edge). Each is one guarded
UPDATE whose row count is the answer; ``store.jobs.move`` bumps ``state_version`` (the
``asgi`` NOTIFY trigger fires on it). Callers that must choose an edge (cancel, lease recovery,
the repair sweep, operator retry) lock the job row first (``job_lock_for_choice``) and call
the one edge the state they hold allows, in the same transaction: trying edges one after
another let a commit between two tries make every edge miss (docs/ARCHITECTURE.md, "Lock,
then choose"). The worker's retryable error tries two edges whose guards split on
``attempts``, a column nobody else changes while the worker holds the lease, so their order
alone decides there.

Every edge that leaves a leased state ends the attempt and its lease (``_lease_ends``); every
edge into a terminal state runs ``_terminal`` (lease end, pending cancellation requests
resolved, the terminal metric, the audit event, the webhook messages). No caller repeats them.

The statements are the store's (``store/jobs.py``, docs/ARCHITECTURE.md "The store"): the hot
edges (claim, publish) and the acceptance insert are one SQL statement each on Postgres (a CTE
that moves the job and writes its attempt, lease, checkpoints, outbox and audit rows in one
round trip, the hook included: built from ``states.TERMINAL_EFFECTS``, as ``_terminal`` is);
SQLite (the standalone profile) runs their ORM twins. This module chooses the edge and the hook.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

from django.db import connection, transaction
from django.db.models import F, Q
from django.db.models.functions import Now
from django.utils import timezone

from conversion_jobs.models import (
    AttemptOutcome,
    ConversionJob,
    PageCheckpoint,
)
from conversion_jobs.observability import metrics
from conversion_jobs.services import fair
from conversion_jobs.services.audit import SYSTEM_ACTOR, audit_event_append
from conversion_jobs.services.checkpoints import checkpoints_upsert
from conversion_jobs.services.dispatch import outbox_publish_after_commit
from conversion_jobs.services.leases import Lease, lease_ttl
from conversion_jobs.states import (
    LEASED_STATES,
    NAMED_TRANSITIONS,
    TERMINAL_EFFECTS,
    TERMINAL_STATES,
    TRANSITIONS,
    State,
)
from conversion_jobs.store import checkpoints as pages
from conversion_jobs.store import jobs as store
from conversion_jobs.store.leases import held, lease_delete
from conversion_jobs.webhooks.outbox import EVENT_OF_STATE, messages_enqueue

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
    row = store.lock_for_choice(job_id, tenant)
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
    lease_delete(lease)
    attempt_close(lease=lease, outcome=outcome, error_code=error_code)


def attempt_close(*, lease: Lease, outcome: AttemptOutcome, error_code: str | None) -> bool:
    """Close the attempt if it is still open (bookkeeping on the attempt row only)."""
    if lease.attempt_id is None:  # the repair sweep's lease of a job with no attempt row
        return False
    closed = store.attempt_close(
        attempt_id=lease.attempt_id,
        job_id=lease.job_id,
        generation=lease.generation,
        outcome=outcome,
        error_code=error_code,
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


@dataclass(frozen=True)
class _Ending:
    """What the terminal hook's effects read: the edge that won and who made it."""

    job_id: uuid.UUID
    generation: int
    state: State
    lease: Lease | None
    outcome: AttemptOutcome | None
    error_code: str | None
    event_type: str
    details: dict[str, Any]
    actor: str


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
    """The terminal hook: each effect of ``states.TERMINAL_EFFECTS`` in order (``_EFFECTS``; the
    publish statement, ``store.jobs.PUBLISH``, is built from the same list). Runs inside the
    transaction whose guarded UPDATE won."""
    if state not in TERMINAL_STATES:
        raise ValueError(f"{state} is not terminal")
    ending = _Ending(
        job_id, generation, state, lease, outcome, error_code, event_type, details, actor
    )
    for effect in TERMINAL_EFFECTS:
        _EFFECTS[effect](ending)


def _lease_end_effect(e: _Ending) -> None:
    """The lease ended and the attempt closed, if the job held one."""
    if e.lease is not None and e.outcome is not None:
        _lease_ends(e.lease, outcome=e.outcome, error_code=e.error_code)


def _cancellations_effect(e: _Ending) -> None:
    """Pending cancellation requests resolved: cancelled (with their latency after commit), or
    lost to completion."""
    if e.state != State.CANCELLED:
        store.cancellations_lost(e.job_id)
        return
    now = timezone.now()
    latencies = [(now - at).total_seconds() for at in store.cancellations_cancelled(e.job_id, now)]
    if latencies:

        def observe() -> None:
            for seconds in latencies:
                metrics.CANCELLATION_LATENCY.observe(seconds)

        transaction.on_commit(observe)


def _audit_effect(e: _Ending) -> None:
    audit_event_append(
        job_id=e.job_id,
        event_type=e.event_type,
        generation=e.generation,
        attempt_id=e.lease.attempt_id if e.lease else None,
        actor=e.actor,
        details=e.details,
    )


def _webhooks_effect(e: _Ending) -> None:
    """The webhook messages of the endpoints subscribed now (``webhooks/outbox.py``)."""
    messages_enqueue(job_id=e.job_id, state=e.state)


def _metric_effect(e: _Ending) -> None:
    state = e.state.value
    transaction.on_commit(lambda: metrics.TERMINAL.labels(state=state).inc())


#: effect of ``states.TERMINAL_EFFECTS`` -> its hook (checked at import: one per effect)
_EFFECTS: dict[str, Callable[[_Ending], None]] = {
    "lease_end": _lease_end_effect,
    "cancellations": _cancellations_effect,
    "audit": _audit_effect,
    "webhooks": _webhooks_effect,
    "metric": _metric_effect,
}
if set(_EFFECTS) != set(TERMINAL_EFFECTS):
    raise LookupError(f"_terminal's hooks {sorted(_EFFECTS)} are not {TERMINAL_EFFECTS}")


def _redispatch(*, job_id: uuid.UUID, generation: int, traceparent: str, reason: str) -> None:
    """A new generation needs a message: its outbox row, and the fast path after commit."""
    outbox_id = store.outbox_insert(job_id=job_id, generation=generation, traceparent=traceparent)
    outbox_publish_after_commit(
        outbox_id=outbox_id, job_id=job_id, generation=generation, traceparent=traceparent
    )
    transaction.on_commit(lambda: metrics.REDISPATCHES.labels(reason=reason).inc())


# --- (none) -> queued: acceptance --------------------------------------------------------------


#: What the acceptance inserts (``store.jobs.NewJob``).
NewJob = store.NewJob


def job_insert_queued(new: NewJob) -> bool:
    """(none) -> QUEUED, generation 1: the job, its outbox row, its idempotency record (when a
    key was sent), its inline source (when it has one) and its first audit event. On Postgres
    one statement (``store.jobs.ACCEPT``), which the caller runs inside its transaction or, when it
    is the whole acceptance, alone in autocommit. A unique violation (a concurrent identical job
    or key) propagates: everything the statement (or the caller's transaction) wrote rolls back
    and the caller answers from the winner — except that an inline job on Postgres that meets
    a job with its content identity writes nothing and returns False (``ON CONFLICT DO
    NOTHING``: the acceptance runs no pre-check read for it, so the conflict is its common
    duplicate case, answered without an error) - and that any job whose document the tenant
    has quarantined (``services/quarantine.py``) writes nothing and returns False. True:
    inserted; registers the fast-path publish for after commit. With fair dispatch an idle
    system's statement also sends the unit (``store.fair.ADMIT``), and the fast path publishes it
    without a pick; one that found no free credit runs no pick (the relay's wake-up does)."""
    inserted = store.insert_queued(new, send_if_idle=fair.enabled())
    if inserted is None:  # quarantined, or the inline statement met a job's content identity
        return False
    job = new.job
    outbox_publish_after_commit(
        outbox_id=inserted.outbox_id,
        job_id=job.id,
        generation=1,
        traceparent=job.traceparent,
        sent=inserted.sent,
        no_credit=inserted.no_credit,
    )
    return True


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
    won = store.claim(
        job_id=job_id, generation=generation, worker=worker, token=token, now=now, expires=expires
    )
    if won is None:
        current = store.generation_of(job_id)
        reason = "stale" if current is not None and current > generation else "duplicate"
        metrics.DUPLICATE_DELIVERIES.labels(reason=reason).inc()
        return None
    job, attempt_id, source = won
    metrics.CLAIMS.inc()
    lease = Lease(job_id, generation, token, attempt_id, job.attempts, now)
    return Claim(lease, job, source)


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
    if pages.one_statement(checkpoints):
        won = _publish_in_one(lease, state, values, details, checkpoints)
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


def _publish_in_one(
    lease: Lease,
    state: State,
    values: dict[str, Any],
    details: dict[str, Any],
    checkpoints: list[PageCheckpoint],
) -> bool:
    """The publish in one statement, the terminal hook in it (``store.jobs.PUBLISH``); its
    ``metric`` effect and the attempt's duration after commit."""
    moved, closed = store.publish(
        lease,
        attempt_id=lease.attempt_id,
        state=state,
        event=EVENT_OF_STATE[state].value,
        values=values,
        details=details,
        checkpoints=checkpoints,
    )
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
    traceparent: str = "",
) -> bool:
    """One fenced move out of a leased state with its bookkeeping; the caller holds the
    transaction. The terminal hook for terminal targets, the lease end and the audit event for
    the others; back to queued is a new generation with its message (``event_type`` is the
    redispatch metric's reason). False: lost, nothing written."""
    fence = held(lease)
    if guard is not None:
        fence = fence.filter(guard)
    if target == State.QUEUED:
        values = {**values, "generation": F("generation") + 1, "queued_at": Now()}
    if not store.move(
        fence, source, target, lease_token=None, **values, **pages.counters(checkpoints or [])
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
    if target == State.QUEUED:
        _redispatch(
            job_id=lease.job_id,
            generation=lease.generation + 1,
            traceparent=traceparent,
            reason=event_type,
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


def fail_lease_lost(*, lease: Lease, range_first: int | None = None) -> bool:
    """The lease sweep's dead letter: RUNNING -> FAILED ``attempts_exhausted`` (retryable) for
    a lease that expired with its attempt budget spent; the attempt closes ``lease_lost``, the
    audit event is ``lease_expired``. The job's own lease is guarded on attempts >=
    max_attempts; with ``range_first`` a page range's worker kept dying (the caller counted the
    range's attempts), which fails its job. False: lost."""
    detail = "last error: lease_lost"
    details: dict[str, Any] = {"result": "exhausted"}
    if range_first is not None:
        detail += " (a page range)"
        details["range_first"] = range_first
    return fail(
        lease=lease,
        code="attempts_exhausted",
        detail=detail,
        retryable=True,
        outcome=AttemptOutcome.LEASE_LOST,
        attempt_error="lease_lost",
        event_type="lease_expired",
        details=details,
        only_if_exhausted=range_first is None,
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
        return _leave_lease(
            lease,
            State.RUNNING,
            State.QUEUED,
            values={"error_code": "lease_lost", "error_retryable": True},
            guard=~_EXHAUSTED,
            outcome=AttemptOutcome.LEASE_LOST,
            error_code="lease_lost",
            event_type="lease_expired",
            details={"result": "requeued"},
            traceparent=traceparent,
        )


@edge(State.RUNNING, State.QUEUED, name="yield")
def yield_slice(
    *, lease: Lease, traceparent: str, cost: int, error_code: str | None = None
) -> bool:
    """RUNNING -> QUEUED "yielded" (generation + 1, new outbox row of ``cost`` page units): the
    attempt used its fair-share slice while another tenant waits with no free slot
    (docs/ARCHITECTURE.md §2b), or (``error_code`` ``conversion_starved``, recorded on the
    attempt) it stepped aside and the load starved it (ADR 0022). Not a failure and not an
    attempt: ``attempts`` goes back down, the attempt closes ``yielded``; the job resumes from
    its checkpoints when the fair order sends it again. Fenced like every worker write. False:
    lost, nothing written."""
    details: dict[str, Any] = {"attempt": lease.attempt_number, "cost": max(1, cost)}
    if error_code is not None:
        details["reason"] = error_code
    with transaction.atomic():
        won = _leave_lease(
            lease,
            State.RUNNING,
            State.QUEUED,
            values={"attempts": F("attempts") - 1, "dispatch_cost": max(1, cost)},
            outcome=AttemptOutcome.YIELDED,
            error_code=error_code,
            event_type="yielded",
            details=details,
            traceparent=traceparent,
        )
        if won:
            transaction.on_commit(metrics.FAIR_YIELDS.inc)
    return won


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


def _cancel_immediately(job_id: uuid.UUID, tenant: str, actor: str, source: State) -> int | None:
    with transaction.atomic():
        generation = store.move_returning_generation(
            store.of_tenant(job_id, tenant),
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
        generation = store.move_returning_generation(
            store.of_tenant(job_id, tenant), State.RUNNING, State.CANCELLING
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
        if not store.move(
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
        generation = store.move_returning_generation(
            store.of_tenant(job_id, tenant).filter(expired_at__isnull=True),
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
        pages.failed_reset(job_id)
        _redispatch(
            job_id=job_id,
            generation=generation,
            traceparent=store.traceparent_of(job_id),
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
