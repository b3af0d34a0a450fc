"""e2e smoke of the standalone profile (no servers): SQLite + kombu filesystem transport, real
worker / sweeper / beat processes, including recovery of a job whose worker was killed (-9).

Independent of the pytest-django database and of RabbitMQ: it runs in both CI passes.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
from pathlib import Path

import pytest

from tests.e2e import harness

pytestmark = pytest.mark.e2e

SUBMIT = """
import hashlib, shutil
from conversion_jobs import storage
from conversion_jobs.services.acceptance import StagedUpload, conversion_job_accept
src = {src!r}
fh, staged = storage.stage()
with fh, open(src, "rb") as data:
    shutil.copyfileobj(data, fh)
raw = open(src, "rb").read()
job = conversion_job_accept(
    tenant="tenant-a", actor="e2e", output="text", raw_options={options!r}, idempotency_key=None,
    upload=StagedUpload(path=staged, sha256=hashlib.sha256(raw).hexdigest(), size=len(raw)),
).job
print("JOB", job.id.hex)
"""


@pytest.fixture
def standalone(tmp_path: Path):
    env = harness.process_env(QUIRE_VAR_DIR=str(tmp_path / "var"))
    manage = [str(harness.VENV_BIN / "python"), str(harness.REPO / "manage.py")]

    def run(*args: str) -> str:
        proc = subprocess.run(
            [*manage, *args],
            env=env,
            cwd=harness.REPO,
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout

    run("migrate", "--noinput")
    run("install_beat_schedule")
    logs = tmp_path / "logs"
    logs.mkdir()
    cluster = harness.Cluster(log_dir=logs, env=env)
    cluster.run = run  # type: ignore[attr-defined]
    cluster.db = tmp_path / "var" / "quire.sqlite3"  # type: ignore[attr-defined]
    yield cluster
    cluster.stop_all()
    print(cluster.tails())


def _query(db: Path, sql: str, *params: object) -> list[tuple]:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
    try:
        return conn.execute(sql, params).fetchall()
    finally:
        conn.close()


def _submit(cluster, tmp_path: Path, *, pages: int, options: dict) -> str:
    from tests import testdocs

    src = tmp_path / f"doc-{pages}-{len(os.listdir(tmp_path))}.pdf"
    testdocs.make_pdf(src, pages=pages, text_of=lambda n: f"Page {n} {src.name}")
    out = cluster.run("shell", "-c", SUBMIT.format(src=str(src), options=options))
    return next(line.split()[1] for line in out.splitlines() if line.startswith("JOB "))


def test_standalone__pipeline_runs_end_to_end_and_recovers_a_killed_worker(standalone, tmp_path):
    db = standalone.db
    worker = standalone.ready(standalone.worker())
    standalone.sweeper()
    standalone.beat()

    def state(job_id: str) -> str:
        return _query(db, "SELECT state FROM conversion_job WHERE id = ?", job_id)[0][0]

    quick = _submit(standalone, tmp_path, pages=2, options={})
    harness.wait_until(
        lambda: state(quick) == "succeeded", timeout=40, what="standalone job succeeded"
    )

    slow = _submit(
        standalone, tmp_path, pages=6, options={"_test_fault": {"kind": "slow", "seconds": 0.6}}
    )
    harness.wait_until(
        lambda: (
            _query(
                db, "SELECT count(*) FROM page_checkpoint WHERE job_id = ? AND state = 'done'", slow
            )[0][0]
            >= 1
        ),
        timeout=40,
        what="a checkpointed page",
    )
    worker.kill9()
    standalone.ready(standalone.worker())
    harness.wait_until(
        lambda: state(slow) == "succeeded", timeout=60, what="recovered standalone job"
    )
    outcomes = _query(
        db, "SELECT generation, outcome FROM conversion_attempt WHERE job_id = ? ORDER BY id", slow
    )
    assert outcomes == [(1, "lease_lost"), (2, "succeeded")]
    published = _query(
        db,
        "SELECT count(*) FROM execution_audit_event WHERE job_id = ? AND event_type = 'published'",
        slow,
    )
    assert published == [(1,)]


def test_standalone__web_long_polls_and_event_stream_fall_back_to_async_polling(
    standalone, tmp_path
):
    """SQLite has no LISTEN/NOTIFY: waiting clients poll on the event loop instead - still no
    thread per client (50 parked long-polls leave /health/live answering), and still woken."""
    import asyncio
    import json
    import time
    import uuid

    import requests

    web = standalone.web()
    base = f"http://127.0.0.1:{web.port}"
    token = standalone.run(
        "mint_token", "--tenant", "tenant-a", "--scope", "jobs:read jobs:submit"
    ).strip()
    job_id = str(uuid.UUID(_submit(standalone, tmp_path, pages=3, options={})))
    etag = requests.get(
        f"{base}/api/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {token}"}, timeout=10
    ).headers["ETag"]  # the current representation's: the long-polls park

    async def parked_and_probed() -> tuple[list[int], float]:
        async def long_poll() -> int:
            reader, writer = await asyncio.open_connection("127.0.0.1", web.port)
            writer.write(
                f"GET /api/v1/jobs/{job_id}?wait=4 HTTP/1.1\r\nHost: x\r\n"
                f"Authorization: Bearer {token}\r\nIf-None-Match: {etag}\r\n\r\n".encode()
            )
            head = await reader.readuntil(b"\r\n\r\n")
            writer.close()
            return int(head.split()[1])

        polls = [asyncio.create_task(long_poll()) for _ in range(50)]
        await asyncio.sleep(1.5)
        started = time.perf_counter()
        await asyncio.to_thread(requests.get, f"{base}/health/live", timeout=10)
        probe = time.perf_counter() - started
        return list(await asyncio.gather(*polls)), probe

    statuses, probe = asyncio.run(parked_and_probed())
    assert statuses == [304] * 50
    assert probe < 1.0

    standalone.ready(standalone.worker())
    standalone.sweeper()
    standalone.beat()
    with requests.get(
        f"{base}/api/v1/jobs/{job_id}/events",
        headers={"Authorization": f"Bearer {token}", "Accept": "text/event-stream"},
        stream=True,
        timeout=90,
    ) as response:
        data = [
            json.loads(line[len("data:") :])
            for line in response.iter_lines(decode_unicode=True)
            if line.startswith("data:")
        ]
    assert data[-1]["state"] == "succeeded"
    assert data[-1]["pages"] == {"total": 3, "done": 3, "failed": 0}
