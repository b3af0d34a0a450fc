"""The acceptance's two statements are prepared once per connection
(``store/prepared.py::prepared_cursor``, the cursor of every hot statement): Postgres parses
and plans them once, then only binds and executes."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import psycopg
import pytest
from django.conf import settings
from django.db import IntegrityError, connection, transaction
from django.test.utils import CaptureQueriesContext

from conversion_jobs import storage
from conversion_jobs.models import ConversionJob, DispatchClock
from conversion_jobs.services.acceptance import StagedUpload, conversion_job_accept
from conversion_jobs.store import fair
from conversion_jobs.store.db import violated_constraint
from conversion_jobs.store.prepared import (
    Byteas,
    Int4s,
    Int8s,
    Texts,
    positional,
    prepared_cursor,
)
from tests import testdocs

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


@pytest.fixture(autouse=True)
def _clock() -> None:
    """The fair clock's one row (migration 0017), which the flush after a transactional test
    removes: without it no acceptance sends its own unit and every fast path picks."""
    DispatchClock.objects.get_or_create(id=1)


def _accept(tmp_path: Path, *, key: str | None = None) -> uuid.UUID:
    source = testdocs.make_pdf(tmp_path / "doc.pdf", pages=1, text_of=lambda n: uuid.uuid4().hex)
    staged = Path(settings.QUIRE["STORAGE_DIR"]) / "staging" / uuid.uuid4().hex
    staged.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, staged)
    sha, size = storage.sha256_file(staged)
    accepted = conversion_job_accept(
        tenant="tenant-a",
        actor="t",
        upload=StagedUpload(path=staged, sha256=sha, size=size),
        output="text",
        raw_options={},
        idempotency_key=key,
    )
    assert accepted.created
    return accepted.job.id


#: The first words of the acceptance's insert (with fair dispatch: its own pick's CTEs first).
_ACCEPT_START = " ".join(("WITH " + fair.ADMIT).split())[:30]


def _prepared() -> dict[str, int]:
    """This session's prepared statements: the first words of each and its executions."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement, generic_plans + custom_plans FROM pg_prepared_statements")
        return {" ".join(s.split())[:30]: n for s, n in cursor.fetchall()}


def test_prepared__the_precheck_and_the_insert_are_prepared_once_per_connection(
    tmp_path, no_broker_publish
):
    for n in range(3):
        _accept(tmp_path, key=f"k{n}" if n else None)  # with and without a key: one statement
    prepared = _prepared()
    # ... and the commit fast path's confirm mark: on this idle system each acceptance sent its
    # own unit, so no pick ran (ADR 0021, "Sent at acceptance")
    assert prepared == {
        "SELECT (SELECT fingerprint FRO": 3,
        _ACCEPT_START: 3,
        "UPDATE conversion_outbox SET p": 3,
    }


def test_prepared__a_rollback_discards_them_and_the_next_acceptance_prepares_again(
    tmp_path, no_broker_publish
):
    """psycopg deallocates every prepared statement after a ROLLBACK (a DROP in it could have
    invalidated them); the statements are then prepared again, and a unique violation inside
    a prepared statement still becomes Django's IntegrityError with its constraint's name."""
    first = _accept(tmp_path, key="same")
    with pytest.raises(RuntimeError), transaction.atomic():
        ConversionJob.objects.filter(id=first).update(state="queued")
        raise RuntimeError("roll back")
    assert _prepared() == {}
    _accept(tmp_path)
    assert len(_prepared()) == 3  # the acceptance's two and the confirm mark of its unit

    with pytest.raises(IntegrityError) as conflict, transaction.atomic():
        with prepared_cursor() as cursor:
            cursor.execute(
                "INSERT INTO idempotency_record (tenant, key, fingerprint, job_id, created_at)"
                " VALUES (%(tenant)s, %(key)s, '', %(job)s, now())",
                {"tenant": "tenant-a", "key": "same", "job": first},
            )
    assert violated_constraint(conflict.value) == "idempotency_tenant_key"


def test_prepared__with_query_logging_on_the_statements_are_logged_with_their_parameters(
    tmp_path, no_broker_publish
):
    """Django's query log (DEBUG, CaptureQueriesContext) still sees both statements, each with
    its bound parameters (a server-side bound statement has no literal SQL to log)."""
    with CaptureQueriesContext(connection) as captured:
        _accept(tmp_path, key="logged")
    logged = [" ".join(str(q["sql"]).split()) for q in captured.captured_queries]
    assert any(q.startswith("SELECT (SELECT fingerprint FROM") for q in logged), logged
    assert any(q.startswith(_ACCEPT_START) for q in logged), logged
    assert any("logged" in q for q in logged), logged  # the key, with the statements' values
    # the insert runs in PostgreSQL's placeholders, and is logged as written, with its values
    assert any(q.startswith(_ACCEPT_START) and "'logged'" in q for q in logged), logged


def _raw(cursor) -> object:
    return cursor.cursor  # Django's CursorWrapper around psycopg's cursor


def test_prepared__one_cursor_is_kept_per_connection_and_replaced_when_it_reconnects():
    """The kept cursor serves every statement on its connection (its dumpers are found once);
    after Django closes and reopens the connection a new cursor serves the new one; a cursor
    still in use further up the stack is not shared: a nested one gets its own, and the outer
    one's result is intact."""
    with prepared_cursor() as first:
        first.execute("SELECT %(n)s::int", {"n": 1})
        assert first.fetchone() == (1,)
    with prepared_cursor() as again:
        assert _raw(again) is _raw(first)
        again.execute("SELECT %(a)s::int, %(b)s::text", {"a": 2, "b": "x"})
        with prepared_cursor() as inner:
            assert _raw(inner) is not _raw(again)
            inner.execute("SELECT %(n)s::int", {"n": 3})
            assert inner.fetchone() == (3,)
        assert _raw(inner).closed
        assert again.fetchone() == (2, "x")

    old = connection.connection
    connection.close()
    with prepared_cursor() as fresh:
        assert connection.connection is not old
        assert _raw(fresh) is not _raw(first)
        fresh.execute("SELECT %(n)s::int", {"n": 4})
        assert fresh.fetchone() == (4,)
    with prepared_cursor() as kept:
        assert _raw(kept) is _raw(fresh)


def test_prepared__a_positional_statement_runs_on_a_raw_cursor_kept_beside_the_other():
    """``positional``: each name one ``$n``, in the order it first appears; the raw cursor (a
    ``psycopg.RawCursor``) is kept per connection apart from the named one, and prepares the
    statement as the other does."""
    statement = positional("SELECT %(b)s::int + %(a)s::int, %(b)s::int AS positional_kept")
    assert statement.sql == "SELECT $1::int + $2::int, $1::int AS positional_kept"
    assert statement.names == ("b", "a")
    assert statement.params({"a": 2, "b": 5, "unused": 0}) == [5, 2]
    with prepared_cursor(raw=True) as cursor:
        assert isinstance(_raw(cursor), psycopg.RawCursor)
        cursor.execute(statement.sql, statement.params({"a": 2, "b": 5}))
        assert cursor.fetchone() == (7, 5)
    with prepared_cursor(raw=True) as again, prepared_cursor() as named:
        assert _raw(again) is _raw(cursor)
        assert _raw(named) is not _raw(again)
        again.execute(statement.sql, statement.params({"a": 1, "b": 1}))
        assert again.fetchone() == (2, 1)
    assert _prepared()["SELECT $1::int + $2::int, $1::"] == 2


@pytest.mark.parametrize("sql", ["SELECT %s", "SELECT 5 %% 2", "SELECT %(a)b::int[]"])
def test_prepared__positional_refuses_any_other_percent(sql):
    """The raw cursor sends the text as it is: a ``%`` that psycopg would have read is refused
    when the statement is made, not sent."""
    with pytest.raises(ValueError, match="only %"):
        positional(sql)


def test_prepared__the_kept_cursor_serves_the_next_statement_after_an_error(
    tmp_path, no_broker_publish
):
    first = _accept(tmp_path, key="twice")
    with prepared_cursor() as cursor:
        kept = _raw(cursor)
    with pytest.raises(IntegrityError):
        with prepared_cursor() as cursor:
            cursor.execute(
                "INSERT INTO idempotency_record (tenant, key, fingerprint, job_id, created_at)"
                " VALUES (%(tenant)s, %(key)s, '', %(job)s, now())",
                {"tenant": "tenant-a", "key": "twice", "job": first},
            )
    with prepared_cursor() as cursor:
        assert _raw(cursor) is kept
        cursor.execute(
            "SELECT count(*) FROM idempotency_record WHERE key = %(key)s", {"key": "twice"}
        )
        assert cursor.fetchone() == (1,)
    _accept(tmp_path, key="after")


_ARRAYS = {
    "i4": Int4s([1, -7, 2_147_483_647, None]),
    "i8": Int8s([0, 9_007_199_254_740_993, None]),
    "t": Texts(["page", "", "Zürich ✓", None]),
    "b": Byteas([b"\x00\xff\n", b"", None]),
    "e": Int4s([]),
}


def test_prepared__fixed_type_arrays_arrive_as_the_lists_they_are():
    """``Int4s``, ``Int8s``, ``Texts`` and ``Byteas`` (the publish's page arrays) are dumped
    by ``prepared.py``'s own binary dumpers: Postgres reads each element back as it was,
    NULLs, empty strings and bytes, non-ASCII text and an empty array included."""
    with prepared_cursor() as cursor:
        cursor.execute(
            "SELECT %(i4)b::int[], %(i8)b::bigint[], %(t)b::text[], %(b)b::bytea[],"
            " cardinality(%(e)b::int[])",
            _ARRAYS,
        )
        i4, i8, texts, blobs, empty = cursor.fetchone()
    assert i4 == [1, -7, 2_147_483_647, None]
    assert i8 == [0, 9_007_199_254_740_993, None]
    assert texts == ["page", "", "Zürich ✓", None]
    assert [bytes(b) if b is not None else None for b in blobs] == [b"\x00\xff\n", b"", None]
    assert empty == 0


def test_prepared__fixed_type_arrays_are_prepared_with_the_array_types():
    """The statement's parameter types are the arrays' own (``int4[]``, ``int8[]``,
    ``text[]``, ``bytea[]``) whatever the values: one prepared statement, never one per value
    size, as psycopg's list dumper could choose ``int2[]`` for small numbers."""
    sql = "SELECT cardinality(%(i4)b::int[]) + cardinality(%(i8)b::bigint[]) + 1 AS fixed_types"
    with prepared_cursor() as cursor:
        cursor.execute(sql, {"i4": Int4s([1]), "i8": Int8s([2])})
        cursor.execute(sql, {"i4": Int4s([70_000]), "i8": Int8s([1 << 40])})
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT parameter_types::text[] FROM pg_prepared_statements"
            " WHERE statement LIKE '%%AS fixed_types%%'"
        )
        assert cursor.fetchall() == [(["integer[]", "bigint[]"],)]


def test_prepared__fixed_type_arrays_are_logged_as_lists():
    """With query logging on, the statement is logged with the arrays rendered as array
    literals (the client-side rendering sees plain lists)."""
    with CaptureQueriesContext(connection) as captured, prepared_cursor() as cursor:
        cursor.execute("SELECT %(t)b::text[]", {"t": Texts(["a", "b"])})
    assert captured.captured_queries[-1]["sql"] == "SELECT '{a,b}'::text[]"
