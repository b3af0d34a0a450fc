"""The notifier (ADR 0020, docs/OPERABILITY.md "Webhooks"): claims due webhook messages from
Postgres and delivers them, signed, through the SSRF-safe transport.

A claim (``messages_claim``) locks due pending messages with ``FOR UPDATE SKIP LOCKED`` (any
number of notifiers share the table) and holds each for ``claim_s()`` by moving its
``claimed_until`` and ``next_attempt_at`` forward: a notifier killed mid-delivery loses nothing,
its claims lapse and another claim sends the message again with the same ``webhook-id``
(at-least-once). At most ``QUIRE_WEBHOOK_ENDPOINT_CONCURRENCY`` messages of one endpoint are in
flight, so a slow or dead endpoint holds its own slots and never another's. After each attempt
(``attempt_record``) the message is delivered (2xx), failed (410, or its retry schedule spent;
replayable) or due again after the schedule's next delay with jitter, or the ``Retry-After`` it
was given (capped). 410 disables the endpoint; so does failing without a success for
``QUIRE_WEBHOOK_DISABLE_AFTER_S``. Each attempt is a ``webhook_attempt`` row.

``run`` is the process's loop: woken by ``NOTIFY quire_webhook`` (a trigger on the message
table, delivered on the terminal commit) and by a delivery's end (a freed slot, maybe for an
endpoint at its cap), with a polling fallback for retries coming due.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import select
import threading
import time
import uuid
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import httpx
from django.conf import settings
from django.db import close_old_connections, transaction
from django.db.models import Count, Q
from django.utils import timezone

from conversion_jobs.observability import metrics
from conversion_jobs.store import notify
from conversion_jobs.webhooks import signing, transport
from conversion_jobs.webhooks.endpoints import CHANNEL, webhook_endpoint_disable
from conversion_jobs.webhooks.models import (
    DisabledReason,
    MessageState,
    WebhookAttempt,
    WebhookEndpoint,
    WebhookMessage,
)
from conversion_jobs.webhooks.outbox import payload_render

log = logging.getLogger("quire.notifier")
# httpx logs every request with its URL at INFO: a receiver's URL may carry its own token.
logging.getLogger("httpx").setLevel(logging.WARNING)

#: the jitter applied to each scheduled delay (a factor drawn from this range)
JITTER = (0.8, 1.2)


def retry_schedule() -> list[float]:
    """``QUIRE_WEBHOOK_RETRY_SCHEDULE``: the delay after the 1st, 2nd, … failed attempt."""
    return [float(s) for s in settings.QUIRE["WEBHOOK_RETRY_SCHEDULE"].split(",") if s.strip()]


def claim_s() -> float:
    """How long a claim holds a message: past the request's timeout, with a margin."""
    return float(settings.QUIRE["WEBHOOK_TIMEOUT_S"]) + 5.0


def next_delay(attempts: int, retry_after_s: float | None) -> float | None:
    """Seconds until the next attempt after ``attempts`` failed ones, with jitter; at least the
    ``Retry-After`` asked for (capped by ``QUIRE_WEBHOOK_RETRY_AFTER_MAX_S``). None: the
    schedule is spent."""
    schedule = retry_schedule()
    if attempts > len(schedule):
        return None
    delay = schedule[attempts - 1] * random.uniform(*JITTER)  # noqa: S311 - jitter, not a secret
    if retry_after_s is not None:
        delay = max(delay, min(retry_after_s, settings.QUIRE["WEBHOOK_RETRY_AFTER_MAX_S"]))
    return delay


@dataclass(frozen=True)
class Claimed:
    message_id: uuid.UUID
    until: datetime


def messages_claim(*, limit: int) -> list[Claimed]:
    """Up to ``limit`` due pending messages of enabled endpoints, at most
    ``QUIRE_WEBHOOK_ENDPOINT_CONCURRENCY`` in flight per endpoint, held for ``claim_s()``."""
    if limit <= 0:
        return []
    now = timezone.now()
    cap = settings.QUIRE["WEBHOOK_ENDPOINT_CONCURRENCY"]
    until = now + timedelta(seconds=claim_s())
    with transaction.atomic():
        due = list(
            WebhookMessage.objects.select_for_update(skip_locked=True, of=("self",))
            .filter(state=MessageState.PENDING, next_attempt_at__lte=now, endpoint__enabled=True)
            .order_by("next_attempt_at")
            .values_list("id", "endpoint_id")[: limit * 4]
        )
        if not due:
            return []
        endpoints = {endpoint for _, endpoint in due}
        busy = dict(
            WebhookMessage.objects.filter(
                Q(claimed_until__gt=now),
                state=MessageState.PENDING,
                endpoint_id__in=endpoints,
            )
            .values("endpoint_id")
            .annotate(n=Count("id"))
            .values_list("endpoint_id", "n")
        )
        picked: list[uuid.UUID] = []
        for message_id, endpoint in due:
            if busy.get(endpoint, 0) >= cap:
                continue
            busy[endpoint] = busy.get(endpoint, 0) + 1
            picked.append(message_id)
            if len(picked) == limit:
                break
        WebhookMessage.objects.filter(id__in=picked).update(
            claimed_until=until, next_attempt_at=until
        )
    return [Claimed(message_id, until) for message_id in picked]


def _secrets(endpoint: WebhookEndpoint, now: datetime) -> list[str]:
    found = [signing.secret_unseal(endpoint.secret_sealed)]
    if (
        endpoint.previous_secret_sealed
        and endpoint.previous_secret_expires_at
        and endpoint.previous_secret_expires_at > now
    ):
        found.append(signing.secret_unseal(endpoint.previous_secret_sealed))
    return [s for s in found if s]


def body_bytes(payload: dict[str, Any]) -> bytes:
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()


def message_deliver(claimed: Claimed, *, client: httpx.Client) -> str | None:
    """One attempt at one claimed message: sign, send through the transport, record. Returns
    the attempt's outcome, or None (the message was no longer ours to send)."""
    message = (
        WebhookMessage.objects.select_related("endpoint")
        .filter(id=claimed.message_id, state=MessageState.PENDING, claimed_until=claimed.until)
        .first()
    )
    if message is None:
        return None
    endpoint = message.endpoint
    now = timezone.now()
    secrets_ = _secrets(endpoint, now)
    if not secrets_:  # sealed under another service key: the endpoint cannot sign
        answer = transport.Answer(None, None, "", "secret_unavailable", refused=True)
    else:
        body = body_bytes(payload_render(message))
        headers = signing.headers(
            secrets_=secrets_, msg_id=message.webhook_id, timestamp=int(time.time()), body=body
        )
        answer = transport.post(endpoint.url, body, headers, client=client)
    return attempt_record(message, claimed, answer)


def attempt_record(message: WebhookMessage, claimed: Claimed, answer: transport.Answer) -> str:
    """The attempt's row and the message's next state, fenced on the claim (a replay that
    re-queued the message meanwhile keeps its own schedule); the endpoint's failing streak,
    and its disabling on 410 or on failing too long."""
    now = timezone.now()
    attempts = message.attempts + 1
    endpoint = message.endpoint
    disable: str | None = None
    values: dict[str, Any] = {"attempts": attempts, "claimed_until": None}
    if answer.error is None:
        outcome = "delivered"
        values.update(state=MessageState.DELIVERED, delivered_at=now, last_error=None)
    elif answer.status == 410:
        outcome = "failed"
        disable = DisabledReason.GONE
        values.update(state=MessageState.FAILED, last_error=answer.error)
    else:
        delay = next_delay(attempts, answer.retry_after_s)
        if delay is None:
            outcome = "failed"
            values.update(state=MessageState.FAILED, last_error=answer.error)
        else:
            outcome = "refused" if answer.refused else "retry"
            values.update(next_attempt_at=now + timedelta(seconds=delay), last_error=answer.error)
    with transaction.atomic():
        WebhookAttempt.objects.create(
            message_id=message.id,
            at=now,
            outcome=outcome,
            status_code=answer.status,
            latency_ms=answer.latency_ms,
            response_excerpt=answer.excerpt[: transport.EXCERPT_BYTES],
            error=answer.error,
        )
        WebhookMessage.objects.filter(
            id=message.id, state=MessageState.PENDING, claimed_until=claimed.until
        ).update(**values)
        endpoints = WebhookEndpoint.objects.filter(id=endpoint.id)
        if outcome == "delivered":
            endpoints.filter(failing_since__isnull=False).update(failing_since=None)
        else:
            endpoints.filter(failing_since__isnull=True).update(failing_since=now)
            since = endpoints.values_list("failing_since", flat=True).first()
            limit = timedelta(seconds=settings.QUIRE["WEBHOOK_DISABLE_AFTER_S"])
            if disable is None and since is not None and now - since >= limit:
                disable = DisabledReason.FAILING
        if disable is not None:
            webhook_endpoint_disable(endpoint_id=endpoint.id, reason=disable)
    metrics.WEBHOOK_DELIVERIES.labels(outcome=outcome).inc()
    if answer.latency_ms is not None:
        metrics.WEBHOOK_LATENCY.observe(answer.latency_ms / 1000)
    return outcome


# --- the process's loop ------------------------------------------------------------------------


def _deliver_in_thread(claimed: Claimed, client: httpx.Client) -> str | None:
    try:
        return message_deliver(claimed, client=client)
    except Exception:
        # The claim lapses and the message is sent again; the loop goes on.
        log.exception("webhook delivery failed unexpectedly")
        close_old_connections()
        return None


class _Wakeup:
    """What the loop sleeps on: ``LISTEN quire_webhook`` on a connection of its own (Postgres)
    and a pipe a finished delivery writes to (its slot is free), with a timeout."""

    def __init__(self) -> None:
        self.conn: Any = None
        self.closed = False
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        os.set_blocking(self.write_fd, False)
        self.conn = notify.listen_connection(CHANNEL)

    def poke(self, *_: Any) -> None:
        """A delivery ended (a ``Future`` done callback)."""
        if self.closed:
            return
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self.write_fd, b"x")

    def wait(self, timeout: float) -> None:
        watched = [self.read_fd] + ([self.conn.fileno()] if self.conn is not None else [])
        select.select(watched, [], [], timeout)
        with contextlib.suppress(BlockingIOError):
            while os.read(self.read_fd, 4096):
                pass
        if self.conn is not None:  # consume what arrived: one claim answers them all
            for _ in self.conn.notifies(timeout=0.0):
                pass

    def close(self) -> None:
        self.closed = True
        if self.conn is not None:
            self.conn.close()
        os.close(self.read_fd)
        os.close(self.write_fd)


def run(stop: threading.Event) -> None:
    """Claim and deliver until ``stop`` is set; in-flight deliveries finish first."""
    concurrency = settings.QUIRE["WEBHOOK_CONCURRENCY"]
    poll = settings.QUIRE["WEBHOOK_POLL_S"]
    client = transport.client()
    pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="notifier")
    inflight: set[Future[str | None]] = set()
    wakeup: _Wakeup | None = None
    try:
        while not stop.is_set():
            try:
                if wakeup is None:
                    wakeup = _Wakeup()
                free = concurrency - len(inflight)
                claimed = messages_claim(limit=free)
            except Exception:
                log.exception("notifier: the database is unavailable; retrying")
                close_old_connections()
                if wakeup is not None:
                    wakeup.close()
                    wakeup = None
                stop.wait(poll)
                continue
            for one in claimed:
                future = pool.submit(_deliver_in_thread, one, client)
                future.add_done_callback(wakeup.poke)
                inflight.add(future)
            if claimed and len(claimed) == free:
                # maybe more is due: go on as soon as a slot frees
                done, _ = wait(inflight, timeout=poll, return_when=FIRST_COMPLETED)
                inflight -= done
                continue
            try:
                wakeup.wait(poll)
            except Exception:
                log.exception("notifier: lost the LISTEN connection; reconnecting")
                wakeup.close()
                wakeup = None
            inflight = {f for f in inflight if not f.done()}
    finally:
        pool.shutdown(wait=True)
        client.close()
        if wakeup is not None:
            wakeup.close()
