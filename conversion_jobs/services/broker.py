"""The conversion message and its publication (docs/ARCHITECTURE.md §2): what dispatch's outbox
paths and the web's background publisher put on ``conversion.v1``, and the Celery app they send
it with.

Below both ``dispatch`` and ``publisher`` (each imports this module, neither the other's
internals), and below ``project``: the app is reached through Celery's current app, never by
importing ``project.celery`` (docs/ARCHITECTURE.md, "Import layers").
"""

from __future__ import annotations

import json
import os
import socket
import uuid
from dataclasses import dataclass
from typing import Any

import amqp
from celery import Celery, current_app
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from kombu.exceptions import OperationalError as BrokerOperationalError

from conversion_jobs.observability import tracing

#: The Celery app's name (``project/celery.py``), checked by :func:`celery_app`.
APP_NAME = "quire"


def celery_app() -> Celery:
    """The project's Celery app. Every Quire process imports the ``project`` package first (its
    settings module lives there), which creates the app and makes it Celery's default app, in
    every thread; an app of another name means that did not happen, and publishing with
    Celery's fallback app (its own broker URL) instead would lose messages silently."""
    if current_app.main != APP_NAME:  # (a proxy of the current app: it follows a new default)
        raise ImproperlyConfigured("the Celery app of project/celery.py is not loaded")
    return current_app


TASK_NAME = "tasks.conversion.run_conversion"


@dataclass(frozen=True)
class RangeRef:
    """A page range's message (ADR 0023): its first page and its generation."""

    first: int
    generation: int


def publish_conversion(
    *, job_id: uuid.UUID, generation: int, traceparent: str, page_range: RangeRef | None = None
) -> None:
    """One persistent message on ``conversion.v1``, confirmed by the broker or an exception.
    ``page_range``: the message of one page range of the job (its args add the range's first
    page and generation)."""
    headers = {"traceparent": traceparent} if traceparent else {}
    with tracing.span_from_traceparent(
        "outbox.publish", traceparent, **{"quire.generation": generation}
    ):
        if page_range is None:
            _send(celery_app(), job_id=job_id, generation=generation, headers=headers)
        else:
            _send(
                celery_app(),
                job_id=job_id,
                generation=generation,
                headers=headers,
                page_range=page_range,
            )


_ORIGIN = f"gen{os.getpid()}@{socket.gethostname()}"


def conversion_message(
    *, job_id: uuid.UUID, generation: int, traceparent: str, page_range: RangeRef | None = None
) -> Any:
    """The message :func:`publish_conversion` sends, built directly (Celery task protocol 2,
    what ``app.send_task`` produces for ``run_conversion``: the same headers, properties and
    body; ``tests/unit/test_dispatch_message.py`` holds the two together). For the background
    publisher, which publishes batches on its own confirm-mode channel: ``send_task``'s routing,
    signals and serializer lookups were two thirds of its CPU."""
    task_id = str(uuid.uuid4())
    args: list[Any] = [str(job_id), generation]
    if page_range is not None:
        args += [page_range.first, page_range.generation]
    headers: dict[str, Any] = {
        "lang": "py",
        "task": TASK_NAME,
        "id": task_id,
        "shadow": None,
        "eta": None,
        "expires": None,
        "group": None,
        "group_index": None,
        "retries": 0,
        "timelimit": [None, None],
        "root_id": task_id,
        "parent_id": None,
        "argsrepr": repr(args),
        "kwargsrepr": "{}",
        "origin": _ORIGIN,
        "ignore_result": True,
        "replaced_task_nesting": 0,
        "stamped_headers": None,
        "stamps": {},
    }
    if traceparent:
        headers["traceparent"] = traceparent
    body = json.dumps(
        [args, {}, {"callbacks": None, "errbacks": None, "chain": None, "chord": None}]
    )
    return amqp.Message(
        body.encode(),
        content_type="application/json",
        content_encoding="utf-8",
        application_headers=headers,
        delivery_mode=2,
        correlation_id=task_id,
        reply_to="",
        priority=0,
    )


def _send(
    app: Any,
    *,
    job_id: uuid.UUID,
    generation: int,
    headers: dict[str, str],
    page_range: RangeRef | None = None,
) -> None:
    args: list[Any] = [str(job_id), generation]
    if page_range is not None:
        args += [page_range.first, page_range.generation]
    app.send_task(
        TASK_NAME,
        args=args,
        queue=settings.CONVERSION_QUEUE,
        # Explicit: for a direct exchange Celery otherwise falls back to the default exchange,
        # where the least-privilege publisher may not write.
        exchange=settings.CONVERSION_EXCHANGE,
        routing_key=settings.CONVERSION_QUEUE,
        headers=headers,
        # retry / retry_policy: the app's (CELERY_TASK_PUBLISH_RETRY_POLICY), one immediate
        # retry on a fresh connection: a pooled connection that died with a broker restart must
        # not push every first publish afterwards onto the sweeper. Anything more is the
        # sweeper's job, so a request is never held up for long.
        confirm_timeout=settings.QUIRE["PUBLISH_CONFIRM_TIMEOUT_S"],
        ignore_result=True,
    )


def error_code(exc: BaseException) -> str:
    """The outbox's ``last_error_code`` for a failed publish (docs/API_CONTRACT.md codes)."""
    name = type(exc).__name__
    if "Timeout" in name or isinstance(exc, TimeoutError):
        return "broker_timeout"
    # kombu wraps a refused or reset connection in its OperationalError.
    if isinstance(exc, OSError | BrokerOperationalError) or "Connection" in name:
        return "broker_unreachable"
    return "publish_failed"
