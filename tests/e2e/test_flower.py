"""e2e: Flower from the Procfile, as the least-privilege monitor user, with basic auth and the
management API, sees a real worker and a finished conversion task; no secret is on its command
line and its /metrics is behind the same basic auth (issue 10 §4)."""

from __future__ import annotations

import base64
import json
import socket
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from conversion_jobs.models import ConversionJob
from tests.e2e import harness

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

MONITOR = ("quire_monitor", "quire-monitor-dev")
AUTH = ("operator", "flower-test-password")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _get(port: int, path: str, auth: tuple[str, str] | None = AUTH) -> tuple[int, object]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}")
    if auth:
        token = base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()
        req.add_header("Authorization", f"Basic {token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:  # noqa: S310
            body = resp.read()
            return resp.status, json.loads(body) if body.startswith((b"{", b"[")) else body
    except urllib.error.HTTPError as exc:
        return exc.code, None


def _cmdlines(pid: int) -> list[str]:
    """The command line of ``pid`` and of every descendant, as ``ps`` shows them."""
    tree = harness._children()
    pending, seen = [pid], []
    while pending:
        current = pending.pop()
        try:
            seen.append(Path(f"/proc/{current}/cmdline").read_bytes().replace(b"\0", b" ").decode())
        except OSError:
            continue
        pending.extend(tree.get(current, []))
    return seen


def test_flower__sees_worker_and_finished_task_behind_basic_auth(cluster, start, submit, tmp_path):
    port = _free_port()
    user, password = MONITOR
    flower = cluster.start(
        "flower",
        # The publisher's URL as the default broker: only the monitor URL below can read events,
        # so a Flower that sees the worker proves it connected as the monitor user.
        CELERY_BROKER_URL=harness.broker_url("publisher"),
        QUIRE_BROKER_MONITOR_URL=f"amqp://{user}:{password}@127.0.0.1:5672/{harness.VHOST}",
        FLOWER_PORT=str(port),
        FLOWER_BASIC_AUTH=f"{AUTH[0]}:{AUTH[1]}",
        FLOWER_BROKER_API=f"http://{user}:{password}@127.0.0.1:15672/api/",
        QUIRE_VAR_DIR=str(tmp_path),
    )

    def up() -> bool:
        try:
            return _get(port, "/healthcheck", auth=None)[0] == 200
        except OSError:
            return False

    harness.wait_until(up, timeout=30, what="flower to listen")
    assert _get(port, "/api/workers", auth=None)[0] == 401
    assert _get(port, "/api/workers", auth=(AUTH[0], "wrong"))[0] == 401

    cmdlines = _cmdlines(flower.popen.pid)
    assert any("flower" in c for c in cmdlines), cmdlines
    for secret in (AUTH[1], password):
        assert not any(secret in c for c in cmdlines), cmdlines

    assert _get(port, "/metrics", auth=None)[0] == 401
    assert _get(port, "/metrics", auth=(AUTH[0], "wrong"))[0] == 401
    status, metrics = _get(port, "/metrics")
    assert status == 200
    assert isinstance(metrics, bytes) and b"flower_" in metrics

    worker = start("worker")
    job = submit(pages=2)
    harness.wait_until(
        lambda: ConversionJob.objects.get(id=job.id).state == "succeeded", timeout=60, what="job"
    )

    def worker_seen() -> bool:
        status, workers = _get(port, "/api/workers?refresh=1")
        return (
            status == 200
            and isinstance(workers, dict)
            and any("@worker." in name for name in workers)
        )

    harness.wait_until(worker_seen, timeout=30, what="flower to list the worker")

    def task_seen() -> bool:
        status, tasks = _get(port, "/api/tasks")
        return (
            status == 200
            and isinstance(tasks, dict)
            and any(
                t.get("name") == "tasks.conversion.run_conversion"
                and t.get("state") == "SUCCESS"
                and str(job.id) in str(t.get("args"))
                for t in tasks.values()
            )
        )

    harness.wait_until(task_seen, timeout=30, what="flower to show the finished task")
    assert worker.popen.poll() is None


def _worker_channels() -> list[tuple[str, bool]]:
    """(connection name, in confirm mode) of every channel the worker user has open."""
    out = harness.rabbitmqctl(
        "list_channels", "-p", harness.VHOST, "user", "confirm", "connection", "--no-table-headers"
    )
    rows = [line.split("\t") for line in out.splitlines() if line.strip()]
    return [(row[2], row[1] == "true") for row in rows if row[0] == harness.USERS["worker"][0]]


def test_worker_events__published_without_confirms(cluster, start, submit):
    """The worker's task events (``-E``, what Flower shows) go out on a channel without
    publisher confirms: a confirm per event stopped the consumer's event loop for a broker
    round trip three times per job (ADR 0017, session 8). The events still arrive: the test
    above sees the finished task in Flower."""
    start("worker")
    job = submit(pages=1)
    harness.wait_until(
        lambda: ConversionJob.objects.get(id=job.id).state == "succeeded", timeout=60, what="job"
    )
    channels = _worker_channels()
    assert channels
    assert not any(confirm for _, confirm in channels), channels
