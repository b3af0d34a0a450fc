"""e2e: Postgres goes away and comes back; nothing else is restarted.

The Procfile's web, worker, sweeper and beat run against a private Postgres cluster
(tests/e2e/private_services.py) and the shared broker. While the cluster is stopped, every
submission and every read answers ``503 database_unavailable`` (problem+json, Retry-After) and
stores nothing; /health/ready is 503. Once it is back, everything carries on by itself: the job
that was running across the outage finishes, a job submitted afterwards succeeds, the sweeps run
again and /health/ready is 200.
"""

from __future__ import annotations

import subprocess
import time
import uuid
from pathlib import Path

import psycopg
import pytest

from tests.e2e import harness
from tests.e2e.conftest import role_env
from tests.e2e.private_services import PrivatePostgres
from tests.e2e.webproc import Web, start_web

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

OUTAGE_S = 10.0
SLOW = {"kind": "slow", "seconds": 0.4}


def sql(pg: PrivatePostgres, query: str, *args: object) -> list[tuple]:
    with psycopg.connect(pg.url("quire"), connect_timeout=3, autocommit=True) as conn:
        return conn.execute(query, args).fetchall()


def job_state(pg: PrivatePostgres, job_id: str) -> str | None:
    rows = sql(pg, "SELECT state FROM conversion_job WHERE id = %s", job_id)
    return rows[0][0] if rows else None


def uploads_kept(env: dict[str, str]) -> set[str]:
    """Every staged upload and every promoted source in the artifact store."""
    root = Path(env["QUIRE_STORAGE_DIR"])
    return {
        str(path)
        for sub in ("staging", "sources")
        for path in (root / sub).rglob("*")
        if path.is_file()
    }


def answers_503(response) -> bool:
    assert response.status_code == 503, (response.status_code, response.text[:300])
    assert response.headers["Content-Type"].startswith("application/problem+json")
    assert response.json()["code"] == "database_unavailable", response.text
    assert int(response.headers["Retry-After"]) > 0
    return True


def test_database_outage__503_while_down_and_every_process_carries_on_after(
    cluster, private_postgres
):
    pg = private_postgres
    db = {"DATABASE_URL": pg.url("quire")}
    for command in (["migrate", "--noinput", "-v0"], ["install_beat_schedule"]):
        subprocess.run(
            [str(harness.VENV_BIN / "python"), "manage.py", *command],
            cwd=harness.REPO,
            env={**cluster.env, **db},
            check=True,
            capture_output=True,
            timeout=300,
        )
    web: Web = start_web(cluster, **role_env("web"), **db)
    workers = [cluster.ready(cluster.worker(**role_env("worker"), **db)) for _ in range(2)]
    sweeper = cluster.sweeper(**role_env("sweeper"), **db)
    beat = cluster.beat(**role_env("beat"), **db)
    harness.wait_until(
        lambda: (
            web.ready().status_code == 200
            and not sql(
                pg, "SELECT 1 FROM sweep_status WHERE interval_s < 1 AND last_success_at IS NULL"
            )
        ),
        timeout=60,
        what="/health/ready 200 and the one-tick sweeps running",
    )
    done = web.submit()
    assert done.status_code == 202
    done_id = done.json()["id"]
    harness.wait_until(lambda: job_state(pg, done_id) == "succeeded", timeout=30, what="a job")
    across = web.submit(pages=24, options={"_test_fault": SLOW}).json()["id"]
    harness.wait_until(lambda: job_state(pg, across) == "running", timeout=30, what="running")
    before = uploads_kept(cluster.env)

    # --- the outage -------------------------------------------------------------------------
    pg.stop_server()
    down_at = time.monotonic()
    probes = 0
    while time.monotonic() - down_at < OUTAGE_S:
        answers_503(web.submit())
        answers_503(web.submit(pages=2, idempotency_key=uuid.uuid4().hex))
        answers_503(web.get("/api/v1/jobs"))
        for path in ("", "/result", "/pages", "/pages/1"):
            answers_503(web.get(f"/api/v1/jobs/{done_id}{path}"))
        answers_503(web.get(f"/api/v1/jobs/{uuid.uuid4()}"))
        answers_503(web.metrics())  # a plain Django view: the middleware answers
        assert web.ready().status_code == 503
        probes += 1
        time.sleep(0.2)
    # Nothing was stored: no staged upload left, no source promoted.
    assert uploads_kept(cluster.env) == before, "an upload during the outage left a file"
    pg.start_server()
    back_at = time.monotonic()

    # --- after the outage: everything carries on by itself ----------------------------------
    fresh = harness.wait_until(
        lambda: (r := web.submit()).status_code == 202 and r, timeout=30, what="a 202 again"
    )
    first_202_s = time.monotonic() - back_at
    harness.wait_until(
        lambda: job_state(pg, fresh.json()["id"]) == "succeeded",
        timeout=60,
        what="the job submitted after the outage succeeded",
    )
    harness.wait_until(
        lambda: job_state(pg, across) == "succeeded",
        timeout=90,
        what="the job running across the outage finished",
    )
    succeeded = sql(
        pg,
        "SELECT count(*) FROM conversion_attempt WHERE job_id = %s AND outcome = 'succeeded'",
        across,
    )
    assert succeeded == [(1,)]
    assert web.get(f"/api/v1/jobs/{done_id}").status_code == 200
    harness.wait_until(
        lambda: web.ready().status_code == 200, timeout=30, what="/health/ready 200 again"
    )
    # every sweep on the (test) tick ran again lately: four since the page ranges' sweep
    assert sql(
        pg,
        "SELECT count(*) FILTER (WHERE last_success_at > now() - interval '5 seconds'), "
        "count(*) FROM sweep_status WHERE interval_s < 1",
    ) == [(4, 4)], "the sweeps run again (beat and the sweeper carried on)"
    for proc in (web.proc, *workers, sweeper, beat):
        assert proc.popen.poll() is None, f"{proc.name} exited:\n{proc.tail()}"
    print(f"outage {OUTAGE_S:g}s with {probes} rounds of 503s; first 202 {first_202_s:.1f}s after")
