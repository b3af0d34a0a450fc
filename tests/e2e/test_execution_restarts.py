"""e2e: the broker and the database restart under load; every accepted job ends exactly once.

The Procfile's web, workers, sweeper and beat run against a private RabbitMQ node and a private
Postgres cluster (tests/e2e/private_services.py), which this test restarts: the shared services
on 5672 / 5432, which every other suite (and, on a development machine, other checkouts) uses,
are never stopped.
"""

from __future__ import annotations

import subprocess

import psycopg
import pytest

from tests.e2e import harness
from tests.e2e.private_services import PrivatePostgres, PrivateRabbitMQ
from tests.e2e.webproc import Web, start_web

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

TERMINAL = {"succeeded", "partial", "failed", "cancelled"}
SLOW = {"kind": "slow", "seconds": 0.4}


def roles(node: PrivateRabbitMQ, pg: PrivatePostgres, kind: str) -> dict[str, str]:
    """Role credentials for ``kind`` on the private node (see conftest.role_env), and the
    private database."""
    return {
        "CELERY_BROKER_URL": node.url("worker" if kind in ("worker", "sweeper") else "publisher"),
        "QUIRE_BROKER_PUBLISHER_URL": node.url("publisher"),
        "QUIRE_BROKER_WORKER_URL": node.url("worker"),
        "DATABASE_URL": pg.url("quire"),
    }


def sql(pg: PrivatePostgres, query: str, *args: object) -> list[tuple]:
    with psycopg.connect(pg.url("quire"), connect_timeout=3, autocommit=True) as conn:
        return conn.execute(query, args).fetchall()


def states(pg: PrivatePostgres, ids: list[str]) -> dict[str, str]:
    rows = sql(pg, "SELECT id::text, state FROM conversion_job WHERE id::text = ANY(%s)", ids)
    return dict(rows)


def accepted(web: Web) -> str:
    response = web.submit(pages=4, options={"_test_fault": SLOW})
    assert response.status_code == 202, response.text
    return str(response.json()["id"])


def test_restarts__rabbitmq_and_postgres_restarted_under_load_lose_and_duplicate_nothing(
    cluster, rabbitmq_node, private_postgres
):
    node, pg = rabbitmq_node, private_postgres
    for command in (["migrate", "--noinput", "-v0"], ["install_beat_schedule"]):
        subprocess.run(
            [str(harness.VENV_BIN / "python"), "manage.py", *command],
            cwd=harness.REPO,
            env={**cluster.env, "DATABASE_URL": pg.url("quire")},
            check=True,
            capture_output=True,
            timeout=300,
        )
    web = start_web(cluster, **roles(node, pg, "web"))
    for _ in range(2):
        cluster.ready(cluster.worker(**roles(node, pg, "worker")))
    cluster.sweeper(**roles(node, pg, "sweeper"))
    cluster.beat(**roles(node, pg, "beat"))

    ids = [accepted(web) for _ in range(6)]
    harness.wait_until(
        lambda: "running" in states(pg, ids).values(), timeout=30, what="a running job"
    )
    node.stop_app()
    node.start_app()

    ids += [accepted(web) for _ in range(3)]
    harness.wait_until(
        lambda: "running" in states(pg, ids).values(),
        timeout=60,
        what="running after broker restart",
    )
    pg.stop_server()
    pg.start_server()

    harness.wait_until(
        lambda: set(states(pg, ids).values()) <= TERMINAL,
        timeout=150,
        interval=0.5,
        what="every job terminal",
    )
    final = states(pg, ids)
    assert set(final.values()) == {"succeeded"}, final
    assert len(final) == len(ids)
    for job_id in ids:
        published = sql(
            pg,
            "SELECT count(*) FROM execution_audit_event "
            "WHERE job_id = %s AND event_type = 'published'",
            job_id,
        )
        assert published == [(1,)], job_id
        succeeded = sql(
            pg,
            "SELECT count(*) FROM conversion_attempt WHERE job_id = %s AND outcome = 'succeeded'",
            job_id,
        )
        assert succeeded == [(1,)], job_id
