"""e2e: durable retries, exhaustion, operator retry, stale generations and poison messages."""

from __future__ import annotations

import time

import pytest
from django.utils import timezone

from conversion_jobs.models import ConversionAttempt, ConversionJob, ExecutionAuditEvent
from tests.e2e import harness

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def state_of(job_id) -> str:
    return ConversionJob.objects.get(id=job_id).state


def test_retry__three_retryable_failures_then_success_with_growing_delays_across_a_beat_restart(
    start, submit
):
    start("worker")
    start("sweeper")
    beat = start("beat")
    job = submit(pages=2, options={"_test_fault": {"kind": "segv", "page": 2, "until_attempt": 3}})
    harness.wait_until(
        lambda: ConversionAttempt.objects.filter(job_id=job.id).exists(),
        timeout=30,
        what="the first claim",
    )
    # Beat goes away before the first timer is even written, and stays away past its due time:
    # nothing moves (there is no in-process timer anywhere); a new beat then picks the timer up.
    beat.stop()
    timer = harness.wait_until(
        lambda: (
            ConversionJob.objects.filter(id=job.id, state="retry_wait")
            .values_list("next_attempt_at", flat=True)
            .first()
        ),
        timeout=30,
        what="retry_wait with a timer",
    )
    scheduled = {1: timer}
    time.sleep(max(0.0, (timer - timezone.now()).total_seconds()) + 1.0)
    assert ConversionJob.objects.filter(id=job.id, state="retry_wait", generation=1).exists()
    start("beat")

    deadline = time.monotonic() + 60
    while state_of(job.id) != "succeeded":
        assert time.monotonic() < deadline, f"no success; timers seen: {scheduled}"
        row = ConversionJob.objects.filter(id=job.id, state="retry_wait").values_list(
            "generation", "next_attempt_at"
        )
        for generation, next_attempt_at in row:
            scheduled.setdefault(generation, next_attempt_at)
        time.sleep(0.05)

    attempts = list(ConversionAttempt.objects.filter(job_id=job.id).order_by("number"))
    assert [(a.number, a.generation, a.outcome, a.error_code) for a in attempts] == [
        (1, 1, "retryable_error", "converter_crashed"),
        (2, 2, "retryable_error", "converter_crashed"),
        (3, 3, "retryable_error", "converter_crashed"),
        (4, 4, "succeeded", None),
    ]
    assert sorted(scheduled) == [1, 2, 3], scheduled
    # Scheduled delays (Postgres: next_attempt_at - finished_at) follow the backoff windows of
    # base 0.5 s, [c/2, c] with c = 0.5, 1, 2 s: they grow.
    delays = [(scheduled[n] - attempts[n - 1].finished_at).total_seconds() for n in (1, 2, 3)]
    windows = [(0.25, 0.5), (0.5, 1.0), (1.0, 2.0)]
    for delay, (low, high) in zip(delays, windows, strict=True):
        assert low - 0.05 <= delay <= high + 0.05, delays
    assert delays[0] < delays[1] < delays[2], delays
    # No attempt started before its timer was due.
    for n in (1, 2, 3):
        assert attempts[n].started_at >= scheduled[n], (n, attempts[n].started_at, scheduled[n])
    events = list(
        ExecutionAuditEvent.objects.filter(job_id=job.id).values_list("event_type", flat=True)
    )
    assert events.count("retry_scheduled") == 3 and events.count("retry_dispatched") == 3
    assert events.count("published") == 1


def test_retry__exhausted_then_operator_retry_completes_and_the_old_generation_is_stale(
    start, submit, api, settings
):
    settings.QUIRE = {**settings.QUIRE, "MAX_ATTEMPTS": 2}
    worker = start("worker")
    start("sweeper")
    start("beat")
    job = submit(pages=2, options={"_test_fault": {"kind": "segv", "until_generation": 2}})
    harness.wait_until(lambda: state_of(job.id) == "failed", timeout=40, what="attempts exhausted")
    failed = ConversionJob.objects.get(id=job.id)
    assert (failed.error_code, failed.error_retryable, failed.generation) == (
        "attempts_exhausted",
        True,
        2,
    )

    response = api(scopes=("jobs:read", "jobs:admin")).post(f"/api/v1/jobs/{job.id}/retry")
    assert response.status_code == 202, response.content
    assert response.json()["generation"] == 3
    harness.wait_until(
        lambda: state_of(job.id) == "succeeded", timeout=30, what="success after retry"
    )
    done = ConversionJob.objects.get(id=job.id)
    assert done.generation == 3
    before = (
        done.state_version,
        done.result_sha256,
        ConversionAttempt.objects.filter(job_id=job.id).count(),
    )

    # A late message of generation 2 arrives: stale, acked, no effect.
    def duplicates_logged() -> int:
        return worker.log.read_text(errors="replace").count("'duplicate'")

    # Earlier duplicates are harmless re-publishes (fast path + sweep, dispatch timeout): count
    # only the ones after this publish, and let the queue drain before looking at it.
    seen = duplicates_logged()
    harness.publish_task(job_id=job.id, generation=2)
    harness.wait_until(
        lambda: duplicates_logged() > seen,
        timeout=15,
        what="the stale delivery to be consumed",
    )
    harness.wait_until(
        lambda: harness.queue_depth(harness.CONVERSION_QUEUE) == 0,
        timeout=10,
        what="conversion.v1 to drain",
    )
    after = ConversionJob.objects.get(id=job.id)
    assert (
        after.state_version,
        after.result_sha256,
        ConversionAttempt.objects.filter(job_id=job.id).count(),
    ) == before
    assert harness.queue_depth(harness.CONVERSION_QUEUE) == 0
    assert ExecutionAuditEvent.objects.filter(job_id=job.id, event_type="published").count() == 1


def test_poison__malformed_messages_are_dead_lettered_not_redelivered(start, submit):
    worker = start("worker")
    harness.publish_raw(b"\x00\xffnot json at all", content_type="application/json")
    harness.publish_task(job_id="not-a-uuid", generation="x", args=["not-a-uuid", "x"])
    harness.wait_until(
        lambda: harness.queue_depth(harness.DEAD_QUEUE) == 2, timeout=20, what="two dead letters"
    )
    # A quorum queue's message count is a metric the broker refreshes on a tick (seconds), so
    # conversion.v1 may still count a message the worker already rejected: wait for the tick.
    harness.wait_until(
        lambda: harness.queue_depth(harness.CONVERSION_QUEUE) == 0,
        timeout=20,
        what="conversion.v1 empty",
    )
    time.sleep(1.0)
    depths = harness.queue_depths()
    assert depths[harness.CONVERSION_QUEUE] == 0 and depths[harness.DEAD_QUEUE] == 2
    # Each poison message reached the worker once: the undecodable one never became a task,
    # the malformed task was received once and rejected, not redelivered.
    assert worker.log.read_text().count("run_conversion[") == 2  # received + reject lines
    # The worker survived and still runs real jobs.
    job = submit(pages=1)
    harness.wait_until(
        lambda: state_of(job.id) == "succeeded", timeout=20, what="a job after poison"
    )
    assert worker.popen.poll() is None
