"""The webhook outbox (docs/API_CONTRACT.md §9, ADR 0020): the terminal hook writes one message
row per enabled endpoint of the job's tenant subscribed to the event, in the transaction that
moved the job to its terminal state. The publish statement writes the same rows in SQL
(``store/jobs.py``, ``WEBHOOK_MESSAGES``); ``tests/integration/webhooks/test_outbox.py`` holds
the two in step."""

from __future__ import annotations

import uuid
from typing import Any

from django.db.models import Subquery
from django.utils import timezone

from conversion_jobs.models import ConversionJob
from conversion_jobs.representation import iso, job_representation
from conversion_jobs.states import State
from conversion_jobs.webhooks.models import EventType, WebhookEndpoint, WebhookMessage

#: terminal state -> the event type its messages carry
EVENT_OF_STATE: dict[State, EventType] = {
    State.SUCCEEDED: EventType.SUCCEEDED,
    State.PARTIAL: EventType.PARTIAL,
    State.FAILED: EventType.FAILED,
    State.CANCELLED: EventType.CANCELLED,
}


def event_payload(job: ConversionJob, event_type: str) -> dict[str, Any]:
    """The thin body: the event type, when the job ended, the job as the API renders it (its
    metadata included, never document content)."""
    return {
        "type": event_type,
        "timestamp": iso(job.finished_at or job.updated_at),
        "data": job_representation(job),
    }


def subscribed_endpoints(*, job_id: uuid.UUID, event_type: str) -> list[uuid.UUID]:
    """The enabled endpoints of the job's tenant subscribed to ``event_type`` now (one query;
    the event filter in Python: the list is short and JSON containment is not portable)."""
    tenant = ConversionJob.objects.filter(id=job_id).values("tenant")
    rows = WebhookEndpoint.objects.filter(tenant=Subquery(tenant), enabled=True).values_list(
        "id", "events"
    )
    return [endpoint for endpoint, events in rows if event_type in (events or [])]


def messages_enqueue(*, job_id: uuid.UUID, state: State) -> int:
    """The terminal hook's webhook part (runs inside the terminal transaction): one pending
    message per subscribed endpoint, its payload rendered from the job row as the transaction
    left it. Returns how many it wrote."""
    event_type = EVENT_OF_STATE[state]
    endpoints = subscribed_endpoints(job_id=job_id, event_type=event_type)
    if not endpoints:
        return 0
    payload = event_payload(ConversionJob.objects.get(id=job_id), event_type)
    now = timezone.now()
    WebhookMessage.objects.bulk_create(
        WebhookMessage(
            endpoint_id=endpoint,
            job_id=job_id,
            event_type=event_type,
            payload=payload,
            created_at=now,
            next_attempt_at=now,
        )
        for endpoint in endpoints
    )
    return len(endpoints)


def payload_render(message: WebhookMessage) -> dict[str, Any]:
    """The message's body: as stored, or - a message of the publish statement - rendered from
    the job row now and kept (the first renderer wins: every retry sends the same body)."""
    if message.payload is not None:
        return message.payload
    job = ConversionJob.objects.filter(id=message.job_id).first()
    if job is None:  # purged by retention before the first delivery: the id is all there is
        payload: dict[str, Any] = {
            "type": message.event_type,
            "timestamp": None,
            "data": {"id": str(message.job_id)},
        }
    else:
        payload = event_payload(job, message.event_type)
    WebhookMessage.objects.filter(id=message.id, payload__isnull=True).update(payload=payload)
    stored = WebhookMessage.objects.filter(id=message.id).values_list("payload", flat=True).first()
    message.payload = stored if stored is not None else payload
    return message.payload
