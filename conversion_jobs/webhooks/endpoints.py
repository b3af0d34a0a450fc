"""Webhook endpoints and their delivery log, per tenant (docs/API_CONTRACT.md §9): the services
behind ``/api/v1/webhooks``. Every read and write is scoped to the caller's tenant; another
tenant's endpoint is not found. Audit events (created, secret rotated, disabled, deleted) go to
``execution_audit_event`` keyed by the endpoint's id, chained on the endpoint row like a job's,
with metadata only: never the URL or a secret."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from conversion_jobs.exceptions import (
    InvalidWebhook,
    InvalidWebhookEvents,
    InvalidWebhookUrl,
    NotFound,
)
from conversion_jobs.models import ExecutionAuditEvent
from conversion_jobs.services.audit import event_hash
from conversion_jobs.store import notify
from conversion_jobs.webhooks import signing
from conversion_jobs.webhooks.models import (
    DisabledReason,
    EventType,
    MessageState,
    WebhookAttempt,
    WebhookEndpoint,
    WebhookMessage,
)
from conversion_jobs.webhooks.transport import Refused, url_check

URL_MAX = 2048
DESCRIPTION_MAX = 256
CHANNEL = "quire_webhook"


def _url(value: Any) -> str:
    if not isinstance(value, str) or not value or len(value) > URL_MAX:
        raise InvalidWebhookUrl(f"url must be a string of 1 to {URL_MAX} characters")
    try:
        url_check(value)
    except Refused as refused:
        raise InvalidWebhookUrl(reason=refused.code) from refused
    return value


def _events(value: Any) -> list[str]:
    if (
        not isinstance(value, list)
        or not value
        or not all(isinstance(e, str) and e in EventType.values for e in value)
    ):
        raise InvalidWebhookEvents()
    return sorted(set(value))


def _description(value: Any) -> str:
    if value is None:
        return ""
    if not isinstance(value, str) or len(value) > DESCRIPTION_MAX:
        raise InvalidWebhook(
            f"description must be a string of at most {DESCRIPTION_MAX} characters"
        )
    return value


def webhook_endpoint_get(*, tenant: str, endpoint_id: uuid.UUID) -> WebhookEndpoint:
    endpoint = WebhookEndpoint.objects.filter(id=endpoint_id, tenant=tenant).first()
    if endpoint is None:
        raise NotFound()
    return endpoint


def webhook_endpoint_list(*, tenant: str) -> list[WebhookEndpoint]:
    return list(WebhookEndpoint.objects.filter(tenant=tenant).order_by("-created_at", "-id"))


def webhook_endpoint_create(
    *, tenant: str, actor: str, url: Any, events: Any, description: Any = None
) -> tuple[WebhookEndpoint, str]:
    """A new enabled endpoint and its secret (the only time the secret leaves the service)."""
    secret = signing.secret_new()
    endpoint = WebhookEndpoint(
        tenant=tenant,
        url=_url(url),
        events=_events(events),
        description=_description(description),
        secret_sealed=signing.secret_seal(secret),
    )
    with transaction.atomic():
        endpoint.save(force_insert=True)
        _audit(endpoint.id, "webhook_created", actor, {"events": endpoint.events})
    return endpoint, secret


def webhook_endpoint_update(
    *, tenant: str, endpoint_id: uuid.UUID, actor: str, changes: dict[str, Any]
) -> WebhookEndpoint:
    """PATCH: ``url``, ``events``, ``description``, ``enabled`` (False disables it by the
    tenant; True enables it again and forgets its failing streak)."""
    unknown = set(changes) - {"url", "events", "description", "enabled"}
    if unknown:
        raise InvalidWebhook(f"unknown field(s): {', '.join(sorted(unknown))}")
    values: dict[str, Any] = {}
    if "url" in changes:
        values["url"] = _url(changes["url"])
    if "events" in changes:
        values["events"] = _events(changes["events"])
    if "description" in changes:
        values["description"] = _description(changes["description"])
    enabled = changes.get("enabled")
    if "enabled" in changes and not isinstance(enabled, bool):
        raise InvalidWebhook("enabled must be true or false")
    with transaction.atomic():
        endpoint = _locked(tenant, endpoint_id)
        for name, value in values.items():
            setattr(endpoint, name, value)
        endpoint.save(update_fields=[*values, "updated_at"])
        if enabled is False and endpoint.enabled:
            webhook_endpoint_disable(
                endpoint_id=endpoint.id, reason=DisabledReason.BY_TENANT, actor=actor
            )
        elif enabled is True and not endpoint.enabled:
            WebhookEndpoint.objects.filter(id=endpoint.id).update(
                enabled=True,
                disabled_reason=None,
                disabled_at=None,
                failing_since=None,
                updated_at=timezone.now(),
            )
            _audit(endpoint.id, "webhook_enabled", actor, {})
    return WebhookEndpoint.objects.get(id=endpoint.id)


def webhook_endpoint_delete(*, tenant: str, endpoint_id: uuid.UUID, actor: str) -> None:
    """The endpoint goes, with its messages and their attempts (its audit events stay)."""
    with transaction.atomic():
        endpoint = _locked(tenant, endpoint_id)
        _audit(endpoint.id, "webhook_deleted", actor, {})
        endpoint.delete()


def webhook_endpoint_rotate(
    *, tenant: str, endpoint_id: uuid.UUID, actor: str
) -> tuple[WebhookEndpoint, str]:
    """A new secret; the current one keeps signing beside it for
    ``QUIRE_WEBHOOK_ROTATION_GRACE_S`` (a second rotation within the grace drops the oldest)."""
    secret = signing.secret_new()
    grace = timedelta(seconds=settings.QUIRE["WEBHOOK_ROTATION_GRACE_S"])
    with transaction.atomic():
        endpoint = _locked(tenant, endpoint_id)
        endpoint.previous_secret_sealed = endpoint.secret_sealed
        endpoint.previous_secret_expires_at = timezone.now() + grace
        endpoint.secret_sealed = signing.secret_seal(secret)
        endpoint.save(
            update_fields=[
                "previous_secret_sealed",
                "previous_secret_expires_at",
                "secret_sealed",
                "updated_at",
            ]
        )
        _audit(
            endpoint.id, "webhook_secret_rotated", actor, {"grace_s": int(grace.total_seconds())}
        )
    return endpoint, secret


def webhook_endpoint_disable(*, endpoint_id: uuid.UUID, reason: str, actor: str = "system") -> bool:
    """Enabled -> disabled with ``reason`` (guarded: True only for the call that disabled it).
    Its pending messages stay pending (a re-enabled endpoint gets them); the notifier skips a
    disabled endpoint's messages."""
    with transaction.atomic():
        won = WebhookEndpoint.objects.filter(id=endpoint_id, enabled=True).update(
            enabled=False,
            disabled_reason=reason,
            disabled_at=timezone.now(),
            updated_at=timezone.now(),
        )
        if won:
            _audit(endpoint_id, "webhook_disabled", actor, {"reason": reason})
    return bool(won)


def _locked(tenant: str, endpoint_id: uuid.UUID) -> WebhookEndpoint:
    endpoint = (
        WebhookEndpoint.objects.select_for_update().filter(id=endpoint_id, tenant=tenant).first()
    )
    if endpoint is None:
        raise NotFound()
    return endpoint


def _audit(endpoint_id: uuid.UUID, event_type: str, actor: str, details: dict[str, Any]) -> None:
    """Append to the endpoint's audit chain under its row lock (inside the caller's
    transaction)."""
    seq, head = (
        WebhookEndpoint.objects.select_for_update()
        .filter(id=endpoint_id)
        .values_list("audit_seq", "audit_head")
        .get()
    )
    event: dict[str, Any] = {
        "job_id": endpoint_id,
        "seq": seq + 1,
        "event_type": event_type,
        "generation": None,
        "attempt_id": None,
        "actor": actor,
        "details": details,
        "created_at": timezone.now(),
    }
    digest = event_hash(prev_hash=head, **event)
    ExecutionAuditEvent.objects.create(**event, prev_hash=head, hash=digest)
    WebhookEndpoint.objects.filter(id=endpoint_id).update(audit_seq=seq + 1, audit_head=digest)


# --- the delivery log, replay, recover ---------------------------------------------------------


def webhook_messages_list(
    *, tenant: str, endpoint_id: uuid.UUID, limit: int = 50
) -> list[WebhookMessage]:
    webhook_endpoint_get(tenant=tenant, endpoint_id=endpoint_id)
    return list(
        WebhookMessage.objects.filter(endpoint_id=endpoint_id).order_by("-created_at", "-id")[
            :limit
        ]
    )


def webhook_message_get(
    *, tenant: str, endpoint_id: uuid.UUID, message_id: uuid.UUID
) -> WebhookMessage:
    webhook_endpoint_get(tenant=tenant, endpoint_id=endpoint_id)
    message = WebhookMessage.objects.filter(id=message_id, endpoint_id=endpoint_id).first()
    if message is None:
        raise NotFound()
    return message


def webhook_attempts_list(
    *, tenant: str, endpoint_id: uuid.UUID, message_id: uuid.UUID
) -> list[WebhookAttempt]:
    webhook_message_get(tenant=tenant, endpoint_id=endpoint_id, message_id=message_id)
    return list(WebhookAttempt.objects.filter(message_id=message_id).order_by("at", "id"))


def webhook_message_replay(
    *, tenant: str, endpoint_id: uuid.UUID, message_id: uuid.UUID
) -> WebhookMessage:
    """The message is due again now, with the same ``webhook-id`` and body (a fresh retry
    schedule). A message already pending just stays so."""
    message = webhook_message_get(tenant=tenant, endpoint_id=endpoint_id, message_id=message_id)
    with transaction.atomic():
        _requeue(WebhookMessage.objects.filter(id=message.id))
    return WebhookMessage.objects.get(id=message.id)


def webhook_messages_recover(*, tenant: str, endpoint_id: uuid.UUID, since: datetime) -> int:
    """Every message of the endpoint created at or after ``since`` is due again now (the
    delivered and the failed: a receiver that lost its data gets it all again). Returns how
    many were re-queued."""
    webhook_endpoint_get(tenant=tenant, endpoint_id=endpoint_id)
    with transaction.atomic():
        return _requeue(
            WebhookMessage.objects.filter(endpoint_id=endpoint_id, created_at__gte=since)
        )


def _requeue(messages: Any) -> int:
    """Due now: a pending message keeps its attempts (it is still in its schedule), any other
    starts a fresh schedule. (Pending ones first: the second update makes more of them.)"""
    now = timezone.now()
    count = int(messages.filter(state=MessageState.PENDING).update(next_attempt_at=now))
    count += int(
        messages.exclude(state=MessageState.PENDING).update(
            state=MessageState.PENDING,
            attempts=0,
            next_attempt_at=now,
            claimed_until=None,
            delivered_at=None,
            last_error=None,
        )
    )
    if count:
        notify.notify(CHANNEL)  # delivered on commit: the notifier wakes
    return count
