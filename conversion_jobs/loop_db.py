"""A small pool of psycopg 3 ``AsyncConnection``s for the statements the web runs on its event
loop (the acceptance of a small upload, ADR 0017 "Session 11").

Django's connections are per thread and blocking; a statement awaited on the loop needs its
own. The pool holds up to ``QUIRE_WEB_LOOP_DB_CONNECTIONS`` (4) connections per web process,
opened on first use with the parameters and adapters Django's own connection uses (so a
statement and its parameters mean the same on both), in autocommit. A caller that finds every
connection busy waits on the loop. An idle connection is checked the way the sync requests'
are (``db.health_check_by_socket``): a readable socket means the server wrote a FATAL notice
(a restart, ``pg_terminate_backend``) and the connection is replaced; a connection left broken
or not idle (a statement cut short) is closed, never returned. Connections older than
``CONN_MAX_AGE`` are replaced. After a failed connect the pool refuses for ``DOWN_HOLD_S``
without trying.

The pool belongs to one event loop (the server's, for the life of the process); used from
another loop it drops the connections of the previous one.
"""

from __future__ import annotations

import asyncio
import select
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import psycopg
from django.conf import settings
from django.db import connections
from psycopg.pq import TransactionStatus

#: After a failed connect, the pool refuses at once for this long (its caller hands the
#: request to the sync path, which has its own connect timeout): an outage costs one
#: connect timeout per second per process on the loop, not one per request.
DOWN_HOLD_S = 1.0


def _params() -> dict[str, Any]:
    """Django's connection parameters for the default database (Postgres), for an async
    connection: the same options and adapters (``context``), prepared-statement threshold and
    timeouts; psycopg's default async cursor (server-side binding, as ``prepared_cursor``)."""
    params = dict(connections["default"].get_connection_params())
    params.pop("cursor_factory", None)
    params["autocommit"] = True
    params.setdefault("application_name", "quire-web-loop")
    return params


class LoopPool:
    def __init__(self, *, size: int) -> None:
        self.size = max(1, size)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._idle: list[tuple[float, Any]] = []  # (opened at, connection)
        self._slots: asyncio.Semaphore | None = None
        self._max_age: float | None = settings.DATABASES["default"].get("CONN_MAX_AGE")
        self._down_until = 0.0

    def _bind(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if self._loop is not loop or self._slots is None:
            for _, conn in self._idle:  # another loop's: it cannot be awaited from here
                conn.pgconn.finish()
            self._idle, self._loop = [], loop
            self._slots = asyncio.Semaphore(self.size)
        return self._slots

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[Any]:
        """A connection for one statement (autocommit). Raises what connecting raises
        (``psycopg.OperationalError``: the database is unreachable)."""
        async with self._bind():
            opened, conn = self._take()
            if conn is None:
                opened = time.monotonic()
                if opened < self._down_until:  # failed just now: do not wait out another
                    raise psycopg.OperationalError("the database was unreachable just now")
                try:
                    conn = await psycopg.AsyncConnection.connect(**_params())
                except psycopg.Error:
                    self._down_until = time.monotonic() + DOWN_HOLD_S
                    raise
            try:
                yield conn
            finally:
                # Kept whatever the caller raised if the connection is idle and sound (a
                # constraint's error leaves it so in autocommit); a statement cut short (a
                # lost connection, a cancellation) does not.
                if self._reusable(opened, conn):
                    self._idle.append((opened, conn))
                else:
                    await conn.close()

    def _take(self) -> tuple[float, Any]:
        while self._idle:
            opened, conn = self._idle.pop()
            if self._reusable(opened, conn) and not _readable(conn):
                return opened, conn
            conn.pgconn.finish()
        return 0.0, None

    def _reusable(self, opened: float, conn: Any) -> bool:
        if conn.closed or conn.broken or conn.info.transaction_status != TransactionStatus.IDLE:
            return False
        return self._max_age is None or time.monotonic() - opened < self._max_age

    async def aclose(self) -> None:
        """Close the idle connections (a process or a test ending; on the pool's loop)."""
        idle, self._idle = self._idle, []
        for _, conn in idle:
            await conn.close()


def kept_cursor(conn: Any) -> Any:
    """The cursor kept with a pooled connection (which has one user at a time: the pool's), as
    ``prepared.prepared_cursor`` keeps one per Django connection: its ``Transformer`` keeps the
    dumpers found for the parameters' types by the first statement, instead of a new cursor's
    adapters map and lookups per statement."""
    kept = getattr(conn, "_quire_cursor", None)
    if kept is None or kept.closed:
        kept = conn.cursor()
        conn._quire_cursor = kept
    return kept


def _readable(conn: Any) -> bool:
    """Whether the idle connection's socket has something to read: a FATAL notice before the
    server closed it, or anything else unexpected (``db.health_check_by_socket``'s rule)."""
    poller = select.poll()
    poller.register(conn.fileno(), select.POLLIN | select.POLLPRI)
    return bool(poller.poll(0))


_pool: LoopPool | None = None


def pool() -> LoopPool:
    """This process's pool (created on first use)."""
    global _pool
    if _pool is None:
        _pool = LoopPool(size=settings.QUIRE["WEB_LOOP_DB_CONNECTIONS"])
    return _pool
