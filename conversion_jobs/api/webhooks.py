"""``/api/v1/webhooks`` (docs/API_CONTRACT.md §9): a tenant's webhook endpoints, their secrets
(shown at creation and rotation only), the delivery log, replay and recover. Scope
``webhooks:manage``; another tenant's endpoint or message is 404, as a missing one."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from django.utils.dateparse import parse_datetime
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response

from conversion_jobs.api.serializers import problems
from conversion_jobs.api.views import AUTHENTICATED, QuireView
from conversion_jobs.exceptions import InvalidWebhook, NotFound
from conversion_jobs.representation import iso
from conversion_jobs.webhooks import endpoints
from conversion_jobs.webhooks.models import (
    EventType,
    WebhookAttempt,
    WebhookEndpoint,
    WebhookMessage,
)

SCOPE = "webhooks:manage"


class EndpointInSerializer(serializers.Serializer):
    url = serializers.CharField(max_length=2048)
    events = serializers.ListField(child=serializers.ChoiceField(choices=EventType.choices))
    description = serializers.CharField(required=False, max_length=256)


class EndpointPatchSerializer(serializers.Serializer):
    url = serializers.CharField(required=False, max_length=2048)
    events = serializers.ListField(
        required=False, child=serializers.ChoiceField(choices=EventType.choices)
    )
    description = serializers.CharField(required=False, max_length=256)
    enabled = serializers.BooleanField(required=False)


class EndpointSerializer(serializers.Serializer):
    id = serializers.UUIDField()
    url = serializers.CharField()
    events = serializers.ListField(child=serializers.ChoiceField(choices=EventType.choices))
    description = serializers.CharField()
    enabled = serializers.BooleanField()
    disabled_reason = serializers.CharField(allow_null=True)
    disabled_at = serializers.DateTimeField(allow_null=True)
    previous_secret_expires_at = serializers.DateTimeField(allow_null=True)
    created_at = serializers.DateTimeField()
    updated_at = serializers.DateTimeField()


class EndpointWithSecretSerializer(EndpointSerializer):
    secret = serializers.CharField(help_text="whsec_…: shown only in this answer")


class EndpointListSerializer(serializers.Serializer):
    endpoints = EndpointSerializer(many=True)


class MessageSerializer(serializers.Serializer):
    id = serializers.CharField(help_text="msg_…: the webhook-id header of every delivery")
    event_type = serializers.ChoiceField(choices=EventType.choices)
    job_id = serializers.UUIDField()
    state = serializers.ChoiceField(choices=["pending", "delivered", "failed"])
    attempts = serializers.IntegerField()
    created_at = serializers.DateTimeField()
    next_attempt_at = serializers.DateTimeField(allow_null=True)
    delivered_at = serializers.DateTimeField(allow_null=True)
    last_error = serializers.CharField(allow_null=True)


class MessageListSerializer(serializers.Serializer):
    messages = MessageSerializer(many=True)


class AttemptSerializer(serializers.Serializer):
    at = serializers.DateTimeField()
    outcome = serializers.CharField()
    status_code = serializers.IntegerField(allow_null=True)
    latency_ms = serializers.IntegerField(allow_null=True)
    response_excerpt = serializers.CharField()
    error = serializers.CharField(allow_null=True)


class AttemptListSerializer(serializers.Serializer):
    attempts = AttemptSerializer(many=True)


class RecoverInSerializer(serializers.Serializer):
    since = serializers.DateTimeField()


class RecoverSerializer(serializers.Serializer):
    requeued = serializers.IntegerField()


def endpoint_representation(endpoint: WebhookEndpoint, secret: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": str(endpoint.id),
        "url": endpoint.url,
        "events": endpoint.events,
        "description": endpoint.description,
        "enabled": endpoint.enabled,
        "disabled_reason": endpoint.disabled_reason,
        "disabled_at": iso(endpoint.disabled_at),
        "previous_secret_expires_at": iso(endpoint.previous_secret_expires_at),
        "created_at": iso(endpoint.created_at),
        "updated_at": iso(endpoint.updated_at),
    }
    if secret is not None:
        body["secret"] = secret
    return body


def message_representation(message: WebhookMessage) -> dict[str, Any]:
    return {
        "id": message.webhook_id,
        "event_type": message.event_type,
        "job_id": str(message.job_id),
        "state": message.state,
        "attempts": message.attempts,
        "created_at": iso(message.created_at),
        "next_attempt_at": iso(message.next_attempt_at) if message.state == "pending" else None,
        "delivered_at": iso(message.delivered_at),
        "last_error": message.last_error,
    }


def attempt_representation(attempt: WebhookAttempt) -> dict[str, Any]:
    return {
        "at": iso(attempt.at),
        "outcome": attempt.outcome,
        "status_code": attempt.status_code,
        "latency_ms": attempt.latency_ms,
        "response_excerpt": attempt.response_excerpt,
        "error": attempt.error,
    }


def _body(request: Request) -> dict[str, Any]:
    data = request.data
    if not isinstance(data, dict):
        raise InvalidWebhook("send a JSON object")
    return dict(data)


def _message_id(value: str) -> uuid.UUID:
    """``msg_<hex>`` (as the webhook-id header) -> the row's id; anything else is not found."""
    try:
        return uuid.UUID(hex=value.removeprefix("msg_"))
    except ValueError as exc:
        raise NotFound() from exc


class WebhookCollectionView(QuireView):
    required_scopes = {"GET": SCOPE, "POST": SCOPE}

    @extend_schema(
        request=EndpointInSerializer,
        responses={201: EndpointWithSecretSerializer, **problems(*AUTHENTICATED)},
        summary="Register a webhook endpoint (its secret is shown only in this answer)",
        operation_id="webhooks_create",
    )
    def post(self, request: Request) -> Response:
        data = _body(request)
        endpoint, secret = endpoints.webhook_endpoint_create(
            tenant=self.principal.tenant,
            actor=self.principal.actor,
            url=data.get("url"),
            events=data.get("events"),
            description=data.get("description"),
        )
        return Response(
            endpoint_representation(endpoint, secret),
            status=201,
            headers={"Location": f"/api/v1/webhooks/{endpoint.id}"},
        )

    @extend_schema(
        responses={200: EndpointListSerializer, **problems(*AUTHENTICATED)},
        summary="List the tenant's webhook endpoints",
        operation_id="webhooks_list",
    )
    def get(self, request: Request) -> Response:
        found = endpoints.webhook_endpoint_list(tenant=self.principal.tenant)
        return Response({"endpoints": [endpoint_representation(e) for e in found]})


class WebhookDetailView(QuireView):
    required_scopes = {"GET": SCOPE, "PATCH": SCOPE, "DELETE": SCOPE}

    @extend_schema(
        responses={200: EndpointSerializer, **problems(*AUTHENTICATED, 404)},
        summary="One webhook endpoint (never its secret)",
        operation_id="webhooks_get",
    )
    def get(self, request: Request, endpoint_id: uuid.UUID) -> Response:
        endpoint = endpoints.webhook_endpoint_get(
            tenant=self.principal.tenant, endpoint_id=endpoint_id
        )
        return Response(endpoint_representation(endpoint))

    @extend_schema(
        request=EndpointPatchSerializer,
        responses={200: EndpointSerializer, **problems(*AUTHENTICATED, 404)},
        summary="Change an endpoint's url, events, description, or enable / disable it",
        operation_id="webhooks_update",
    )
    def patch(self, request: Request, endpoint_id: uuid.UUID) -> Response:
        endpoint = endpoints.webhook_endpoint_update(
            tenant=self.principal.tenant,
            endpoint_id=endpoint_id,
            actor=self.principal.actor,
            changes=_body(request),
        )
        return Response(endpoint_representation(endpoint))

    @extend_schema(
        request=None,
        responses={204: None, **problems(*AUTHENTICATED, 404)},
        summary="Delete an endpoint with its delivery log",
        operation_id="webhooks_delete",
    )
    def delete(self, request: Request, endpoint_id: uuid.UUID) -> Response:
        endpoints.webhook_endpoint_delete(
            tenant=self.principal.tenant, endpoint_id=endpoint_id, actor=self.principal.actor
        )
        return Response(status=204)


class WebhookRotateView(QuireView):
    required_scopes = {"POST": SCOPE}

    @extend_schema(
        request=None,
        responses={200: EndpointWithSecretSerializer, **problems(*AUTHENTICATED, 404)},
        summary="A new secret; the previous one keeps signing for the rotation grace",
        operation_id="webhooks_rotate_secret",
    )
    def post(self, request: Request, endpoint_id: uuid.UUID) -> Response:
        endpoint, secret = endpoints.webhook_endpoint_rotate(
            tenant=self.principal.tenant, endpoint_id=endpoint_id, actor=self.principal.actor
        )
        return Response(endpoint_representation(endpoint, secret))


class WebhookMessagesView(QuireView):
    required_scopes = {"GET": SCOPE}

    @extend_schema(
        parameters=[OpenApiParameter("limit", {"type": "integer", "minimum": 1, "maximum": 100})],
        responses={200: MessageListSerializer, **problems(*AUTHENTICATED, 404)},
        summary="The endpoint's messages, newest first",
        operation_id="webhooks_messages",
    )
    def get(self, request: Request, endpoint_id: uuid.UUID) -> Response:
        found = endpoints.webhook_messages_list(
            tenant=self.principal.tenant, endpoint_id=endpoint_id, limit=self.query_limit(50)
        )
        return Response({"messages": [message_representation(m) for m in found]})


class WebhookAttemptsView(QuireView):
    required_scopes = {"GET": SCOPE}

    @extend_schema(
        responses={200: AttemptListSerializer, **problems(*AUTHENTICATED, 404)},
        summary="The delivery attempts of one message",
        operation_id="webhooks_message_attempts",
    )
    def get(self, request: Request, endpoint_id: uuid.UUID, message_id: str) -> Response:
        found = endpoints.webhook_attempts_list(
            tenant=self.principal.tenant,
            endpoint_id=endpoint_id,
            message_id=_message_id(message_id),
        )
        return Response({"attempts": [attempt_representation(a) for a in found]})


class WebhookReplayView(QuireView):
    required_scopes = {"POST": SCOPE}

    @extend_schema(
        request=None,
        responses={202: MessageSerializer, **problems(*AUTHENTICATED, 404)},
        summary="Deliver one message again (same webhook-id and body)",
        operation_id="webhooks_message_replay",
    )
    def post(self, request: Request, endpoint_id: uuid.UUID, message_id: str) -> Response:
        message = endpoints.webhook_message_replay(
            tenant=self.principal.tenant,
            endpoint_id=endpoint_id,
            message_id=_message_id(message_id),
        )
        return Response(message_representation(message), status=202)


class WebhookRecoverView(QuireView):
    required_scopes = {"POST": SCOPE}

    @extend_schema(
        request=RecoverInSerializer,
        responses={202: RecoverSerializer, **problems(*AUTHENTICATED, 404)},
        summary="Deliver again every message of the endpoint created since a time",
        operation_id="webhooks_recover",
    )
    def post(self, request: Request, endpoint_id: uuid.UUID) -> Response:
        since_raw = _body(request).get("since")
        since: datetime | None = parse_datetime(since_raw) if isinstance(since_raw, str) else None
        if since is None or since.tzinfo is None:
            raise InvalidWebhook("since must be an RFC 3339 date-time with its offset")
        count = endpoints.webhook_messages_recover(
            tenant=self.principal.tenant, endpoint_id=endpoint_id, since=since
        )
        return Response({"requeued": count}, status=202)
