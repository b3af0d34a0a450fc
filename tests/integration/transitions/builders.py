"""What the transition tests hand to ``done_pages_record`` and the publish edges: a done text
page checkpoint and a text result, with placeholder bytes (the statements never read them)."""

from __future__ import annotations

import uuid

from conversion_jobs.models import PageCheckpoint, PageState
from conversion_jobs.services import transitions


def done_page(job_id: uuid.UUID, number: int) -> PageCheckpoint:
    """Page ``number`` of ``job_id``, done in generation 1, its text inline."""
    return PageCheckpoint(
        job_id=job_id,
        page_number=number,
        state=PageState.DONE,
        attempts=1,
        artifact_key=f"inline:pages/{job_id}/{number:05d}.g1.txt",
        artifact_sha256="a" * 64,
        artifact_size=1,
        media_type="text/plain",
        generation=1,
        content=b"x",
    )


def text_result(
    *, key: str = "results/x", size: int = 1, pages_done: int = 1, page_count: int | None = None
) -> transitions.Result:
    return transitions.Result(
        key=key,
        sha256="a" * 64,
        size=size,
        media_type="text/plain",
        pages_done=pages_done,
        pages_failed=0,
        page_count=page_count,
    )
