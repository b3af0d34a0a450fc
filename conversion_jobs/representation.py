"""The job representation (docs/API_CONTRACT.md §3), built as plain dicts on the hot path; the
serializers in ``api/serializers.py`` describe the same shapes for the OpenAPI document. Below
``api`` and ``webhooks``: a webhook event carries the job as the API renders it."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from conversion_jobs.models import ConversionJob, ExecutionAuditEvent, PageCheckpoint
from conversion_jobs.passwords import IDENTITY_KEY
from conversion_jobs.states import TERMINAL_STATES, State

API = "/api/v1/jobs/"


def iso(value: Any) -> str | None:
    """A timestamp as the API writes it (RFC 3339, ``Z`` for UTC), or None."""
    return value.isoformat().replace("+00:00", "Z") if value is not None else None


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)


@dataclass(frozen=True)
class JobStatus:
    """What a conditional or waiting read compares: the columns the cheap 304 path reads
    (``selectors.conversion_job_wait_status``, in this order), of which the job's ETag is made."""

    state: str
    state_version: int
    pages_total: int | None
    pages_done: int
    pages_failed: int
    updated_at: datetime

    @classmethod
    def of(cls, job: ConversionJob) -> JobStatus:
        return cls(
            job.state,
            job.state_version,
            job.source_page_count,
            job.pages_done,
            job.pages_failed,
            job.updated_at,
        )

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_STATES

    @property
    def etag(self) -> str:
        """The job's strong validator (docs/API_CONTRACT.md §2.2, RFC 9110 §8.8.3): it changes
        whenever the representation does. A transition bumps ``state_version``; every other
        write that changes a field of the body (page counters, the page total, retention's
        expiry) sets ``updated_at``, which the body shows too; the counters are named as well,
        so two writes that land in one microsecond still differ. Never from a rendered body."""
        stamp = (self.updated_at - _EPOCH) // _MICROSECOND
        return f'"v{self.event_id}.{stamp}"'

    @property
    def event_id(self) -> str:
        """The SSE id: changes whenever a client could see a difference."""
        total = "" if self.pages_total is None else self.pages_total
        return f"{self.state_version}.{total}.{self.pages_done}.{self.pages_failed}"


def job_etag_of(job: ConversionJob) -> str:
    return JobStatus.of(job).etag


def job_representation(job: ConversionJob) -> dict[str, Any]:
    base = f"{API}{job.id}"
    error = None
    if job.error_code and job.state in (State.FAILED, State.RETRY_WAIT, State.QUEUED):
        error = {
            "code": job.error_code,
            "retryable": job.error_retryable,
            "detail": job.error_detail,
        }
    return {
        "id": str(job.id),
        "state": job.state,
        "generation": job.generation,
        "state_version": job.state_version,
        "output": job.output,
        # a password is never echoed, nor its keyed HMAC (conversion_jobs/passwords.py)
        "options": {k: v for k, v in job.options.items() if k != IDENTITY_KEY},
        "metadata": job.metadata,
        "source": {
            "media_type": job.source_media_type,
            "size": job.source_size,
            "sha256": job.source_sha256,
            "page_count": job.source_page_count,
        },
        "attempts": job.attempts,
        "max_attempts": job.max_attempts,
        "pages": {
            "total": job.source_page_count,
            "done": job.pages_done,
            "failed": job.pages_failed,
        },
        "error": error,
        "next_attempt_at": iso(job.next_attempt_at),
        "created_at": iso(job.created_at),
        "updated_at": iso(job.updated_at),
        "finished_at": iso(job.finished_at),
        "result": (
            {
                "sha256": job.result_sha256,
                "size": job.result_size,
                "media_type": job.result_media_type,
            }
            if job.result_key and job.state in TERMINAL_STATES and job.expired_at is None
            else None
        ),
        "links": {
            "self": base,
            "result": f"{base}/result",
            "cancel": f"{base}/cancel",
            "pages": f"{base}/pages",
            "events": f"{base}/events",
        },
    }


def page_representation(job_id: Any, page: PageCheckpoint) -> dict[str, Any]:
    return {
        "page": page.page_number,
        "state": page.state,
        "attempts": page.attempts,
        "media_type": page.media_type,
        "sha256": page.artifact_sha256,
        "size": page.artifact_size,
        "error_code": page.error_code,
        "links": {"self": f"{API}{job_id}/pages/{page.page_number}"},
    }


def event_representation(event: ExecutionAuditEvent) -> dict[str, Any]:
    return {
        "seq": event.seq,
        "type": event.event_type,
        "generation": event.generation,
        "attempt": event.attempt_id,
        "actor": event.actor,
        "details": event.details,
        "at": iso(event.created_at),
        "hash": event.hash,
    }
