"""LISTEN / NOTIFY: the channels that wake a process instead of a poll (Postgres; the
standalone profile has neither, and its processes poll): ``quire_job_change`` (the web's
long-polls, trigger of migration 0007) and ``quire_webhook`` (the notifier)."""

from __future__ import annotations

from typing import Any

import psycopg
from django.conf import settings
from django.db import connection
from psycopg.conninfo import make_conninfo

from conversion_jobs.store import db


def notifies() -> bool:
    """Whether this database delivers notifications (else its listeners poll)."""
    return db.postgres()


def notify(channel: str) -> int:
    """``pg_notify(channel, '')``, delivered when the caller's transaction commits. Row count:
    1 sent, 0 where nothing listens (SQLite)."""
    if not notifies():
        return 0
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_notify(%s, '')", [channel])
    return 1


def listen_sql(channel: str) -> str:
    """The ``LISTEN`` of a channel (a name of this module's callers, never user input)."""
    if not channel.replace("_", "").isalnum():
        raise ValueError("a channel is a plain identifier")
    return f"LISTEN {channel}"


def conninfo(**extra: Any) -> str:
    """The default database's connection string, for a listening connection of its own (Django's
    connections are per thread and in transactions); ``extra``: further libpq parameters."""
    db_settings = settings.DATABASES["default"]
    params: dict[str, Any] = {
        "dbname": db_settings.get("NAME") or None,
        "user": db_settings.get("USER") or None,
        "password": db_settings.get("PASSWORD") or None,
        "host": db_settings.get("HOST") or None,
        "port": str(db_settings["PORT"]) if db_settings.get("PORT") else None,
        **extra,
    }
    return make_conninfo(**{k: v for k, v in params.items() if v is not None})


def listen_connection(channel: str) -> psycopg.Connection[Any] | None:
    """A connection of its own, in autocommit, listening on ``channel``; None where nothing is
    delivered (SQLite)."""
    if not notifies():
        return None
    conn = psycopg.connect(conninfo(), autocommit=True)
    conn.execute(listen_sql(channel))  # type: ignore[arg-type]
    return conn


def ping() -> None:
    """``SELECT 1``: the database answers (raises otherwise)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
