import uuid

import pytest

from conversion_jobs.models import ConversionJob, ConversionOutbox, ExecutionAuditEvent


@pytest.mark.django_db(transaction=True)
def test_submit__accepted_and_readable(api, pdf_file, no_broker_publish):
    client = api()
    with open(pdf_file(), "rb") as fh:
        response = client.post("/api/v1/jobs", {"file": fh, "output": "text"}, format="multipart")
    assert response.status_code == 202, response.content
    job_id = response.json()["id"]
    assert uuid.UUID(job_id).version == 7  # time-ordered (conversion_jobs/ids.py)
    assert response["Location"] == f"/api/v1/jobs/{job_id}"
    assert ConversionJob.objects.get(id=job_id).state == "queued"
    assert ConversionOutbox.objects.filter(job_id=job_id).count() == 1
    assert ExecutionAuditEvent.objects.filter(job_id=job_id).count() == 1
    assert no_broker_publish == [(job_id, 1)]
    got = client.get(f"/api/v1/jobs/{job_id}")
    assert got.status_code == 200
    assert got.json()["state"] == "queued"
