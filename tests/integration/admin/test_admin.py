"""Django admin for operators: staff only, read-only views, and the "cancel" / "retry failed"
actions going through the same services as the API (same rows, same audit trail)."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from conversion_jobs.models import (
    CancellationRequest,
    ConversionJob,
    ConversionOutbox,
    ExecutionAuditEvent,
)

CHANGELIST = "/admin/conversion_jobs/conversionjob/"


@pytest.fixture
def staff_client() -> Client:
    user = get_user_model().objects.create_user(
        "operator", password="pw-operator", is_staff=True, is_superuser=True
    )
    client = Client()
    client.force_login(user)
    return client


@pytest.mark.django_db
def test_admin__requires_staff(make_job):
    job = make_job()
    anonymous = Client().get(f"{CHANGELIST}{job.id}/change/")
    assert anonymous.status_code == 302 and "/admin/login/" in anonymous["Location"]
    user = get_user_model().objects.create_user("plain", password="pw-plain", is_staff=False)
    client = Client()
    client.force_login(user)
    assert client.get(CHANGELIST).status_code == 302


@pytest.mark.django_db
def test_admin__job_pages_are_read_only(staff_client, make_job):
    job = make_job(state="failed")
    assert staff_client.get(CHANGELIST).status_code == 200
    detail = staff_client.get(f"{CHANGELIST}{job.id}/change/")
    assert detail.status_code == 200
    before = ConversionJob.objects.filter(id=job.id).values().get()
    staff_client.post(f"{CHANGELIST}{job.id}/change/", {"state": "succeeded", "tenant": "x"})
    assert ConversionJob.objects.filter(id=job.id).values().get() == before
    assert staff_client.post(f"{CHANGELIST}{job.id}/delete/", {"post": "yes"}).status_code == 403
    assert ConversionJob.objects.filter(id=job.id).exists()
    for model in (
        "conversionattempt",
        "pagecheckpoint",
        "cancellationrequest",
        "executionauditevent",
    ):
        assert staff_client.get(f"/admin/conversion_jobs/{model}/").status_code == 200
        assert staff_client.get(f"/admin/conversion_jobs/{model}/add/").status_code == 403


@pytest.mark.django_db(transaction=True)
def test_admin__cancel_action_uses_the_cancellation_service(
    staff_client, make_job, no_broker_publish
):
    queued = make_job(state="queued")
    running = make_job(state="running")
    done = make_job(state="succeeded")
    response = staff_client.post(
        CHANGELIST,
        {
            "action": "cancel_jobs",
            "_selected_action": [str(queued.id), str(running.id), str(done.id)],
        },
        follow=True,
    )
    assert response.status_code == 200
    states = dict(ConversionJob.objects.values_list("id", "state"))
    assert states[queued.id] == "cancelled"
    assert states[running.id] == "cancelling"
    assert states[done.id] == "succeeded"  # too late: the result stands
    outcomes = dict(CancellationRequest.objects.values_list("job_id", "outcome"))
    assert outcomes == {queued.id: "cancelled", running.id: "cancelling", done.id: "too_late"}
    actors = set(CancellationRequest.objects.values_list("actor", flat=True))
    assert len(actors) == 1 and "operator" not in next(iter(actors))  # pseudonymous
    assert ExecutionAuditEvent.objects.filter(event_type="cancel_requested").count() == 3


@pytest.mark.django_db(transaction=True)
def test_admin__retry_action_requeues_failed_jobs_only(staff_client, make_job, no_broker_publish):
    failed = make_job(state="failed")
    succeeded = make_job(state="succeeded")
    staff_client.post(
        CHANGELIST,
        {"action": "retry_jobs", "_selected_action": [str(failed.id), str(succeeded.id)]},
        follow=True,
    )
    failed.refresh_from_db()
    succeeded.refresh_from_db()
    assert (failed.state, failed.generation, failed.attempts) == ("queued", 2, 0)
    assert ConversionOutbox.objects.filter(job=failed, generation=2).count() == 1
    assert no_broker_publish == [(str(failed.id), 2)]
    assert (succeeded.state, succeeded.generation) == ("succeeded", 1)
    assert (
        ExecutionAuditEvent.objects.filter(job_id=failed.id, event_type="operator_retry").count()
        == 1
    )
