"""Tenant erasure (issue 24 point 4, services/erasure.py): every row and object of the tenant
goes, another tenant (one sharing a source with it) is untouched, live jobs are cancelled
first, a second run changes nothing, the record names the tenant by its pseudonym only, and the
API needs the operator's scope. Both profiles; the kill -9 test is e2e
(tests/e2e/test_erasure_e2e.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.core.management import call_command
from rest_framework.test import APIClient

from conversion_jobs.models import ConversionJob, TenantErasure
from conversion_jobs.pseudonym import pseudonym
from conversion_jobs.services import quarantine
from conversion_jobs.services.erasure import tenant_erase
from tests.conftest import token
from tests.erasure_check import footprint, objects_left, rows_left
from tests.integration.api.conftest import problem, submit
from tests.integration.execution.jobkit import execute
from tests.integration.execution.jobkit import submit as submit_job

pytestmark = pytest.mark.django_db(transaction=True)


def _operator(scopes: tuple[str, ...] = ("tenants:erase",)) -> APIClient:
    client = APIClient()
    client.credentials(
        HTTP_AUTHORIZATION=f"Bearer {token(tenant='operators', scopes=scopes, subject='op')}"
    )
    return client


def _populate(tenant: str, pdf_file: Any, api: Any, *, shared: Any) -> None:
    """Jobs in several states with stored sources and page objects, a key, a webhook
    endpoint, a quarantine row."""
    done = submit_job(shared, output="png", tenant=tenant)
    assert execute(done) == "succeeded"
    text = submit_job(pdf_file(salt=f"{tenant}-text"), output="text", tenant=tenant)
    assert execute(text) == "succeeded"
    client = api(tenant=tenant)
    assert submit(client, pdf_file(salt=f"{tenant}-queued"), key=f"{tenant}-k").status_code == 202
    hook = client.post(
        "/api/v1/webhooks",
        {"url": "https://hooks.example.com/q", "events": ["job.failed", "job.cancelled"]},
        format="json",
    )
    assert hook.status_code == 201, hook.content
    quarantine.document_crash_record(
        tenant=tenant,
        source_sha256=text.source_sha256,
        engine_version="pdfium x",
        job_id=text.id,
        attempt_id=hash(tenant) % 10**9,
        worker="h:1",
        code="converter_crashed",
    )


def test_erase__nothing_of_the_tenant_is_left_and_the_other_is_untouched(
    fast_quire, no_broker_publish, pdf_file, api, settings
):
    settings.QUIRE = {**settings.QUIRE, "INLINE_SOURCE_MAX_BYTES": 0}  # stored sources
    shared = pdf_file(salt="shared")
    _populate("tenant-a", pdf_file, api, shared=shared)
    _populate("tenant-b", pdf_file, api, shared=shared)
    a, b = footprint("tenant-a"), footprint("tenant-b")
    b_rows, b_objects = rows_left(b), objects_left(b)
    assert all(b_rows[t] for t in ("conversion_job", "execution_audit_event", "webhook_endpoint"))
    assert objects_left(a) and len(a.jobs) == 3

    record = tenant_erase(tenant="tenant-a", actor="a_operator")

    assert record.finished_at is not None and record.step == "done"
    assert record.tenant_pseudonym == pseudonym("tenant", "tenant-a")
    assert record.jobs_cancelled == 1 and record.jobs_deleted == 3
    assert record.rows_deleted > 0 and record.audit_events_deleted > 0
    assert record.objects_deleted > 0
    assert rows_left(a) == dict.fromkeys(rows_left(a), 0)
    # The shared source stays: tenant B's job names it.
    shared_key = ConversionJob.objects.get(tenant="tenant-b", output="png").source_key
    assert objects_left(a) == [shared_key]
    assert rows_left(b) == b_rows and objects_left(b) == b_objects

    again = tenant_erase(tenant="tenant-a", actor="a_operator")
    assert again.id == record.id and again.runs == record.runs
    assert TenantErasure.objects.count() == 1


def test_erase__command_and_api(no_broker_publish, pdf_file, api, capsys):
    assert submit(api(tenant="tenant-c"), pdf_file(salt="c")).status_code == 202
    problem(
        _operator(scopes=("jobs:admin",)).post(
            "/api/v1/erasures", {"tenant": "tenant-c"}, format="json"
        ),
        403,
        "insufficient_scope",
    )
    problem(_operator().post("/api/v1/erasures", {}, format="json"), 400, "invalid_request")
    answer = _operator().post("/api/v1/erasures", {"tenant": "tenant-c"}, format="json")
    assert answer.status_code == 200, answer.content
    body = answer.json()
    assert body["state"] == "finished" and body["tenant"] == pseudonym("tenant", "tenant-c")
    assert "tenant-c" not in answer.content.decode()
    assert body["counts"]["jobs_deleted"] == 1 and body["counts"]["jobs_cancelled"] == 1
    assert not ConversionJob.objects.filter(tenant="tenant-c").exists()
    call_command("erase_tenant", "tenant-c")
    printed = json.loads(capsys.readouterr().out)
    assert printed["id"] == body["id"] and "tenant-c" not in json.dumps(printed)
