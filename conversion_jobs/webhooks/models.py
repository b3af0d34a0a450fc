"""The webhook tables (docs/DATA_MODEL.md §9, ADR 0020): endpoints per tenant, the messages the
terminal hook writes in the terminal transaction (the outbox again), one row per delivery
attempt. Imported by ``conversion_jobs.models`` (one app, one migration history)."""

from __future__ import annotations

import uuid

from django.db import models
from django.db.models import Q


class EventType(models.TextChoices):
    #: The job ended ``succeeded``.
    SUCCEEDED = "job.succeeded"
    #: The job ended ``partial``.
    PARTIAL = "job.partial"
    #: The job ended ``failed``.
    FAILED = "job.failed"
    #: The job ended ``cancelled``.
    CANCELLED = "job.cancelled"


class DisabledReason(models.TextChoices):
    #: The tenant disabled it (PATCH ``enabled: false``).
    BY_TENANT = "by_tenant"
    #: A delivery was answered 410 Gone.
    GONE = "gone"
    #: Every delivery failed for ``QUIRE_WEBHOOK_DISABLE_AFTER_S``.
    FAILING = "failing"


class WebhookEndpoint(models.Model):
    """A tenant's receiver. Its signing secrets are sealed at rest (``webhooks/secrets.py``);
    during a rotation's grace the previous secret signs too, until its expiry."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    tenant = models.CharField(max_length=64)
    url = models.CharField(max_length=2048)
    #: the event types it subscribes to (a list of ``EventType`` values)
    events = models.JSONField(default=list)
    description = models.CharField(max_length=256, blank=True, default="")
    enabled = models.BooleanField(default=True)
    disabled_reason = models.CharField(
        max_length=16, choices=DisabledReason.choices, null=True, blank=True
    )
    disabled_at = models.DateTimeField(null=True, blank=True)
    secret_sealed = models.TextField(editable=False)
    previous_secret_sealed = models.TextField(null=True, blank=True, editable=False)
    previous_secret_expires_at = models.DateTimeField(null=True, blank=True)
    #: the first failed delivery since the last success (None: the last delivery succeeded)
    failing_since = models.DateTimeField(null=True, blank=True)
    #: the head of this endpoint's audit chain (execution_audit_event rows keyed by its id:
    #: created, secret rotated, disabled, deleted), moved under the endpoint row's lock
    audit_seq = models.PositiveIntegerField(default=0)
    audit_head = models.CharField(max_length=64, default="0" * 64)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        db_table = "webhook_endpoint"
        constraints = [
            models.CheckConstraint(
                name="webhook_endpoint_disabled_iff_reason",
                condition=(Q(enabled=True) & Q(disabled_at__isnull=True))
                | (Q(enabled=False) & Q(disabled_at__isnull=False)),
            ),
        ]
        indexes = [
            # the terminal hook's lookup: the tenant's enabled endpoints
            models.Index(
                name="webhook_endpoint_tenant", fields=["tenant"], condition=Q(enabled=True)
            ),
            models.Index(name="webhook_endpoint_tenant_all", fields=["tenant", "created_at"]),
        ]

    def __str__(self) -> str:
        return f"webhook endpoint {self.id}"


class MessageState(models.TextChoices):
    #: Waiting for its (next) delivery at ``next_attempt_at``.
    PENDING = "pending"
    #: A 2xx answer was received.
    DELIVERED = "delivered"
    #: The retry schedule is spent (or the endpoint is gone); replayable.
    FAILED = "failed"


class WebhookMessage(models.Model):
    """One event for one endpoint. ``webhook-id`` is ``msg_<id hex>``, the same on every retry.
    ``payload`` is the body as first delivered: the ORM terminal hook renders it in the terminal
    transaction; the publish statement (``store.jobs.PUBLISH``) leaves it NULL and the notifier
    renders it from the job row at its first claim (a succeeded or partial job's representation
    does not change after its publish, retention aside) and keeps it for every retry."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    endpoint = models.ForeignKey(WebhookEndpoint, on_delete=models.CASCADE, related_name="+")
    # No foreign key: a message outlives nothing it needs from the job row once rendered.
    job_id = models.UUIDField()
    event_type = models.CharField(max_length=32, choices=EventType.choices)
    payload = models.JSONField(null=True, blank=True)
    state = models.CharField(
        max_length=16, choices=MessageState.choices, default=MessageState.PENDING
    )
    attempts = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField()
    next_attempt_at = models.DateTimeField()
    #: a notifier holds it until then (a crashed notifier's claim lapses; ADR 0020)
    claimed_until = models.DateTimeField(null=True, blank=True)
    delivered_at = models.DateTimeField(null=True, blank=True)
    last_error = models.CharField(max_length=48, null=True, blank=True)

    class Meta:
        db_table = "webhook_message"
        constraints = [
            models.CheckConstraint(
                name="webhook_message_delivered_iff_at",
                condition=(Q(state=MessageState.DELIVERED) & Q(delivered_at__isnull=False))
                | (~Q(state=MessageState.DELIVERED) & Q(delivered_at__isnull=True)),
            ),
        ]
        indexes = [
            # the notifier's claim: due pending messages
            models.Index(
                name="webhook_message_due",
                fields=["next_attempt_at"],
                condition=Q(state=MessageState.PENDING),
            ),
            # the delivery log per endpoint, newest first; recover's range
            models.Index(name="webhook_message_endpoint", fields=["endpoint", "-created_at"]),
        ]

    def __str__(self) -> str:
        return f"webhook message {self.webhook_id}"

    @property
    def webhook_id(self) -> str:
        return f"msg_{self.id.hex}"


class WebhookAttempt(models.Model):
    """One delivery attempt: what came back, never what was sent (no secret, no signature)."""

    id = models.BigAutoField(primary_key=True)
    message = models.ForeignKey(WebhookMessage, on_delete=models.CASCADE, related_name="+")
    at = models.DateTimeField()
    #: ``delivered``, ``retry`` (scheduled again), ``failed`` (schedule spent), ``refused``
    #: (the transport refused the address before connecting)
    outcome = models.CharField(max_length=16)
    status_code = models.PositiveIntegerField(null=True, blank=True)
    latency_ms = models.PositiveIntegerField(null=True, blank=True)
    #: at most 1 KB of the response body, decoded leniently
    response_excerpt = models.CharField(max_length=1024, blank=True, default="")
    #: the stable reason code of a failure or refusal (docs/API_CONTRACT.md §9)
    error = models.CharField(max_length=48, null=True, blank=True)

    class Meta:
        db_table = "webhook_attempt"
        indexes = [models.Index(name="webhook_attempt_message", fields=["message", "at"])]

    def __str__(self) -> str:
        return f"webhook attempt {self.id}"
