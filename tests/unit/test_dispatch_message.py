"""The background publisher builds the conversion message itself (ADR 0017 addendum): it must
be the message Celery's ``send_task`` produces for ``run_conversion`` (what the inline fast path
and the outbox sweep send), so a worker cannot tell them apart."""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from conversion_jobs.services import broker


class _Capture:
    """A producer that records what Celery asks it to publish (the reference message)."""

    serializer = "json"

    class connection:  # the attribute Celery reads
        @staticmethod
        @contextlib.contextmanager
        def _reraise_as_library_errors() -> Iterator[None]:
            yield

    def __init__(self) -> None:
        self.sent: dict[str, Any] = {}

    def publish(self, body: Any, **kwargs: Any) -> None:
        self.sent = {"body": body, **kwargs}


@pytest.mark.parametrize("traceparent", ["00-" + "a" * 32 + "-" + "b" * 16 + "-01", ""])
def test_conversion_message__is_what_send_task_publishes(traceparent: str) -> None:
    from project.celery import app

    job_id = uuid.uuid4()
    capture = _Capture()
    app.send_task(
        broker.TASK_NAME,
        args=[str(job_id), 7],
        exchange="quire.conversion",
        routing_key="conversion.v1",
        headers={"traceparent": traceparent} if traceparent else {},
        producer=capture,
        retry=False,
        ignore_result=True,
    )
    reference = capture.sent
    ours = broker.conversion_message(job_id=job_id, generation=7, traceparent=traceparent)

    headers = dict(ours.application_headers)
    expected = dict(reference["headers"])
    # Fresh per message on both sides: a task id (also the root id and correlation id).
    assert headers.pop("id") == headers.pop("root_id") == ours.properties["correlation_id"]
    expected.pop("id"), expected.pop("root_id")
    assert headers == expected
    assert json.loads(ours.body) == json.loads(json.dumps(reference["body"]))
    assert ours.properties["content_type"] == "application/json"
    assert ours.properties["content_encoding"] == "utf-8"
    assert reference["delivery_mode"] == "persistent" and ours.properties["delivery_mode"] == 2
    # Identifiers only (docs/ARCHITECTURE.md §2).
    assert set(json.loads(ours.body)[0]) == {str(job_id), 7}
