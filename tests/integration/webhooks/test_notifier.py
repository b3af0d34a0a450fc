"""The notifier (ADR 0020) against a real local receiver: claims, signatures verified with the
``standardwebhooks`` reference library, the retry schedule, Retry-After, 410, failing too long,
redirects and refused addresses recorded, per-endpoint concurrency, lapsed claims, rotation, and
the loop woken by NOTIFY."""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
from django.db import connections
from django.utils import timezone
from standardwebhooks import Webhook

from conversion_jobs.models import ExecutionAuditEvent, WebhookEndpoint, WebhookMessage
from conversion_jobs.webhooks import notifier, signing, transport
from conversion_jobs.webhooks.endpoints import webhook_endpoint_create, webhook_endpoint_rotate
from conversion_jobs.webhooks.models import WebhookAttempt
from tests.webhook_receiver import Canary, Receiver, Reply

pytestmark = pytest.mark.django_db(transaction=True)
ALL = ["job.succeeded", "job.partial", "job.failed", "job.cancelled"]


@pytest.fixture
def hooks_settings(settings):
    settings.QUIRE = {
        **settings.QUIRE,
        "WEBHOOK_ALLOWLIST": "127.0.0.1/32",
        "WEBHOOK_ALLOWED_PORTS": "1-65535",
        "WEBHOOK_RETRY_SCHEDULE": "10,20,30",
        "WEBHOOK_TIMEOUT_S": 3.0,
    }
    return settings


@pytest.fixture
def receiver():
    made: list[Receiver] = []

    def make(script=None, host="127.0.0.1"):
        made.append(Receiver(script, host=host))
        return made[-1]

    yield make
    for r in made:
        r.close()


@pytest.fixture
def client():
    with transport.client() as c:
        yield c


def _ports(spec: str) -> str:
    return spec


def _endpoint(url: str, tenant: str = "tenant-a") -> tuple[WebhookEndpoint, str]:
    return webhook_endpoint_create(tenant=tenant, actor="a", url=url, events=ALL)


def _message(endpoint: WebhookEndpoint, make_job, **fields: Any) -> WebhookMessage:
    job = make_job(state="succeeded", metadata={"batch": "b1"})
    from conversion_jobs.webhooks.outbox import event_payload

    now = timezone.now()
    return WebhookMessage.objects.create(
        endpoint=endpoint,
        job_id=job.id,
        event_type="job.succeeded",
        payload=event_payload(job, "job.succeeded"),
        created_at=now,
        next_attempt_at=now,
        **fields,
    )


def _deliver_due(client) -> list[str | None]:
    return [notifier.message_deliver(c, client=client) for c in notifier.messages_claim(limit=50)]


def test_notifier__delivers_signed_body_verified_by_the_reference_library(
    hooks_settings, receiver, client, make_job
):
    r = receiver()
    endpoint, secret = _endpoint(r.url)
    message = _message(endpoint, make_job)

    assert _deliver_due(client) == ["delivered"]

    (got,) = r.requests
    payload = Webhook(secret).verify(got.body, got.headers)
    assert payload == message.payload and payload["data"]["metadata"] == {"batch": "b1"}
    assert got.headers["webhook-id"] == message.webhook_id
    assert got.headers["host"] == f"127.0.0.1:{r.port}"
    message.refresh_from_db()
    assert (message.state, message.attempts, message.claimed_until) == ("delivered", 1, None)
    (attempt,) = WebhookAttempt.objects.filter(message=message)
    assert (attempt.outcome, attempt.status_code, attempt.error) == ("delivered", 200, None)
    assert attempt.response_excerpt == "ok" and attempt.latency_ms is not None
    assert secret not in json.dumps(
        list(WebhookAttempt.objects.values()), default=str
    )  # no secret recorded


def test_notifier__failure_follows_the_schedule_and_keeps_the_id_then_fails(
    hooks_settings, receiver, client, make_job
):
    r = receiver(lambda got, n: Reply(500, b"x" * 5000))
    endpoint, secret = _endpoint(r.url)
    message = _message(endpoint, make_job)

    for attempt_number, base in enumerate([10, 20, 30], start=1):
        before = timezone.now()
        assert _deliver_due(client) == ["retry"]
        message.refresh_from_db()
        assert message.attempts == attempt_number and message.last_error == "http_500"
        delay = (message.next_attempt_at - before).total_seconds()
        assert base * 0.8 - 0.5 <= delay <= base * 1.2 + 0.5
        assert _deliver_due(client) == []  # not due yet
        WebhookMessage.objects.filter(id=message.id).update(next_attempt_at=timezone.now())
    assert _deliver_due(client) == ["failed"]
    message.refresh_from_db()
    assert (message.state, message.attempts) == ("failed", 4)
    assert {g.headers["webhook-id"] for g in r.requests} == {message.webhook_id}
    for got in r.requests:
        Webhook(secret).verify(got.body, got.headers)
    excerpts = WebhookAttempt.objects.filter(message=message).values_list(
        "response_excerpt", flat=True
    )
    assert all(len(e) == transport.EXCERPT_BYTES for e in excerpts)


def test_notifier__retry_after_is_honoured_with_a_cap(hooks_settings, receiver, client, make_job):
    hooks_settings.QUIRE = {**hooks_settings.QUIRE, "WEBHOOK_RETRY_AFTER_MAX_S": 120.0}
    r = receiver(lambda got, n: Reply(429, headers={"Retry-After": "100" if n == 0 else "99999"}))
    endpoint, _ = _endpoint(r.url)
    message = _message(endpoint, make_job)

    before = timezone.now()
    assert _deliver_due(client) == ["retry"]
    message.refresh_from_db()
    assert 99 <= (message.next_attempt_at - before).total_seconds() <= 102
    WebhookMessage.objects.filter(id=message.id).update(next_attempt_at=timezone.now())
    before = timezone.now()
    assert _deliver_due(client) == ["retry"]
    message.refresh_from_db()
    assert 119 <= (message.next_attempt_at - before).total_seconds() <= 122


def test_notifier__410_disables_the_endpoint_with_an_audit_event(
    hooks_settings, receiver, client, make_job
):
    r = receiver(lambda got, n: Reply(410))
    endpoint, _ = _endpoint(r.url)
    message = _message(endpoint, make_job)
    other = _message(endpoint, make_job)
    WebhookMessage.objects.filter(id=other.id).update(
        next_attempt_at=timezone.now() + timedelta(hours=1)
    )

    assert _deliver_due(client) == ["failed"]
    endpoint.refresh_from_db()
    assert (endpoint.enabled, endpoint.disabled_reason) == (False, "gone")
    message.refresh_from_db()
    assert message.state == "failed"
    events = ExecutionAuditEvent.objects.filter(job_id=endpoint.id, event_type="webhook_disabled")
    assert [e.details for e in events] == [{"reason": "gone"}]
    # a disabled endpoint's messages are not claimed
    WebhookMessage.objects.filter(id=other.id).update(next_attempt_at=timezone.now())
    assert _deliver_due(client) == []


def test_notifier__failing_too_long_disables(hooks_settings, receiver, client, make_job):
    r = receiver(lambda got, n: Reply(503))
    endpoint, _ = _endpoint(r.url)
    _message(endpoint, make_job)
    WebhookEndpoint.objects.filter(id=endpoint.id).update(
        failing_since=timezone.now() - timedelta(days=6)
    )
    assert _deliver_due(client) == ["retry"]
    endpoint.refresh_from_db()
    assert (endpoint.enabled, endpoint.disabled_reason) == (False, "failing")


def test_notifier__success_ends_the_failing_streak(hooks_settings, receiver, client, make_job):
    r = receiver(lambda got, n: Reply(200))
    endpoint, _ = _endpoint(r.url)
    _message(endpoint, make_job)
    WebhookEndpoint.objects.filter(id=endpoint.id).update(
        failing_since=timezone.now() - timedelta(days=1)
    )
    assert _deliver_due(client) == ["delivered"]
    endpoint.refresh_from_db()
    assert endpoint.failing_since is None and endpoint.enabled


def test_notifier__redirect_is_a_failure_and_never_followed(
    hooks_settings, receiver, client, make_job
):
    canary = Canary(host="127.0.0.1")
    try:
        r = receiver(
            lambda got, n: Reply(302, headers={"Location": f"http://127.0.0.1:{canary.port}/"})
        )
        endpoint, _ = _endpoint(r.url)
        message = _message(endpoint, make_job)
        assert _deliver_due(client) == ["retry"]
        (attempt,) = WebhookAttempt.objects.filter(message=message)
        assert (attempt.status_code, attempt.error) == (302, "redirect_refused")
        time.sleep(0.3)
        assert canary.connections == 0
    finally:
        canary.close()


@pytest.mark.parametrize(
    ("host", "code"),
    [
        ("127.0.0.2", "address_loopback"),
        ("localhost", "address_loopback"),
        ("2130706433", "address_loopback"),
        ("127.1", "address_loopback"),
    ],
)
def test_notifier__refused_address_recorded_and_never_dialled(
    hooks_settings, client, make_job, host, code
):
    """The URL was acceptable when registered (allowlisted); at delivery the allowlist no
    longer admits it: refused before any connection, with its code."""
    canary = Canary(host="127.0.0.2")
    try:
        hooks_settings.QUIRE = {**hooks_settings.QUIRE, "WEBHOOK_ALLOWLIST": "127.0.0.0/8"}
        endpoint, _ = _endpoint(f"http://{host}:{canary.port}/hook")
        message = _message(endpoint, make_job)
        hooks_settings.QUIRE = {**hooks_settings.QUIRE, "WEBHOOK_ALLOWLIST": ""}
        assert _deliver_due(client) == ["refused"]
        (attempt,) = WebhookAttempt.objects.filter(message=message)
        assert (attempt.outcome, attempt.error, attempt.status_code) == ("refused", code, None)
        time.sleep(0.3)
        assert canary.connections == 0
    finally:
        canary.close()


def test_notifier__rotation_signs_with_both_secrets_for_the_grace(
    hooks_settings, receiver, client, make_job
):
    r = receiver()
    endpoint, old = _endpoint(r.url)
    _, new = webhook_endpoint_rotate(tenant="tenant-a", endpoint_id=endpoint.id, actor="a")
    _message(endpoint, make_job)
    assert _deliver_due(client) == ["delivered"]
    (got,) = r.requests
    assert len(got.headers["webhook-signature"].split(" ")) == 2
    Webhook(old).verify(got.body, got.headers)
    Webhook(new).verify(got.body, got.headers)
    # past the grace only the new secret signs
    WebhookEndpoint.objects.filter(id=endpoint.id).update(
        previous_secret_expires_at=timezone.now() - timedelta(seconds=1)
    )
    _message(endpoint, make_job)
    assert _deliver_due(client) == ["delivered"]
    assert len(r.requests[1].headers["webhook-signature"].split(" ")) == 1
    Webhook(new).verify(r.requests[1].body, r.requests[1].headers)
    with pytest.raises(Exception):  # noqa: B017 - the library's WebhookVerificationError
        Webhook(old).verify(r.requests[1].body, r.requests[1].headers)


def test_notifier__claim_caps_each_endpoint_and_skips_nothing_else(hooks_settings, make_job):
    hooks_settings.QUIRE = {**hooks_settings.QUIRE, "WEBHOOK_ENDPOINT_CONCURRENCY": 2}
    slow, _ = _endpoint("https://slow.example.com/")
    fast, _ = _endpoint("https://fast.example.com/")
    slow_messages = [_message(slow, make_job) for _ in range(5)]
    fast_message = _message(fast, make_job)

    first = {c.message_id for c in notifier.messages_claim(limit=10)}
    assert fast_message.id in first and len(first & {m.id for m in slow_messages}) == 2
    # the slow endpoint's two are still in flight: nothing more of it, nothing left of fast
    assert notifier.messages_claim(limit=10) == []


def test_notifier__lapsed_claim_is_claimed_again_and_a_stale_claim_sends_nothing(
    hooks_settings, receiver, client, make_job
):
    r = receiver()
    endpoint, _ = _endpoint(r.url)
    message = _message(endpoint, make_job)
    (first,) = notifier.messages_claim(limit=5)
    assert notifier.messages_claim(limit=5) == []
    # the claimer died: its claim lapses
    WebhookMessage.objects.filter(id=message.id).update(
        claimed_until=timezone.now() - timedelta(seconds=1),
        next_attempt_at=timezone.now() - timedelta(seconds=1),
    )
    (second,) = notifier.messages_claim(limit=5)
    assert second.message_id == message.id
    assert notifier.message_deliver(first, client=client) is None  # not ours any more
    assert notifier.message_deliver(second, client=client) == "delivered"
    assert len(r.requests) == 1


def test_notifier__two_claimers_never_take_the_same_message(hooks_settings, make_job):
    endpoint, _ = _endpoint("https://hooks.example.com/")
    hooks_settings.QUIRE = {**hooks_settings.QUIRE, "WEBHOOK_ENDPOINT_CONCURRENCY": 100}
    ids = {_message(endpoint, make_job).id for _ in range(40)}
    barrier = threading.Barrier(2)
    got: list[list[Any]] = [[], []]

    def claim(i: int) -> None:
        try:
            barrier.wait()
            for _ in range(10):
                got[i].extend(c.message_id for c in notifier.messages_claim(limit=3))
        finally:
            connections.close_all()

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not set(got[0]) & set(got[1])
    assert set(got[0]) | set(got[1]) == ids


@pytest.mark.postgres
def test_notifier__loop_wakes_on_the_terminal_commit(
    hooks_settings, receiver, make_job, no_broker_publish
):
    """Postgres: NOTIFY quire_webhook at the commit (the standalone profile polls)."""
    from conversion_jobs.services import transitions

    hooks_settings.QUIRE = {**hooks_settings.QUIRE, "WEBHOOK_POLL_S": 5.0}
    r = receiver()
    _, secret = _endpoint(r.url)
    job = make_job(state="queued", metadata={"k": 1})
    stop = threading.Event()

    def loop() -> None:
        try:
            notifier.run(stop)
        finally:
            connections.close_all()

    thread = threading.Thread(target=loop)
    thread.start()
    try:
        time.sleep(0.5)  # listening
        assert transitions.cancel_queued(job_id=job.id, tenant="tenant-a", actor="a")
        committed = time.time()
        deadline = time.monotonic() + 4
        while not r.requests and time.monotonic() < deadline:
            time.sleep(0.01)
        assert r.requests, "no delivery within 4 s although the poll interval is 5 s"
        (got,) = r.requests
        body = Webhook(secret).verify(got.body, got.headers)
        assert body["type"] == "job.cancelled" and body["data"]["metadata"] == {"k": 1}
        assert got.at - committed < 1.0
    finally:
        stop.set()
        thread.join(timeout=10)
    assert not thread.is_alive()
    assert signing.PREFIX == "whsec_"


def test_notifier__endpoint_at_its_cap_drains_without_waiting_for_the_poll(
    hooks_settings, receiver, make_job
):
    """A delivery's end wakes the loop: 20 due messages of one endpoint capped at 2 in flight
    are all delivered long before one poll interval (5 s) has passed."""
    hooks_settings.QUIRE = {
        **hooks_settings.QUIRE,
        "WEBHOOK_POLL_S": 5.0,
        "WEBHOOK_ENDPOINT_CONCURRENCY": 2,
    }
    r = receiver()
    endpoint, _ = _endpoint(r.url)
    for _ in range(20):
        _message(endpoint, make_job)
    stop = threading.Event()

    def loop() -> None:
        try:
            notifier.run(stop)
        finally:
            connections.close_all()

    started = time.monotonic()
    thread = threading.Thread(target=loop)
    thread.start()
    try:
        deadline = started + 4
        while len(r.requests) < 20 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(r.requests) == 20, len(r.requests)
    finally:
        stop.set()
        thread.join(timeout=10)
    assert WebhookMessage.objects.filter(state="delivered").count() == 20
