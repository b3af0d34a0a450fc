"""``/api/v1/webhooks`` (docs/API_CONTRACT.md §9): CRUD, the secret shown at creation and
rotation only and sealed at rest, tenancy (another tenant's endpoint is the same 404 as a
missing one), the ``webhooks:manage`` scope, validation codes, the delivery log, replay and
recover, audit events with no URL or secret; and the job's ``metadata``."""

from __future__ import annotations

import base64
import json
import uuid
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from conversion_jobs.models import ExecutionAuditEvent, WebhookEndpoint, WebhookMessage
from conversion_jobs.services.audit import audit_chain_verify
from conversion_jobs.webhooks import signing
from conversion_jobs.webhooks.models import WebhookAttempt
from tests.conftest import token
from tests.integration.api.conftest import problem, submit

pytestmark = pytest.mark.django_db(transaction=True)
URL = "https://hooks.example.com/quire"
EVENTS = ["job.failed", "job.succeeded"]


def _client(tenant: str = "tenant-a", scopes: tuple[str, ...] = ("webhooks:manage",)) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token(tenant=tenant, scopes=scopes)}")
    return client


def _create(client: APIClient, **body: Any) -> Any:
    return client.post("/api/v1/webhooks", {"url": URL, "events": EVENTS, **body}, format="json")


def test_webhooks_api__create_shows_the_secret_once():
    client = _client()
    created = _create(client, description="pipeline")
    assert created.status_code == 201, created.content
    body = created.json()
    assert created["Location"] == f"/api/v1/webhooks/{body['id']}"
    assert body["url"] == URL and body["events"] == EVENTS and body["enabled"] is True
    secret = body["secret"]
    assert secret.startswith("whsec_") and len(base64.b64decode(secret[6:])) >= 24

    shown = client.get(f"/api/v1/webhooks/{body['id']}").json()
    assert "secret" not in shown and shown["description"] == "pipeline"
    listed = client.get("/api/v1/webhooks").json()["endpoints"]
    assert [e["id"] for e in listed] == [body["id"]] and "secret" not in listed[0]
    # sealed at rest: the row never holds the clear secret, and it opens with the service key
    row = WebhookEndpoint.objects.get(id=body["id"])
    assert secret not in row.secret_sealed
    assert signing.secret_unseal(row.secret_sealed) == secret


def test_webhooks_api__patch_delete_and_audit_without_url_or_secret():
    client = _client()
    body = _create(client).json()
    path = f"/api/v1/webhooks/{body['id']}"

    patched = client.patch(
        path, {"events": ["job.cancelled"], "description": "d", "enabled": False}, format="json"
    ).json()
    assert patched["events"] == ["job.cancelled"] and patched["enabled"] is False
    assert patched["disabled_reason"] == "by_tenant" and patched["disabled_at"]
    again = client.patch(path, {"enabled": True}, format="json").json()
    assert again["enabled"] is True and again["disabled_reason"] is None

    rotated = client.post(f"{path}/rotate-secret").json()
    assert rotated["secret"] != body["secret"] and rotated["previous_secret_expires_at"]
    assert client.delete(path).status_code == 204
    problem(client.get(path), 404, "not_found")

    events = list(ExecutionAuditEvent.objects.filter(job_id=body["id"]).order_by("seq"))
    assert [e.event_type for e in events] == [
        "webhook_created",
        "webhook_disabled",
        "webhook_enabled",
        "webhook_secret_rotated",
        "webhook_deleted",
    ]
    text = json.dumps([e.details for e in events]) + "".join(e.actor for e in events)
    assert URL not in text and "whsec_" not in text and "tester" not in text
    assert audit_chain_verify(job_id=uuid.UUID(body["id"]))[1] == []


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ({"url": "ftp://hooks.example.com/"}, "invalid_webhook_url"),
        ({"url": "https://user:pw@hooks.example.com/"}, "invalid_webhook_url"),
        ({"url": "https://hooks.example.com:8443/"}, "invalid_webhook_url"),
        ({"url": "http://127.0.0.1/"}, "invalid_webhook_url"),
        ({"url": "http://[64:ff9b::7f00:1]/"}, "invalid_webhook_url"),
        ({"url": 5}, "invalid_webhook_url"),
        ({"url": "https://hooks.example.com/" + "a" * 2048}, "invalid_webhook_url"),
        ({"events": []}, "invalid_webhook_events"),
        ({"events": ["job.exploded"]}, "invalid_webhook_events"),
        ({"events": "job.failed"}, "invalid_webhook_events"),
        ({"description": "x" * 257}, "invalid_webhook"),
    ],
)
def test_webhooks_api__validation_codes(body, code):
    answer = problem(_create(_client(), **body), 400, code)
    if code == "invalid_webhook_url" and isinstance(body["url"], str) and len(body["url"]) < 100:
        assert answer.get("reason")
    assert WebhookEndpoint.objects.count() == 0


def test_webhooks_api__patch_unknown_field_and_bad_enabled():
    client = _client()
    path = f"/api/v1/webhooks/{_create(client).json()['id']}"
    problem(client.patch(path, {"secret": "whsec_x"}, format="json"), 400, "invalid_webhook")
    problem(client.patch(path, {"enabled": "no"}, format="json"), 400, "invalid_webhook")
    problem(
        client.patch(path, {"url": "http://10.0.0.1/"}, format="json"), 400, "invalid_webhook_url"
    )


def test_webhooks_api__other_tenants_endpoint_is_the_same_404_as_a_missing_one():
    theirs = _create(_client(tenant="tenant-b")).json()["id"]
    missing = str(uuid.uuid4())
    mine = _client()
    for method, suffix, body in [
        ("get", "", None),
        ("patch", "", {"description": "x"}),
        ("delete", "", None),
        ("post", "/rotate-secret", None),
        ("get", "/messages", None),
        ("post", "/recover", {"since": "2026-01-01T00:00:00Z"}),
        ("get", f"/messages/msg_{uuid.uuid4().hex}/attempts", None),
        ("post", f"/messages/msg_{uuid.uuid4().hex}/replay", None),
    ]:
        answers = []
        for endpoint_id in (theirs, missing):
            response = getattr(mine, method)(
                f"/api/v1/webhooks/{endpoint_id}{suffix}", body, format="json"
            )
            answers.append(
                (response.status_code, response.content.replace(endpoint_id.encode(), b""))
            )
        assert answers[0] == answers[1] and answers[0][0] == 404, (method, suffix)
    assert mine.get("/api/v1/webhooks").json() == {"endpoints": []}
    assert WebhookEndpoint.objects.get(id=theirs).description == ""


def test_webhooks_api__scope_required():
    client = _client(scopes=("jobs:read", "jobs:submit", "jobs:cancel", "jobs:admin"))
    problem(_create(client), 403, "insufficient_scope")
    problem(client.get("/api/v1/webhooks"), 403, "insufficient_scope")
    problem(APIClient().get("/api/v1/webhooks"), 401, "not_authenticated")


def test_webhooks_api__delivery_log_replay_and_recover(make_job):
    client = _client()
    endpoint_id = _create(client).json()["id"]
    job = make_job(state="failed")
    now = timezone.now()
    old = WebhookMessage.objects.create(
        endpoint_id=endpoint_id,
        job_id=job.id,
        event_type="job.failed",
        payload={"x": 1},
        state="failed",
        attempts=8,
        created_at=now - timedelta(days=2),
        next_attempt_at=now,
        last_error="http_500",
    )
    new = WebhookMessage.objects.create(
        endpoint_id=endpoint_id,
        job_id=job.id,
        event_type="job.failed",
        payload={"x": 2},
        state="delivered",
        attempts=1,
        created_at=now,
        next_attempt_at=now,
        delivered_at=now,
    )
    WebhookAttempt.objects.create(
        message=old,
        at=now,
        outcome="failed",
        status_code=500,
        latency_ms=12,
        response_excerpt="oops",
        error="http_500",
    )
    base = f"/api/v1/webhooks/{endpoint_id}"

    listed = client.get(f"{base}/messages").json()["messages"]
    assert [m["id"] for m in listed] == [new.webhook_id, old.webhook_id]
    attempts = client.get(f"{base}/messages/{old.webhook_id}/attempts").json()["attempts"]
    assert attempts == [
        {
            "at": attempts[0]["at"],
            "outcome": "failed",
            "status_code": 500,
            "latency_ms": 12,
            "response_excerpt": "oops",
            "error": "http_500",
        }
    ]
    problem(client.get(f"{base}/messages/nonsense/attempts"), 404, "not_found")

    replayed = client.post(f"{base}/messages/{old.webhook_id}/replay")
    assert replayed.status_code == 202
    assert replayed.json()["state"] == "pending" and replayed.json()["id"] == old.webhook_id
    old.refresh_from_db()
    assert (old.state, old.attempts, old.payload) == ("pending", 0, {"x": 1})

    recovered = client.post(
        f"{base}/recover", {"since": (now - timedelta(hours=1)).isoformat()}, format="json"
    )
    assert recovered.status_code == 202 and recovered.json() == {"requeued": 1}
    new.refresh_from_db()
    assert (new.state, new.delivered_at) == ("pending", None)
    problem(
        client.post(f"{base}/recover", {"since": "yesterday"}, format="json"),
        400,
        "invalid_webhook",
    )


def test_webhooks_api__openapi_documents_every_operation():
    schema = APIClient().get("/api/v1/schema", HTTP_ACCEPT="application/json")
    paths = (
        json.loads(schema.content)["paths"]
        if schema["Content-Type"].startswith("application/json")
        else None
    )
    if paths is None:
        import yaml  # drf-spectacular's default rendering

        paths = yaml.safe_load(schema.content)["paths"]
    operations = {
        op["operationId"]
        for path, item in paths.items()
        if "/webhooks" in path
        for op in item.values()
    }
    assert operations == {
        "webhooks_create",
        "webhooks_list",
        "webhooks_get",
        "webhooks_update",
        "webhooks_delete",
        "webhooks_rotate_secret",
        "webhooks_messages",
        "webhooks_message_attempts",
        "webhooks_message_replay",
        "webhooks_recover",
    }


# --- the job's metadata -------------------------------------------------------------------------


def _submit_with_metadata(client: APIClient, path: Any, metadata: Any) -> Any:
    with open(path, "rb") as fh:
        return client.post(
            "/api/v1/jobs",
            {"output": "text", "file": fh, "metadata": metadata},
            format="multipart",
        )


def test_job_metadata__stored_and_echoed(api, pdf_file, no_broker_publish):
    client = api()
    created = _submit_with_metadata(client, pdf_file(), json.dumps({"batch": "b-7", "n": 3}))
    assert created.status_code == 202, created.content
    assert created.json()["metadata"] == {"batch": "b-7", "n": 3}
    again = client.get(created["Location"]).json()
    assert again["metadata"] == {"batch": "b-7", "n": 3}
    plain = submit(client, pdf_file(salt="other"))
    assert plain.json()["metadata"] is None


@pytest.mark.parametrize(
    "metadata", ["[1, 2]", '"text"', "{not json", json.dumps({"k": "x" * 2048})]
)
def test_job_metadata__invalid_is_400(api, pdf_file, metadata, no_broker_publish):
    problem(_submit_with_metadata(api(), pdf_file(), metadata), 400, "invalid_metadata")


def test_job_metadata__2048_bytes_accepted(api, pdf_file, no_broker_publish):
    value = {"k": "x" * (2048 - len('{"k":""}'))}
    assert _submit_with_metadata(api(), pdf_file(), json.dumps(value)).status_code == 202
