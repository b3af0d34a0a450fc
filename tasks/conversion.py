"""The conversion task: ``(job_id, generation)`` in, one service call."""

from __future__ import annotations

import uuid

from celery import shared_task
from celery.exceptions import Reject

from conversion_jobs.observability import metrics, tracing
from conversion_jobs.services.range_runner import conversion_execute, conversion_range_execute


def _positive(value: object, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer")
    return value


def _parse(job_id: object, generation: object) -> tuple[uuid.UUID, int]:
    return uuid.UUID(str(job_id)), _positive(generation, "generation")


@shared_task(name="tasks.conversion.run_conversion", bind=True, acks_late=True)
def run_conversion(
    self: object,
    job_id: object = None,
    generation: object = None,
    range_first: object = None,
    range_generation: object = None,
) -> str:
    """``(job_id, generation)``: run the job; with ``range_first`` and ``range_generation``,
    one page range of the fanned-out job (ADR 0023)."""
    try:
        parsed_id, parsed_generation = _parse(job_id, generation)
        page_range = None
        if range_first is not None or range_generation is not None:
            page_range = (
                _positive(range_first, "range_first"),
                _positive(range_generation, "range_generation"),
            )
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
        if page_range is not None:
            return conversion_range_execute(
                job_id=parsed_id,
                generation=parsed_generation,
                range_first=page_range[0],
                range_generation=page_range[1],
            )
        return conversion_execute(job_id=parsed_id, generation=parsed_generation)
