"""e2e: webhooks (issue 25) with real worker, sweeper, beat and notifier processes and a local
receiver that verifies every delivery with the ``standardwebhooks`` reference library."""

from __future__ import annotations

import contextlib
import datetime as dt
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import standardwebhooks.webhooks
from django.utils import timezone
from standardwebhooks import Webhook

from conversion_jobs.models import ConversionJob, WebhookEndpoint, WebhookMessage
from conversion_jobs.services.cancellation import conversion_job_cancel
from conversion_jobs.webhooks import signing
from conversion_jobs.webhooks.endpoints import webhook_endpoint_create, webhook_endpoint_rotate
from conversion_jobs.webhooks.models import WebhookAttempt
from tests.e2e import harness
from tests.webhook_receiver import Canary, Received, Receiver, Reply

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]
ALL = ["job.succeeded", "job.partial", "job.failed", "job.cancelled"]
#: what the notifier processes of these tests run with (short schedule, local receivers)
HOOK_ENV = {
    "QUIRE_WEBHOOK_ALLOWLIST": "127.0.0.1/32",
    "QUIRE_WEBHOOK_ALLOWED_PORTS": "1024-65535",
    "QUIRE_WEBHOOK_RETRY_SCHEDULE": "0.3,0.3,0.3,0.3,0.3,0.3",
    "QUIRE_WEBHOOK_TIMEOUT_S": "3",
    "QUIRE_WEBHOOK_POLL_S": "0.5",
}


@pytest.fixture
def hooks(settings, start) -> Any:
    """This process registers endpoints under the notifier's allowlist and ports."""
    settings.QUIRE = {
        **settings.QUIRE,
        "WEBHOOK_ALLOWLIST": HOOK_ENV["QUIRE_WEBHOOK_ALLOWLIST"],
        "WEBHOOK_ALLOWED_PORTS": HOOK_ENV["QUIRE_WEBHOOK_ALLOWED_PORTS"],
    }
    return settings


@pytest.fixture
def receivers() -> Iterator[Any]:
    made: list[Receiver] = []

    def make(script=None) -> Receiver:
        made.append(Receiver(script))
        return made[-1]

    yield make
    for r in made:
        r.close()


@contextlib.contextmanager
def hosts_entry(name: str, address: str) -> Iterator[None]:
    """``name`` resolves to ``address`` through /etc/hosts while inside (one line, removed)."""
    line = f"{address} {name}\n"
    with open("/etc/hosts", "a") as fh:
        fh.write(line)
    try:
        yield
    finally:
        with open("/etc/hosts") as fh:
            kept = [entry for entry in fh if entry != line]
        with open("/etc/hosts", "w") as fh:
            fh.writelines(kept)


def verify_as_received(secret: str, got: Received) -> Any:
    """The reference library's verify of ``got`` as of the moment it was received: its
    timestamp tolerance (5 minutes) is the receiver's, not this check's, which on a loaded runner
    may come more than 5 minutes after the first delivery of a long test."""

    class _Then(dt.datetime):
        @classmethod
        def now(cls, tz: dt.tzinfo | None = None) -> dt.datetime:  # type: ignore[override]
            return dt.datetime.fromtimestamp(got.at, tz)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(standardwebhooks.webhooks, "datetime", _Then)
        return Webhook(secret).verify(got.body, got.headers)


def _verified(receiver: Receiver, secrets_: list[str]) -> dict[str, list[dict[str, Any]]]:
    """Every request verified with the reference library under at least one of ``secrets_``;
    the bodies by webhook-id."""
    by_id: dict[str, list[dict[str, Any]]] = {}
    for got in receiver.requests:
        body = None
        for secret in secrets_:
            with contextlib.suppress(Exception):
                body = verify_as_received(secret, got)
                break
        assert body is not None, f"a delivery did not verify: {got.headers}"
        by_id.setdefault(got.headers["webhook-id"], []).append(body)
    return by_id


def test_webhooks__each_terminal_event_delivered_with_metadata_410_and_redirect(
    hooks, start, submit, receivers
):
    start("worker")
    start("sweeper")
    start("beat")
    start("notifier", **HOOK_ENV)
    ok = receivers()
    _, secret = webhook_endpoint_create(tenant="tenant-a", actor="e2e", url=ok.url, events=ALL)
    gone = receivers(lambda got, n: Reply(410))
    gone_endpoint, _ = webhook_endpoint_create(
        tenant="tenant-a", actor="e2e", url=gone.url, events=["job.succeeded"]
    )
    canary = Canary(host="::")
    try:
        redirect = receivers(
            lambda got, n: Reply(302, headers={"Location": f"http://127.0.0.1:{canary.port}/"})
        )
        redirect_endpoint, _ = webhook_endpoint_create(
            tenant="tenant-a", actor="e2e", url=redirect.url, events=["job.failed"]
        )
        succeeded = submit(pages=2, metadata={"case": "succeeded"})
        failed = submit(
            pages=1,
            options={"_test_fault": {"kind": "fail", "page": 1}},
            metadata={"case": "failed"},
        )
        slow = submit(
            pages=3,
            options={"_test_fault": {"kind": "slow", "seconds": 1}},
            metadata={"case": "cancelled"},
        )
        harness.wait_until(
            lambda: ConversionJob.objects.get(id=slow.id).state in ("running", "queued"),
            timeout=10,
            what="the slow job",
        )
        conversion_job_cancel(job_id=slow.id, tenant="tenant-a", actor="e2e")

        def delivered() -> dict[str, list[dict[str, Any]]] | None:
            by_id = _verified(ok, [secret])
            return by_id if len(by_id) == 3 else None

        by_id = harness.wait_until(delivered, timeout=60, what="three events delivered")
        events = {bodies[0]["data"]["metadata"]["case"]: bodies[0] for bodies in by_id.values()}
        assert {case: body["type"] for case, body in events.items()} == {
            "succeeded": "job.succeeded",
            "failed": "job.failed",
            "cancelled": "job.cancelled",
        }
        for job in (succeeded, failed, slow):
            body = next(b for b in events.values() if b["data"]["id"] == str(job.id))
            assert body["data"]["state"] == ConversionJob.objects.get(id=job.id).state
        assert events["failed"]["data"]["error"]["code"] == "invalid_input"

        harness.wait_until(
            lambda: not WebhookEndpoint.objects.get(id=gone_endpoint.id).enabled,
            timeout=20,
            what="the 410 endpoint disabled",
        )
        assert WebhookEndpoint.objects.get(id=gone_endpoint.id).disabled_reason == "gone"
        harness.wait_until(
            lambda: WebhookAttempt.objects.filter(
                message__endpoint_id=redirect_endpoint.id, error="redirect_refused"
            ).exists(),
            timeout=20,
            what="the redirect refused",
        )
        time.sleep(0.5)
        assert canary.connections == 0
    finally:
        canary.close()


def test_webhooks__flaky_receiver_rotation_and_notifier_kill9_lose_nothing(
    hooks, start, submit, receivers, cluster
):
    start("worker", WORKER_CONCURRENCY="2")
    start("sweeper")
    start("beat")
    notifier = start("notifier", **HOOK_ENV)
    flaky = receivers(lambda got, n: Reply(500) if n < 3 else Reply(200))
    endpoint, old = webhook_endpoint_create(
        tenant="tenant-a", actor="e2e", url=flaky.url, events=ALL
    )
    jobs = [submit(pages=1, metadata={"n": i}) for i in range(12)]
    harness.wait_until(lambda: len(flaky.requests) >= 6, timeout=30, what="first deliveries")
    notifier.kill9()
    _, new = webhook_endpoint_rotate(tenant="tenant-a", endpoint_id=endpoint.id, actor="e2e")
    rotated_at = time.time()
    jobs += [submit(pages=1, metadata={"n": 100 + i}) for i in range(8)]
    notifier = start("notifier", **HOOK_ENV)
    harness.wait_until(lambda: len(flaky.requests) >= 30, timeout=40, what="more deliveries")
    notifier.kill9()
    start("notifier", **HOOK_ENV)

    def all_acknowledged() -> bool:
        done = WebhookMessage.objects.filter(endpoint_id=endpoint.id, state="delivered").count()
        return done == len(jobs)

    harness.wait_until(all_acknowledged, timeout=60, what="every event acknowledged")
    assert all(ConversionJob.objects.get(id=j.id).state == "succeeded" for j in jobs)
    by_id = _verified(flaky, [old, new])
    # every job's event arrived, each under one id, with at least one 200 among its copies
    assert len(by_id) == len(jobs)
    ids_by_job: dict[str, set[str]] = {}
    for webhook_id, bodies in by_id.items():
        assert len({b["data"]["id"] for b in bodies}) == 1
        ids_by_job.setdefault(bodies[0]["data"]["id"], set()).add(webhook_id)
        assert len(bodies) >= 4  # three 500s, then the 200
    assert set(ids_by_job) == {str(j.id) for j in jobs}
    assert all(len(ids) == 1 for ids in ids_by_job.values())
    # after the rotation (and within its grace) every delivery verifies under both secrets
    for got in flaky.requests:
        if got.at > rotated_at + 0.5:
            assert len(got.headers["webhook-signature"].split(" ")) == 2
            verify_as_received(old, got)
            verify_as_received(new, got)


def test_webhooks__ssrf_forms_refused_with_their_reason_canary_untouched(start, make_job):
    """The notifier runs with no allowlist; the endpoints are rows written directly (their
    URLs would be refused at registration too: that check has its own tests)."""
    # every local address, IPv4 and IPv6, one port: any connection the notifier makes to a
    # loopback, unspecified or mapped form reaches it
    canary = Canary(host="::")
    name = f"quire-hook-{uuid.uuid4().hex[:8]}.test"
    port = canary.port
    forms = {
        f"http://127.0.0.1:{port}/": "address_loopback",
        f"http://[::1]:{port}/": "address_loopback",
        f"http://[::ffff:127.0.0.1]:{port}/": "address_loopback",
        f"http://0x7f000001:{port}/": "address_loopback",
        f"http://2130706433:{port}/": "address_loopback",
        f"http://127.1:{port}/": "address_loopback",
        f"http://0.0.0.0:{port}/": "address_unspecified",
        f"http://169.254.169.254:{port}/": "address_link_local",
        f"http://localhost:{port}/": "address_loopback",
        f"http://{name}:{port}/": "address_loopback",
        f"http://[2002:7f00:1::]:{port}/": "address_loopback",
        f"http://[64:ff9b::7f00:1]:{port}/": "address_loopback",
    }
    try:
        with hosts_entry(name, "127.0.0.1"):
            start(
                "notifier",
                **{**HOOK_ENV, "QUIRE_WEBHOOK_ALLOWLIST": "", "QUIRE_WEBHOOK_RETRY_SCHEDULE": "60"},
            )
            job = make_job(state="succeeded")
            now = timezone.now()
            messages = {}
            for url in forms:
                endpoint = WebhookEndpoint.objects.create(
                    tenant="tenant-a",
                    url=url,
                    events=ALL,
                    secret_sealed=signing.secret_seal(signing.secret_new()),
                )
                messages[url] = WebhookMessage.objects.create(
                    endpoint=endpoint,
                    job_id=job.id,
                    event_type="job.succeeded",
                    payload={"type": "job.succeeded"},
                    created_at=now,
                    next_attempt_at=now,
                )

            def refused() -> dict[str, str | None] | None:
                found = {
                    url: WebhookAttempt.objects.filter(message=m)
                    .values_list("error", flat=True)
                    .first()
                    for url, m in messages.items()
                }
                return found if all(found.values()) else None

            found = harness.wait_until(refused, timeout=30, what="every form attempted")
        assert found == forms
        assert set(
            WebhookAttempt.objects.filter(message__in=messages.values()).values_list(
                "outcome", flat=True
            )
        ) == {"refused"}
        time.sleep(0.5)
        assert canary.connections == 0
    finally:
        canary.close()
