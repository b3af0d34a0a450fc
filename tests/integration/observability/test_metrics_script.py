"""A scripted run (accepted, replayed, rejected, retried, cancelled, failed, recovered, duplicate
jobs); one scrape of /metrics then shows exactly the values the script implies."""

from __future__ import annotations

import re
from datetime import timedelta
from pathlib import Path

import pytest
from django.test import Client
from django.utils import timezone
from rest_framework.test import APIClient

from conversion_jobs.models import ConversionJob, WorkerLease
from conversion_jobs.services import recovery
from conversion_jobs.services.execution import conversion_job_claim
from conversion_jobs.services.runner import conversion_job_execute
from tests import testdocs
from tests.conftest import metrics_headers, token
from tests.integration.execution.jobkit import submit

SAMPLE = re.compile(r"^(?P<name>[a-z_]+)(?:\{(?P<labels>[^}]*)\})? (?P<value>\S+)$")


def scrape() -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    response = Client().get("/metrics", headers=metrics_headers())
    assert response.status_code == 200
    values: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for line in response.content.decode().splitlines():
        match = SAMPLE.match(line)
        if not match or line.startswith("#"):
            continue
        labels = frozenset(
            tuple(part.split("=", 1))
            for part in re.findall(r'(\w+="[^"]*")', match["labels"] or "")
        )
        labels = frozenset((k, v.strip('"')) for k, v in labels)
        values[(match["name"], labels)] = float(match["value"])
    return values


def metric(values: dict, name: str, **labels: str) -> float:
    return values.get((name, frozenset(labels.items())), 0.0)


@pytest.mark.django_db(transaction=True)
def test_metrics__one_scrape_tells_the_scripted_story(
    fast_quire, settings, tmp_path: Path, no_broker_publish
):
    settings.QUIRE = {
        **settings.QUIRE,
        "TENANT_QUOTA": 3,
        "BACKOFF_BASE_S": 0.01,
        "BACKOFF_CAP_S": 0.01,
    }
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token(tenant='tenant-metrics')}")
    before = scrape()

    def pdf(name: str, pages: int = 1) -> Path:
        path = tmp_path / name
        testdocs.make_pdf(path, pages=pages, text_of=lambda n: f"{name} page {n}")
        return path

    # accepted x3 through HTTP (one with a key), one replay, one 415, then the quota's 429
    ids = []
    for n in range(3):
        with open(pdf(f"a{n}.pdf"), "rb") as fh:
            headers = {"HTTP_IDEMPOTENCY_KEY": "key-0"} if n == 0 else {}
            response = client.post(
                "/api/v1/jobs", {"file": fh, "output": "text"}, format="multipart", **headers
            )
        assert response.status_code == 202
        ids.append(response.json()["id"])
    with open(tmp_path / "a0.pdf", "rb") as fh:
        replay = client.post(
            "/api/v1/jobs",
            {"file": fh, "output": "text"},
            format="multipart",
            HTTP_IDEMPOTENCY_KEY="key-0",
        )
    assert replay.status_code == 200
    zip_path = tmp_path / "z.pdf"
    testdocs.make_zip_as_pdf(zip_path)
    with open(zip_path, "rb") as fh:
        assert (
            client.post(
                "/api/v1/jobs", {"file": fh, "output": "text"}, format="multipart"
            ).status_code
            == 415
        )
    with open(pdf("over.pdf"), "rb") as fh:
        assert (
            client.post(
                "/api/v1/jobs", {"file": fh, "output": "text"}, format="multipart"
            ).status_code
            == 429
        )

    succeeded, to_cancel, to_fail = ids
    assert conversion_job_execute(job_id=succeeded, generation=1) == "succeeded"
    assert conversion_job_execute(job_id=succeeded, generation=1) == "duplicate"
    assert client.post(f"/api/v1/jobs/{to_cancel}/cancel").status_code == 200
    ConversionJob.objects.filter(id=to_fail).update(
        options={"dpi": None, "pages": None, "allow_partial": True, "_test_fault": {"kind": "fail"}}
    )
    assert conversion_job_execute(job_id=to_fail, generation=1) == "failed"

    # retried: a crash on the first attempt, then success after the due-timer sweep
    retried = submit(
        pdf("r.pdf"),
        output="text",
        tenant="tenant-metrics",
        fault={"kind": "segv", "until_attempt": 1},
    )
    assert conversion_job_execute(job_id=retried.id, generation=1) == "retry_wait"
    ConversionJob.objects.filter(id=retried.id).update(
        next_attempt_at=timezone.now() - timedelta(seconds=1)
    )
    assert recovery.conversion_jobs_requeue_if_retry_due() == 1
    assert conversion_job_execute(job_id=retried.id, generation=2) == "succeeded"

    # recovered: a claim whose worker vanished; the lease sweep re-dispatches it
    lost = submit(pdf("l.pdf"), output="text", tenant="tenant-metrics")
    assert conversion_job_claim(job_id=lost.id, generation=1, worker="gone:1") is not None
    WorkerLease.objects.filter(job_id=lost.id).update(
        expires_at=timezone.now() - timedelta(seconds=1)
    )
    assert recovery.conversion_jobs_recover_if_lease_expired() == 1
    # left queued (generation 2) on purpose: it shows in the queue gauges

    after = scrape()

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("quire_admissions_total", result="accepted", reason="") == 3
    assert delta("quire_admissions_total", result="replayed", reason="") == 1
    assert delta("quire_admissions_total", result="rejected", reason="unsupported_media_type") == 1
    assert delta("quire_admissions_total", result="rejected", reason="tenant_quota_exceeded") == 1
    assert delta("quire_idempotent_replays_total") == 1
    assert delta("quire_duplicate_deliveries_total", reason="duplicate") == 1
    assert delta("quire_claims_total") == 5  # succeeded, failed, retried x2, lost
    assert delta("quire_cancellations_total", outcome="cancelled") == 1
    assert delta("quire_cancellation_latency_seconds_count") == 1
    assert delta("quire_jobs_finished_total", state="succeeded") == 2
    assert delta("quire_jobs_finished_total", state="failed") == 1
    assert delta("quire_jobs_finished_total", state="cancelled") == 1
    assert delta("quire_retry_delay_seconds_count") == 1
    assert delta("quire_redispatches_total", reason="retry_due") == 1
    assert delta("quire_recoveries_total", result="requeued") == 1
    assert delta("quire_attempt_duration_seconds_count", outcome="succeeded") == 2
    assert delta("quire_attempt_duration_seconds_count", outcome="terminal_error") == 1
    assert delta("quire_attempt_duration_seconds_count", outcome="retryable_error") == 1
    # gauges: the database's truth at scrape time
    assert metric(after, "quire_jobs", state="succeeded") == 2
    assert metric(after, "quire_jobs", state="failed") == 1
    assert metric(after, "quire_jobs", state="cancelled") == 1
    assert metric(after, "quire_jobs", state="queued") == 1
    assert metric(after, "quire_queue_depth") == 1
    assert metric(after, "quire_queue_oldest_age_seconds") >= 0
    assert metric(after, "quire_outbox_backlog") == 0
    assert metric(after, "quire_leases", status="active") == 0
    assert metric(after, "quire_leases", status="expired") == 0
    assert metric(after, "quire_capacity_utilisation_ratio") == pytest.approx(
        1 / settings.QUIRE["GLOBAL_CAPACITY"]
    )
    text = Client().get("/metrics", headers=metrics_headers()).content.decode()
    assert "tenant-metrics" not in text and "a0.pdf" not in text
