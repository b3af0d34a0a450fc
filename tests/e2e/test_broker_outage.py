"""e2e: the broker goes away for 15 s or more and comes back; nothing else is restarted.

The Procfile's web, worker, sweeper and beat run against a private RabbitMQ node
(tests/e2e/private_services.py), which is stopped with ``rabbitmqctl stop_app`` and started
again. Every process has to reconnect by itself (ADR 0015): submissions during the outage are
accepted (or refused with a 503 and Retry-After, never a 500), a retry timer and an expired lease
that fell due during the outage are acted on once the broker is back, every job accepted
succeeds within 30 s of the broker's return with exactly one succeeded attempt, and
/health/ready says 503 while the sweeps are overdue and 200 again afterwards.
"""

from __future__ import annotations

import time
from datetime import datetime

import pytest
import requests
from django.db import connection

from conversion_jobs.models import (
    ConversionAttempt,
    ConversionJob,
    ConversionOutbox,
    SweepStatus,
    WorkerLease,
)
from tests.e2e import harness
from tests.e2e.private_services import PrivateRabbitMQ, free_port
from tests.e2e.webproc import start_web

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

MONITOR = ("quire_monitor", "quire-monitor-dev")
OUTAGE_S = 15.0
RECOVERY_BUDGET_S = 30.0
SLOW = {"kind": "slow", "seconds": 0.4}
#: A retry delay of 10-20 s (base 20 s, jitter [c/2, c]): it falls due inside the outage.
RETRY_BASE_S = "20"


def on_node(node: PrivateRabbitMQ, kind: str) -> dict[str, str]:
    """Role credentials for ``kind``, on the private node (see conftest.role_env)."""
    return {
        "CELERY_BROKER_URL": node.url("worker" if kind in ("worker", "sweeper") else "publisher"),
        "QUIRE_BROKER_PUBLISHER_URL": node.url("publisher"),
        "QUIRE_BROKER_WORKER_URL": node.url("worker"),
        "QUIRE_BACKOFF_BASE_S": RETRY_BASE_S,
    }


def db_now() -> datetime:
    connection.close_if_unusable_or_obsolete()
    with connection.cursor() as cursor:
        cursor.execute("SELECT now()")
        return cursor.fetchone()[0]


def states(ids) -> dict:
    connection.close_if_unusable_or_obsolete()
    return dict(ConversionJob.objects.filter(id__in=ids).values_list("id", "state"))


def start_flower(cluster, node: PrivateRabbitMQ, tmp_path) -> tuple[harness.Proc, int]:
    """The Procfile's flower as the monitor user, with the node's management API."""
    user, password = MONITOR
    port = free_port()
    proc = cluster.start(
        "flower",
        CELERY_BROKER_URL=f"amqp://{user}:{password}@127.0.0.1:{node.port}/{harness.VHOST}",
        FLOWER_PORT=str(port),
        FLOWER_BASIC_AUTH="operator:flower-test-password",
        FLOWER_BROKER_API=f"http://{user}:{password}@127.0.0.1:{node.mgmt_port}/api/",
        QUIRE_VAR_DIR=str(tmp_path),
    )
    return proc, port


def flower_saw_success(port: int, job_id: str) -> bool:
    """Flower lists a succeeded ``run_conversion`` of ``job_id`` (from the workers' events)."""
    tasks = requests.get(
        f"http://127.0.0.1:{port}/api/tasks",
        auth=("operator", "flower-test-password"),
        timeout=5,
    ).json()
    return any(t.get("state") == "SUCCESS" and job_id in str(t.get("args")) for t in tasks.values())


def flower_shows_a_new_task(web, port: int, *, timeout: float, what: str) -> None:
    """Submit jobs until Flower lists one of them succeeded.

    Flower sees only the events sent while its capture has a queue bound to the ``celeryev``
    exchange: a topic exchange drops the events of a task that ran before (Flower's start, or its
    reconnect after an outage), and ``args`` come only with ``task-received``. So one job
    submitted before the capture is bound is never shown, however long the wait; each new job
    is a fresh chance once it is.
    """

    def one_job_shown() -> bool:
        job_id = web.submit().json()["id"]
        return bool(
            harness.wait_until(
                lambda: flower_saw_success(port, job_id) or None,
                timeout=10,
                what="",
            )
        )

    harness.wait_until(one_job_shown, timeout=timeout, interval=0, what=what)


def test_broker_outage__every_process_reconnects_and_every_accepted_job_succeeds(
    cluster, rabbitmq_node, tmp_path
):
    node = rabbitmq_node
    web = start_web(cluster, **on_node(node, "web"))
    workers = [cluster.ready(cluster.worker(**on_node(node, "worker"))) for _ in range(3)]
    cluster.sweeper(**on_node(node, "sweeper"))
    beat = cluster.beat(**on_node(node, "beat"))
    flower = start_flower(cluster, node, tmp_path)
    harness.wait_until(
        lambda: (
            web.ready().status_code == 200
            and not SweepStatus.objects.filter(interval_s__lt=1, last_success_at=None).exists()
        ),
        timeout=60,
        what="/health/ready 200 and the one-tick sweeps running",
    )
    # Flower captures events before the outage (so seeing one after it means it reconnected).
    # Before the retry and long jobs: their timer and lease must fall due during the outage.
    flower_shows_a_new_task(
        web, flower[1], timeout=60, what="flower to show a task run before the outage"
    )

    # A job whose retry timer will fall due during the outage, and a long job whose worker dies
    # during it (its lease expires while nothing can be published).
    retry_job = web.submit(
        pages=2, options={"_test_fault": {"kind": "segv", "page": 2, "until_attempt": 1}}
    ).json()["id"]
    long_job = web.submit(pages=30, options={"_test_fault": SLOW}).json()["id"]
    timer = harness.wait_until(
        lambda: (
            ConversionJob.objects.filter(id=retry_job, state="retry_wait")
            .values_list("next_attempt_at", flat=True)
            .first()
        ),
        timeout=60,
        what="the retry job waiting on its timer",
    )
    running = harness.wait_until(
        lambda: (
            ConversionAttempt.objects.filter(job_id=long_job, finished_at__isnull=True)
            .values_list("worker", flat=True)
            .first()
        ),
        timeout=60,
        what="the long job running",
    )
    owner = cluster.owner_of(running)

    # --- the outage -------------------------------------------------------------------------
    node.stop_app()
    assert not node.accepts_connections()
    down_at = db_now()
    owner.kill9()
    answers: list[tuple[int, str | None, str | None]] = []
    readiness: list[tuple[int, dict]] = []
    while (db_now() - down_at).total_seconds() < OUTAGE_S or db_now() < timer:
        response = web.submit()
        job_id = response.json().get("id") if response.status_code == 202 else None
        answers.append((response.status_code, response.headers.get("Retry-After"), job_id))
        probe = web.ready()
        readiness.append((probe.status_code, probe.json()))
        time.sleep(0.3)
    lease = WorkerLease.objects.filter(job_id=long_job).values_list("expires_at", flat=True)
    assert lease and lease[0] < db_now(), "the dead worker's lease expired during the outage"
    assert ConversionJob.objects.get(id=long_job).state == "running"  # nothing recovered yet
    assert ConversionJob.objects.get(id=retry_job).state == "retry_wait"
    up_at = db_now()
    assert down_at < timer < up_at, "the retry timer fell due during the outage"
    node.start_app()
    back_at = time.monotonic()

    # Each submission was a 202 or an explicit 503 with Retry-After; never a 500.
    assert answers, "no submission during the outage"
    assert {status for status, _, _ in answers} <= {202, 503}, answers
    assert all(retry_after for status, retry_after, _ in answers if status == 503), answers
    accepted = [job_id for status, _, job_id in answers if status == 202]
    assert accepted, answers
    # Every 202 is a job with its outbox row (unpublished: the fast path had no broker).
    outbox = dict(
        ConversionOutbox.objects.filter(job_id__in=accepted).values_list("job_id", "published_at")
    )
    assert set(map(str, outbox)) == set(accepted)
    # Readiness: 503 throughout, and naming the overdue sweeps once they were late.
    assert {status for status, _ in readiness} == {503}, readiness
    named = [body["overdue_sweeps"] for _, body in readiness if body.get("overdue_sweeps")]
    assert named, f"no probe named an overdue sweep: {readiness[-1]}"
    assert "publish_outbox" in {o["sweep"] for o in named[-1]}

    # --- after the outage -------------------------------------------------------------------
    every = [*accepted, retry_job, long_job]
    harness.wait_until(
        lambda: set(states(every).values()) == {"succeeded"},
        timeout=RECOVERY_BUDGET_S,
        interval=0.25,
        what=f"every accepted job succeeded within {RECOVERY_BUDGET_S:g}s of the broker's return",
    )
    recovered_in = time.monotonic() - back_at
    for job_id in every:
        assert ConversionAttempt.objects.filter(job_id=job_id, outcome="succeeded").count() == 1, (
            job_id
        )
    # The retry fired after the timer; the expired lease was recovered into a new generation.
    retried = ConversionAttempt.objects.filter(job_id=retry_job).order_by("number")
    assert [(a.generation, a.outcome) for a in retried] == [
        (1, "retryable_error"),
        (2, "succeeded"),
    ]
    assert retried[1].started_at >= up_at
    lost = ConversionAttempt.objects.filter(job_id=long_job).order_by("number")
    outcomes = [(a.generation, a.outcome) for a in lost]
    # The killed worker's attempt lost its lease and a later generation succeeded, once. On a
    # runner running three suites a recovered attempt can lose its 3 s lease too (seen once,
    # quire_ci24): then it is recovered the same way, never published twice.
    assert outcomes[0] == (1, "lease_lost") and outcomes[-1][1] == "succeeded", outcomes
    assert [o for _, o in outcomes[1:-1]] == ["lease_lost"] * (len(outcomes) - 2), outcomes
    assert [g for g, _ in outcomes] == list(range(1, len(outcomes) + 1)), outcomes

    # Readiness is back once every sweep ran again; beat kept publishing (no restart).
    harness.wait_until(
        lambda: web.ready().status_code == 200, timeout=30, what="/health/ready 200 again"
    )
    since = SweepStatus.objects.filter(last_success_at__gt=up_at).values_list("name", flat=True)
    assert {"publish_outbox", "recover_expired_leases", "requeue_due_retries"} <= set(since)

    # The web's fast path publishes again by itself: a new job's row is published by the web
    # (at once, once), not left for the sweeper (which waits out the fast-path grace).
    for _ in range(4):
        fresh = web.submit()
        assert fresh.status_code == 202, fresh.content
        row = harness.wait_until(
            lambda fresh=fresh: ConversionOutbox.objects.filter(
                job_id=fresh.json()["id"], published_at__isnull=False
            ).first(),
            timeout=10,
            what="the fresh job's outbox row published",
        )
        assert (row.publish_attempts, row.last_error_code) == (1, None)
        assert (row.published_at - row.created_at).total_seconds() < 2
    # Flower's event capture reconnected too: it shows a task that ran after the outage (its
    # reconnect delay is capped at 5 s, flowerconfig.py).
    flower_proc, flower_port = flower
    flower_shows_a_new_task(
        web, flower_port, timeout=90, what="flower to show a task run after the outage"
    )
    flower_back_s = time.monotonic() - back_at
    survivors = [p for p in [web.proc, *workers, beat, flower_proc] if p is not owner]
    assert all(p.popen.poll() is None for p in survivors), cluster.tails()
    print(
        f"outage {(up_at - down_at).total_seconds():.1f}s, {len(answers)} submissions "
        f"({len(accepted)} accepted), all succeeded {recovered_in:.1f}s after the broker's return; "
        f"flower showed a new task {flower_back_s:.1f}s after it"
    )
