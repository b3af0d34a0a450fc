"""The conversion task: ``(job_id, generation)`` in, one service call."""

from __future__ import annotations

import uuid

from celery import shared_task
from celery.exceptions import Reject

from conversion_jobs.observability import metrics, tracing
from conversion_jobs.services.runner import conversion_job_execute


def _parse(job_id: object, generation: object) -> tuple[uuid.UUID, int]:
    if not isinstance(generation, int) or isinstance(generation, bool) or generation < 1:
        raise ValueError("generation must be a positive integer")
    return uuid.UUID(str(job_id)), generation


@shared_task(name="tasks.conversion.run_conversion", bind=True, acks_late=True)
def run_conversion(self: object, job_id: object = None, generation: object = None) -> str:
    try:
        parsed_id, parsed_generation = _parse(job_id, generation)
    except (ValueError, TypeError, AttributeError) as exc:
        # A poison message: dead-letter it instead of redelivering it forever.
        metrics.DEAD_LETTERS.inc()
        raise Reject("malformed conversion message", requeue=False) from exc
    traceparent = getattr(getattr(self, "request", None), "traceparent", None) or ""
    if not traceparent:
        headers = getattr(getattr(self, "request", None), "headers", None) or {}
        traceparent = headers.get("traceparent", "") if isinstance(headers, dict) else ""
    with tracing.span_from_traceparent(
        "conversion.run", traceparent, **{"quire.job_generation": parsed_generation}
    ):
        return conversion_job_execute(job_id=parsed_id, generation=parsed_generation)
