"""The web's per-request connection health check by socket (``db.health_check_by_socket``):
an idle open connection skips ``SELECT 1``; a backend the server ended is still caught and
replaced before the request's first query (a real second connection ends it)."""

from __future__ import annotations

import select

import pytest
from django.db import close_old_connections, connection, connections
from django.test.utils import CaptureQueriesContext

from conversion_jobs.store.db import health_check_by_socket

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


def _backend_pid() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        return int(cursor.fetchone()[0])


def _next_request() -> None:
    """What ``request_started`` does to the thread's connection, then the web's check."""
    close_old_connections()
    assert connection.health_check_enabled
    assert not connection.health_check_done
    health_check_by_socket(connection)


def test_health_check_by_socket__an_idle_open_connection_skips_select_1():
    pid = _backend_pid()
    _next_request()
    assert connection.health_check_done
    with CaptureQueriesContext(connection) as queries:
        assert _backend_pid() == pid
    assert [q["sql"] for q in queries] == ["SELECT pg_backend_pid()"]


def test_health_check_by_socket__a_terminated_backend_is_checked_and_replaced():
    pid = _backend_pid()
    other = connections.create_connection("default")
    try:
        with other.cursor() as cursor:
            cursor.execute("SELECT pg_terminate_backend(%s)", [pid])
    finally:
        other.close()
    # The server's FATAL notice and the close reach the socket.
    poller = select.poll()
    poller.register(connection.connection.fileno(), select.POLLIN)
    assert poller.poll(5000)
    _next_request()
    assert not connection.health_check_done  # Django's SELECT 1 decides, and fails
    assert _backend_pid() != pid  # the dead connection was replaced before the query


def test_health_check_by_socket__without_a_connection_does_nothing():
    connection.close()
    health_check_by_socket(connection)
    assert connection.connection is None
    assert _backend_pid() > 0
