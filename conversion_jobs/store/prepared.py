"""A cursor for the hot statements: parameters bound by the server, the statement prepared once
per connection (ADR 0017, "Session 5: one-page jobs, worker side").

Django's psycopg 3 backend binds every parameter on the client: psycopg renders each value into
the SQL text in Python, and Postgres then parses and plans a statement it has never seen. For
the claim and publish statements (a CTE over five tables, with a dozen to twenty parameters)
that was ≈ 15 % of a one-page job's task time in the worker and a parse + plan in Postgres per
job. This cursor sends the same text with ``$n`` placeholders and the values apart, so the
statement's text is the same for every job and psycopg prepares it on its first use on a
connection (``prepare_threshold``, ``settings.DATABASES["default"]["OPTIONS"]``: 0 here; ``None``
with ``QUIRE_DB_PREPARED_STATEMENTS=0``, for a pooler without prepared statements, still binds
on the server but parses every time).

Only statements whose every parameter has a type Postgres can infer use it (no ``%s`` in a
position where an ``unknown`` parameter is ambiguous): values in the audit hash are spliced as
``%(_litN)s::text`` parameters (``audit.spliced_sql``), never as SQL text, so the text stays the
same from job to job. The cursor is a Django ``CursorWrapper``: errors are Django's, execute
wrappers and query logging see it as any other cursor.

psycopg turns ``%(name)s`` into ``$n`` on every ``execute``, and keeps the result only for a
statement of at most 4,096 bytes and 50 parameters (its cache is meant for statements an ORM
made). A longer statement is split with a regular expression each time it runs: the
acceptance's, with fair dispatch's ``ADMIT`` in it (5.6 KB, 52 parameters), was ≈ 0.2-0.5 ms of
the web's CPU per acceptance (bench/JOURNAL.md, "Issue 23: the web's CPU per acceptance"). Such
a statement is turned into PostgreSQL's own placeholders once (:func:`positional`) and runs on a
``psycopg.RawCursor`` (``prepared_cursor(raw=True)``), which sends its text as it is.
"""

from __future__ import annotations

import functools
import re
import struct
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connections
from django.db.backends.utils import CursorDebugWrapper, CursorWrapper
from psycopg import RawCursor
from psycopg.adapt import Dumper
from psycopg.postgres import types
from psycopg.pq import Format


@functools.cache
def _postgres_parts() -> tuple[Any, Any, Any, Any]:
    """(ServerBindingCursor, register_tzloader, the timestamptz oid, text format), imported on
    first use: the module also loads where psycopg is not the backend (SQLite profile)."""
    # (function-level: Django's Postgres backend module, loaded only where it is the backend)
    from django.db.backends.postgresql.base import TIMESTAMPTZ_OID, ServerBindingCursor
    from django.db.backends.postgresql.psycopg_any import register_tzloader

    return ServerBindingCursor, register_tzloader, TIMESTAMPTZ_OID, Format.TEXT


@contextmanager
def prepared_cursor(*, raw: bool = False) -> Iterator[Any]:
    """A server-binding cursor on the default connection, as ``connection.cursor()`` would make
    it otherwise. On another database (SQLite, the standalone profile) Django's own cursor: the
    statements that run on both (the acceptance's) use only ``%(name)s`` placeholders.

    ``raw``: on Postgres a ``psycopg.RawCursor``, for a :class:`Positional` statement's
    ``sql`` and ``params()`` (kept apart from the other: one of each per connection)."""
    db: Any = connections[DEFAULT_DB_ALIAS]  # the proxy's every attribute is a thread-local lookup
    if db.vendor != "postgresql":
        with db.cursor() as cursor:
            yield cursor
        return
    db.close_if_health_check_failed()
    db.ensure_connection()
    db.validate_thread_sharing()
    slot = _RAW_SLOT if raw else _SLOT
    kept = _kept_cursor(db, slot)
    if kept is _BUSY:  # the kept one is in use further up this thread's stack: a cursor of its own
        cursor = _new_cursor(db, raw=raw)
    else:
        cursor = kept if kept is not None else _keep(db, slot, _new_cursor(db, raw=raw))
        setattr(db, slot.busy, True)
    wrapped = _logged_cursor_class()(cursor, db) if db.queries_logged else db.make_cursor(cursor)
    try:
        yield wrapped
    finally:
        if kept is _BUSY:
            with db.wrap_database_errors:
                cursor.close()
        else:
            setattr(db, slot.busy, False)


_BUSY = object()


@dataclass(frozen=True)
class _Slot:
    """Where a connection's kept cursor of one kind lives (attributes of Django's wrapper)."""

    kept: str
    busy: str


_SLOT = _Slot("_quire_prepared", "_quire_prepared_busy")
_RAW_SLOT = _Slot("_quire_prepared_raw", "_quire_prepared_raw_busy")


def _kept_cursor(db: Any, slot: _Slot = _SLOT) -> Any:
    """The cursor kept for this connection, ``_BUSY`` if it is in use, or None: none yet, or
    Django reconnected since (``DatabaseWrapper.connection`` is a new object), or the session's
    time zone changed. Keeping one cursor keeps psycopg's ``Transformer`` with it: the dumpers
    found for each parameter type by the first statement serve the next ones, instead of a
    lookup per parameter per statement (ADR 0017, session 6, branch ``accept2``). Django's
    connections are per thread, and so is the cursor."""
    kept = getattr(db, slot.kept, None)
    if kept is None:
        return None
    if getattr(db, slot.busy):
        return _BUSY
    connection, cursor, timezone = kept
    if connection is not db.connection or timezone is not db.timezone or cursor.closed:
        setattr(db, slot.kept, None)
        return None
    return cursor


def _keep(db: Any, slot: _Slot, cursor: Any) -> Any:
    setattr(db, slot.kept, (db.connection, cursor, db.timezone))
    setattr(db, slot.busy, False)
    return cursor


def _new_cursor(db: Any, *, raw: bool = False) -> Any:
    server_binding, register_tzloader, timestamptz, text = _postgres_parts()
    with db.wrap_database_errors:
        cursor = (RawCursor if raw else server_binding)(db.connection)
        for cls, dumper in _array_dumpers().items():
            cursor.adapters.register_dumper(cls, dumper)
        # As DatabaseWrapper.create_cursor: the session's time zone for timestamptz results.
        if db.timezone != db.connection.adapters.get_loader(timestamptz, text).timezone:
            register_tzloader(db.timezone, cursor)
    return cursor


@functools.cache
def _logged_cursor_class() -> Any:
    """Django's debug cursor (DEBUG, ``CaptureQueriesContext``) logs what psycopg says it sent,
    which for a server-bound statement is nothing (``None``). This one logs the statement with
    its values rendered as the client-side cursor would (binary ``%(x)b`` placeholders as text),
    so a logged hot statement reads, and runs under EXPLAIN, as any other logged query."""

    class LoggedServerBindingCursor(CursorDebugWrapper):  # type: ignore[misc]
        def execute(self, sql: Any, params: Any = None) -> Any:  # type: ignore[override]
            with self.debug_sql(_as_logged(self.db, sql, params), params):
                return CursorWrapper.execute(self, sql, params)

    return LoggedServerBindingCursor


def _as_logged(db: Any, sql: str, params: Any) -> str:
    sql, params = as_written(sql, params)  # a positional statement: its values by name
    try:
        return str(db.ops.compose_sql(_BINARY_PLACEHOLDER.sub(r"%(\1)s", sql), params))
    except Exception:  # a value the client-side rendering cannot show: the statement's text
        return sql


_BINARY_PLACEHOLDER = re.compile(r"%\((\w+)\)b")


# --- statements in PostgreSQL's own placeholders ---------------------------------------------


@dataclass(frozen=True)
class Positional:
    """A statement written with ``%(name)s`` placeholders, as PostgreSQL takes it: ``sql`` with
    ``$1``, ``$2``, ... (one per name, in the order each first appears), for a
    ``prepared_cursor(raw=True)``."""

    sql: str
    names: tuple[str, ...]
    #: the statement as written (the query log shows it, with its values)
    named: str

    def params(self, values: Mapping[str, Any]) -> list[Any]:
        """The values of ``names``, in order (a name missing from ``values`` is a KeyError)."""
        return [values[name] for name in self.names]


#: ``Positional`` statements by their ``sql``: the query log shows each as it was written.
_POSITIONAL: dict[str, Positional] = {}
_NAMED = re.compile(r"%\((\w+)\)s")


def as_written(sql: str, params: Any) -> tuple[str, Any]:
    """``sql`` and ``params`` as they were written: a :class:`Positional` statement's text with
    ``%(name)s`` and its values by name, anything else as it is (for the query log, and for
    whoever runs a captured statement again on a client-binding cursor, as EXPLAIN does)."""
    known = _POSITIONAL.get(sql)
    if known is None:
        return sql, params
    return known.named, dict(zip(known.names, params, strict=True))


def positional(statement: str) -> Positional:
    """``statement`` in PostgreSQL's placeholders; made once per statement by its caller (a
    module constant, or a ``functools.cache`` of the function that builds it). Only
    ``%(name)s`` placeholders: any other ``%`` (``%%``, ``%s``, ``%(name)b``) is refused, since
    the raw cursor would send it as it is."""
    names: dict[str, int] = {}

    def number(match: re.Match[str]) -> str:
        return f"${names.setdefault(match[1], len(names) + 1)}"

    sql = _NAMED.sub(number, statement)
    if "%" in sql:
        raise ValueError("positional(): only %(name)s placeholders, and no other '%'")
    made = Positional(sql=sql, names=tuple(names), named=statement)
    _POSITIONAL[sql] = made
    return made


# --- arrays with a fixed element type --------------------------------------------------------


class Int4s(list):  # type: ignore[type-arg]
    """An ``int4[]`` parameter of a statement run on ``prepared_cursor``: sent in binary by a
    dumper of its own, without psycopg's per-call search of a list's element type (which found
    its element's dumper, upgraded the list dumper and measured its dimensions for every array
    of every statement: ≈ 2.5 µs per array, 7 arrays per publish; ADR 0017, session 8).
    Elsewhere (the logged rendering, another cursor) it is a plain list."""


class Int8s(list):  # type: ignore[type-arg]
    """An ``int8[]`` parameter, as ``Int4s``."""


class Texts(list):  # type: ignore[type-arg]
    """A ``text[]`` parameter, as ``Int4s`` (``str`` elements, UTF-8)."""


class Byteas(list):  # type: ignore[type-arg]
    """A ``bytea[]`` parameter, as ``Int4s`` (``bytes`` elements, as they are)."""


_NULL = b"\xff\xff\xff\xff"  # an element of length -1
_HEAD = struct.Struct("!iiiii")  # ndim 1, has null, element oid, length, lower bound 1
_EMPTY = struct.Struct("!iii")  # ndim 0, no null, element oid
_LENGTH = struct.Struct("!i")
_INT4 = struct.Struct("!ii")
_INT8 = struct.Struct("!iq")


def _binary_array(element_oid: int, items: list[Any], element: Callable[[Any], bytes]) -> bytes:
    """Postgres's binary array format (``array_recv``), one dimension from 1."""
    if not items:
        return _EMPTY.pack(0, 0, element_oid)
    parts = [b""]
    has_null = 0
    for item in items:
        if item is None:
            parts.append(_NULL)
            has_null = 1
        else:
            parts.append(element(item))
    parts[0] = _HEAD.pack(1, has_null, element_oid, len(items), 1)
    return b"".join(parts)


def _int4(value: int) -> bytes:
    return _INT4.pack(4, value)


def _int8(value: int) -> bytes:
    return _INT8.pack(8, value)


def _text(value: str) -> bytes:
    data = value.encode()
    return _LENGTH.pack(len(data)) + data


def _bytea(value: bytes) -> bytes:
    return _LENGTH.pack(len(value)) + bytes(value)


@functools.cache
def _array_dumpers() -> dict[type, Any]:
    """The binary dumpers of ``Int4s``, ``Int8s``, ``Texts`` and ``Byteas`` (registered on each
    cursor ``prepared_cursor`` makes), with the array type's oid fixed: the statement's
    parameter types, hence its prepared plan, are the ones psycopg's list dumper gave them."""

    def dumper(cls: type, name: str, element: Callable[[Any], bytes]) -> Any:
        info = types[name]

        class ArrayDumper(Dumper):
            format = Format.BINARY
            oid = info.array_oid

            def dump(self, obj: Any) -> bytes:
                return _binary_array(info.oid, obj, element)

        ArrayDumper.__name__ = f"{cls.__name__}BinaryDumper"
        return ArrayDumper

    return {
        Int4s: dumper(Int4s, "int4", _int4),
        Int8s: dumper(Int8s, "int8", _int8),
        Texts: dumper(Texts, "text", _text),
        Byteas: dumper(Byteas, "bytea", _bytea),
    }


def id_batch(statement: str, ids: list[int], *, twin: Callable[[], int]) -> int:
    """``statement`` over the batch of row ids it binds as ``%(ids)s`` (an ``int8[]``), on a
    prepared cursor; on another database its ORM ``twin()``. Row count."""
    if connections[DEFAULT_DB_ALIAS].vendor != "postgresql":
        return twin()
    with prepared_cursor() as cursor:
        cursor.execute(statement, {"ids": Int8s(ids)})
        return int(cursor.rowcount)
