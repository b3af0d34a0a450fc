"""The state machine's one home (``services/transitions.py``): every edge of
``states.TRANSITIONS`` has exactly one function, and every function wins when the job is where
its guard says and loses, writing nothing, when a second connection moves the job first while
the edge waits on the row lock (the real race: Postgres re-checks the guard on the newest row)."""

from __future__ import annotations

import ast
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from django.db import connection, connections
from django.utils import timezone

from conversion_jobs.models import (
    ConversionAttempt,
    ConversionJob,
    ConversionOutbox,
    ExecutionAuditEvent,
    WorkerLease,
)
from conversion_jobs.services import transitions
from conversion_jobs.services.audit import audit_chain_verify
from conversion_jobs.services.leases import Lease
from conversion_jobs.states import NAMED_TRANSITIONS, TRANSITIONS, State
from tests.integration.transitions.builders import text_result

ROOT = Path(__file__).resolve().parents[3] / "conversion_jobs"
RESULT = text_result()

#: edge -> (the source state to set up, the call that makes the move, what winning returns)
Call = Callable[[ConversionJob, Lease | None], Any]
CASES: dict[tuple[Any, ...], tuple[State, Call]] = {
    (State.QUEUED, State.RUNNING): (
        State.QUEUED,
        lambda j, _: transitions.claim(job_id=j.id, generation=j.generation, worker="w"),
    ),
    (State.QUEUED, State.CANCELLED): (
        State.QUEUED,
        lambda j, _: transitions.cancel_queued(job_id=j.id, tenant=j.tenant, actor="a"),
    ),
    (State.RETRY_WAIT, State.QUEUED): (
        State.RETRY_WAIT,
        lambda j, _: transitions.requeue_due_retry(
            job_id=j.id, generation=j.generation, traceparent=""
        ),
    ),
    (State.RETRY_WAIT, State.CANCELLED): (
        State.RETRY_WAIT,
        lambda j, _: transitions.cancel_retry_wait(job_id=j.id, tenant=j.tenant, actor="a"),
    ),
    (State.RUNNING, State.SUCCEEDED): (
        State.RUNNING,
        lambda _, lease: transitions.publish_succeeded(lease=lease, result=RESULT),
    ),
    (State.RUNNING, State.PARTIAL): (
        State.RUNNING,
        lambda _, lease: transitions.publish_partial(lease=lease, result=RESULT),
    ),
    (State.RUNNING, State.FAILED): (
        State.RUNNING,
        lambda _, lease: transitions.fail(lease=lease, code="invalid_input"),
    ),
    (State.RUNNING, State.RETRY_WAIT): (
        State.RUNNING,
        lambda _, lease: transitions.retry_later(
            lease=lease, code="converter_crashed", delay=timedelta(seconds=5)
        ),
    ),
    (State.RUNNING, State.QUEUED): (
        State.RUNNING,
        lambda _, lease: transitions.requeue_lost_lease(lease=lease, traceparent=""),
    ),
    (State.RUNNING, State.QUEUED, "yield"): (
        State.RUNNING,
        lambda _, lease: transitions.yield_slice(lease=lease, traceparent="", cost=7),
    ),
    (State.RUNNING, State.CANCELLING): (
        State.RUNNING,
        lambda j, _: transitions.cancel_running(job_id=j.id, tenant=j.tenant, actor="a"),
    ),
    (State.CANCELLING, State.CANCELLED): (
        State.CANCELLING,
        lambda _, lease: transitions.finish_cancel(lease=lease),
    ),
    (State.FAILED, State.QUEUED): (
        State.FAILED,
        lambda j, _: transitions.retry_failed(job_id=j.id, tenant=j.tenant, actor="a"),
    ),
    (State.CANCELLED, State.QUEUED): (
        State.CANCELLED,
        lambda j, _: transitions.retry_cancelled(job_id=j.id, tenant=j.tenant, actor="a"),
    ),
}


def test_every_edge_has_exactly_one_function_and_every_function_an_edge():
    every = set(TRANSITIONS) | set(NAMED_TRANSITIONS)
    assert set(transitions.EDGES) == every
    bound = [fn for fn in vars(transitions).values() if callable(fn) and hasattr(fn, "edge")]
    assert sorted(fn.edge for fn in bound) == sorted(every)
    assert all(transitions.EDGES[fn.edge] is fn for fn in bound)
    assert set(CASES) == every  # the matrix below covers every edge


def test_edge_outside_the_table_is_refused():
    with pytest.raises(LookupError):
        transitions.edge(State.SUCCEEDED, State.QUEUED)(lambda: None)
    with pytest.raises(LookupError):  # a second function for a bound edge
        transitions.edge(State.QUEUED, State.RUNNING)(lambda: None)
    with pytest.raises(LookupError):  # a name the named table does not have
        transitions.edge(State.RUNNING, State.QUEUED, name="nap")(lambda: None)


def _range_state(value: ast.expr) -> bool:
    """A page range's own state (``RangeState.X``, ``job_range.state``; ADR 0023)."""
    return (
        isinstance(value, ast.Attribute)
        and isinstance(value.value, ast.Name)
        and value.value.id == "RangeState"
    )


def _state_writes(path: Path) -> list[int]:
    """Lines of ``path`` that set a ``state`` through the ORM or write it in raw SQL."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in {"update", "create", "update_or_create", "bulk_update"}:
                if any(k.arg == "state" and not _range_state(k.value) for k in node.keywords):
                    lines.append(node.lineno)
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = " ".join(node.value.split()).lower()
            # an UPDATE of conversion_job whose SET list (not its WHERE guard) names state
            for m in re.finditer(r"update conversion_job\b(.*?)\bset\b(.*?)(\bwhere\b|$)", text):
                if re.search(r"(^|[\s,])state\s*=", m.group(2)):
                    lines.append(node.lineno)
    return lines


#: The store's statements that write a job's state (``store/jobs.py``): transitions' alone.
STATE_WRITING_STATEMENTS = {
    "move",
    "move_returning_generation",
    "claim",
    "publish",
    "insert_queued",
}


def _state_statement_calls(path: Path) -> list[int]:
    """Lines of ``path`` that call a state-writing statement of ``store/jobs.py``."""
    tree = ast.parse(path.read_text())
    aliases = {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == "conversion_jobs.store"
        for alias in node.names
        if alias.name == "jobs"
    }
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id in aliases
        and node.attr in STATE_WRITING_STATEMENTS
    ]


def test_no_module_but_transitions_writes_a_job_state():
    """Only transitions moves a job: the store's job statements (``store/jobs.py``, where the
    SQL of the edges lives) are called by transitions alone."""
    offenders = {
        str(path.relative_to(ROOT)): lines
        for path in ROOT.rglob("*.py")
        if "migrations" not in path.parts
        and path.name != "transitions.py"
        and str(path.relative_to(ROOT)) != "store/jobs.py"
        and (lines := _state_writes(path) + _state_statement_calls(path))
    }
    # Page checkpoints and webhook messages have states of their own; their writes name
    # PageState / MessageState.
    allowed = {
        path: lines
        for path, lines in offenders.items()
        if all(
            "PageState" in (line := (ROOT / path).read_text().splitlines()[n - 1])
            or "MessageState" in line
            for n in lines
        )
    }
    assert offenders == allowed


# --- the winner/loser matrix (Postgres: the loser waits on the row lock of a second connection) --


def _needs_postgres() -> None:
    if connection.vendor != "postgresql":
        pytest.fail("this test needs the production profile (DATABASE_URL=postgres://…)")


@pytest.fixture
def second() -> Iterator[psycopg.Connection]:
    """A second Postgres connection to the test database, outside Django."""
    _needs_postgres()
    conn = second_connection()
    yield conn
    conn.rollback()
    conn.close()


def second_connection() -> psycopg.Connection:
    db = connection.settings_dict
    return psycopg.connect(
        dbname=db["NAME"],
        host=db["HOST"] or None,
        port=db["PORT"] or None,
        user=db["USER"] or None,
        password=db["PASSWORD"] or None,
    )


def _setup(make_job: Callable[..., ConversionJob], source: State) -> tuple[ConversionJob, Any]:
    """A job in ``source``, with a real attempt and lease when ``source`` holds one."""
    if source not in (State.RUNNING, State.CANCELLING):
        fields: dict[str, Any] = {}
        if source == State.RETRY_WAIT:
            fields["next_attempt_at"] = timezone.now() - timedelta(seconds=1)
        return make_job(state=source, **fields), None
    job = make_job(state=State.QUEUED)
    claim = transitions.claim(job_id=job.id, generation=job.generation, worker="w")
    assert claim is not None
    if source == State.CANCELLING:
        assert transitions.cancel_running(job_id=job.id, tenant=job.tenant, actor="a")
    return ConversionJob.objects.get(id=job.id), claim.lease


def _footprint(job_id: uuid.UUID) -> dict[str, Any]:
    row = ConversionJob.objects.filter(id=job_id).values("state", "state_version").get()
    return {
        **row,
        "events": ExecutionAuditEvent.objects.filter(job_id=job_id).count(),
        "attempts": ConversionAttempt.objects.filter(job_id=job_id).count(),
        "outbox": ConversionOutbox.objects.filter(job_id=job_id).count(),
    }


def _competitor_sql(source: State) -> str:
    """A move that a second connection makes first: out of ``source`` to a state no edge under
    test can come from (cancelled, or failed for a cancelled source)."""
    if source == State.CANCELLED:
        return (
            "UPDATE conversion_job SET state = 'failed', error_code = 'other', "
            "state_version = state_version + 1 WHERE id = %s"
        )
    return (
        "UPDATE conversion_job SET state = 'cancelled', finished_at = now(), lease_token = NULL, "
        "next_attempt_at = NULL, state_version = state_version + 1 WHERE id = %s"
    )


EDGE_IDS = ["->".join(str(getattr(part, "value", part)) for part in edge) for edge in CASES]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("edge", list(CASES), ids=EDGE_IDS)
def test_edge__wins_from_its_source_state(edge, make_job, no_broker_publish):
    """Both profiles: on Postgres the hot edges run as one statement, on SQLite as the ORM
    statements; the outcome is the same."""
    source, call = CASES[edge]
    job, lease = _setup(make_job, source)
    before = _footprint(job.id)

    assert call(job, lease)

    after = _footprint(job.id)
    assert after["state"] == edge[1].value
    assert after["state_version"] == before["state_version"] + 1
    assert after["events"] > before["events"]
    assert audit_chain_verify(job_id=job.id)[1] == []
    if source in (State.RUNNING, State.CANCELLING) and edge[1] != State.CANCELLING:
        assert not WorkerLease.objects.filter(job_id=job.id).exists()
        assert not ConversionAttempt.objects.filter(job_id=job.id, finished_at=None).exists()


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("edge", list(CASES), ids=EDGE_IDS)
def test_edge__loses_to_a_move_committed_while_it_waits(edge, make_job, second, no_broker_publish):
    source, call = CASES[edge]
    job, lease = _setup(make_job, source)
    second.execute(_competitor_sql(source), (job.id,))  # holds the row lock, uncommitted
    before = _footprint(job.id)
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = call(job, lease)
        except BaseException as exc:  # pragma: no cover - reported below
            outcome["error"] = exc
        finally:
            connections.close_all()

    thread = threading.Thread(target=run)
    thread.start()
    _wait_until_blocked(job.id)
    second.commit()
    thread.join(timeout=30)

    assert not thread.is_alive()
    assert "error" not in outcome, outcome.get("error")
    assert not outcome["value"]
    after = _footprint(job.id)
    # Only the competitor's move happened: one state_version, no event, attempt or outbox row.
    assert after == {
        **before,
        "state": "failed" if source == State.CANCELLED else "cancelled",
        "state_version": before["state_version"] + 1,
    }


def _wait_until_blocked(job_id: uuid.UUID, timeout: float = 10) -> None:
    """Until some other backend waits on a lock (the edge's guarded statement on the row)."""
    deadline = time.monotonic() + timeout
    with connection.cursor() as cursor:
        while time.monotonic() < deadline:
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND wait_event_type = 'Lock'"
            )
            if cursor.fetchone()[0]:
                return
            time.sleep(0.02)
    raise AssertionError("the edge never waited on the row lock")
