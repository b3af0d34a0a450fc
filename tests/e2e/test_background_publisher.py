"""e2e: the web's fast path on its background publisher (docs/ARCHITECTURE.md §2, ADR 0017
addendum): the Procfile's ``web`` process, real Postgres and RabbitMQ, requests over a real socket.

A 202 is durable before any publish is tried; the publisher thread publishes the committed rows
promptly, once each; a broker that is down, or a web process killed between the 202 and the
publish, leaves the rows to the outbox sweep.
"""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from conversion_jobs.api.auth import token_mint
from conversion_jobs.models import ConversionJob, ConversionOutbox
from tests import testdocs
from tests.e2e import harness

pytestmark = [pytest.mark.e2e, pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


def _accept(port: int) -> str:
    salt = uuid.uuid4().hex
    body = testdocs.pdf_bytes(pages=1, text_of=lambda n: f"Page {n} {salt}")
    token = token_mint(tenant="tenant-a", subject="e2e", scopes=["jobs:submit"], ttl_s=600)
    response = requests.post(
        f"http://127.0.0.1:{port}/api/v1/jobs",
        headers={"Authorization": f"Bearer {token}", "Idempotency-Key": salt},
        files={"file": ("doc.pdf", body, "application/pdf")},
        data={"output": "text"},
        timeout=30,
    )
    assert response.status_code == 202, response.content
    return str(response.json()["id"])


def _rows(job_ids: list[str]) -> list[tuple[object, int, str | None]]:
    return list(
        ConversionOutbox.objects.filter(job_id__in=job_ids).values_list(
            "published_at", "publish_attempts", "last_error_code"
        )
    )


def _broker_env(port: int) -> dict[str, str]:
    """The web's publisher pointed at ``port`` instead of RabbitMQ."""
    url = harness.broker_url("publisher", port=port)
    return {"CELERY_BROKER_URL": url, "QUIRE_BROKER_PUBLISHER_URL": url}


def test_background_publisher__a_burst_of_accepts_is_published_promptly_once_each(
    start: Callable[..., harness.Proc],
) -> None:
    web = start("web", WEB_CONCURRENCY="1")
    with ThreadPoolExecutor(8) as pool:
        job_ids = list(pool.map(lambda _: _accept(web.port), range(24)))
    harness.wait_until(
        lambda: all(published for published, _, _ in _rows(job_ids)),
        timeout=15,
        what="every accepted job's outbox row published",
    )
    # Once each, by the fast path (not the sweep: none runs), nothing recorded as failed.
    assert {(attempts, error) for _, attempts, error in _rows(job_ids)} == {(1, None)}
    harness.wait_until(
        lambda: harness.queue_depth(harness.CONVERSION_QUEUE) >= 24,
        timeout=10,
        what="the messages in conversion.v1",
    )
    assert harness.queue_depth(harness.CONVERSION_QUEUE) == 24
    # The messages the publisher built itself run like any other.
    start("worker")
    harness.wait_until(
        lambda: ConversionJob.objects.filter(id__in=job_ids, state="succeeded").count() == 24,
        timeout=120,
        what="every job run from its background-published message",
    )
    assert "Traceback" not in web.log.read_text(errors="replace")


def test_background_publisher__broker_down_still_202_and_the_sweep_publishes(
    start: Callable[..., harness.Proc],
) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]  # nothing listens there: connection refused
    web = start("web", **_broker_env(closed_port))
    job_ids = [_accept(web.port) for _ in range(3)]
    # The publisher tried, failed, and recorded it on the rows; nothing was published. (Fair
    # dispatch: each accept's pick takes every waiting row, so a row may be tried more than
    # once before the sweep.)
    harness.wait_until(
        lambda: (
            {(p, a >= 1, e) for p, a, e in _rows(job_ids)} == {(None, True, "broker_unreachable")}
        ),
        timeout=15,
        what="the fast path's failure recorded on the rows",
    )
    start("sweeper")
    start("beat")
    harness.wait_until(
        lambda: all(published for published, _, _ in _rows(job_ids)),
        timeout=30,
        what="the sweep to publish the rows",
    )
    assert all(attempts >= 2 for _, attempts, _ in _rows(job_ids))
    assert web.popen.poll() is None


def test_background_publisher__web_killed_after_the_202_before_publishing__the_sweep_publishes(
    start: Callable[..., harness.Proc],
) -> None:
    # A "broker" that accepts the TCP connection and never speaks: the publisher thread hangs
    # in the handshake, so the web is killed with the row handed over but not published.
    with socket.socket() as blackhole:
        blackhole.bind(("127.0.0.1", 0))
        blackhole.listen(64)
        web = start("web", **_broker_env(blackhole.getsockname()[1]))
        job_id = _accept(web.port)
        web.kill9()
    assert _rows([job_id]) == [(None, 0, None)]
    start("sweeper")
    start("beat")
    harness.wait_until(
        lambda: _rows([job_id])[0][0] is not None,
        timeout=30,
        what="the sweep to publish the killed web's row",
    )
    harness.wait_until(
        lambda: harness.queue_depth(harness.CONVERSION_QUEUE) == 1,
        timeout=10,
        what="one message in conversion.v1",
    )


def test_background_publisher__web_killed_between_its_pick_and_its_publish__sent_within_seconds(
    start: Callable[..., harness.Proc],
) -> None:
    """The web's publisher dies (SIGKILL, the fault point ``fair.after_pick``) right after the
    unit was marked sent (on this idle stack by the acceptance's own statement, ADR 0021 "Sent
    at acceptance"; else by its fair pick), on a live broker: nothing was published and nothing
    given back. The unit waits again after twice the confirm timeout and the next sweep sends it
    (ADR 0021, "A unit picked and lost"), long before QUIRE_FAIR_LOST_S."""
    lost_s = "120"  # the older recovery (a lost unit's slot, the stale-dispatch sweep): far off
    start("worker", QUIRE_FAIR_LOST_S=lost_s)
    web = start(
        "web",
        WEB_CONCURRENCY="1",
        QUIRE_TEST_FAULT_KILL="fair.after_pick",
        QUIRE_FAIR_LOST_S=lost_s,
    )
    job_id = _accept(web.port)
    harness.wait_until(
        lambda: _rows([job_id])[0][0] is not None,
        timeout=15,
        what="the web's pick to mark the unit sent",
    )
    killed_at = time.monotonic()
    time.sleep(0.5)  # a live publisher's confirm would have come back within milliseconds
    job = ConversionJob.objects.get(id=job_id)
    row = ConversionOutbox.objects.get(job_id=job_id)
    # picked (the pick's time on both rows: never confirmed), and the publisher died there
    assert (job.state, job.dispatched_generation) == ("queued", 1)
    assert row.published_at == job.dispatched_at
    web.kill9()
    assert ConversionJob.objects.get(id=job_id).attempts == 0  # no message reached the worker
    start("sweeper", QUIRE_FAIR_LOST_S=lost_s)
    start("beat", QUIRE_FAIR_LOST_S=lost_s)
    harness.wait_until(
        lambda: ConversionJob.objects.get(id=job_id).attempts >= 1,
        timeout=60,
        what="the lost unit picked again, sent and claimed",
    )
    # Claimed within seconds of the kill (the sweeper's and beat's start included), not after
    # QUIRE_FAIR_LOST_S: returned to waiting (its one row, marked so), not written anew.
    claimed_after = time.monotonic() - killed_at
    assert claimed_after < 20, claimed_after
    rows = list(ConversionOutbox.objects.filter(job_id=job_id).values_list("last_error_code"))
    assert rows == [("unconfirmed",)]
    harness.wait_until(
        lambda: ConversionJob.objects.get(id=job_id).state == "succeeded",
        timeout=60,
        what="the job to run",
    )
