"""OpenTelemetry: off unless configured by the standard ``OTEL_*`` variables.

``OTEL_TRACES_EXPORTER`` (``otlp``, ``console`` or ``none``; default ``none``) turns tracing on.
The trace context is carried web -> outbox row (``traceparent``) -> task headers -> page spans.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

from opentelemetry import context, propagate, trace

tracer = trace.get_tracer("quire")
_configured = False


def enabled() -> bool:
    return os.environ.get("OTEL_TRACES_EXPORTER", "none").lower() not in {"", "none"}


def configure(exporter: object | None = None) -> None:
    """Install a tracer provider once per process; ``exporter`` is for tests (in-memory)."""
    global _configured
    if _configured or (exporter is None and not enabled()):
        return
    # (function-level here and below: the SDK, its exporters and instrumentors load only in a
    # process that traces; OTEL_TRACES_EXPORTER is unset by default)
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": "quire"}))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))  # type: ignore[arg-type]
    else:
        kind = os.environ["OTEL_TRACES_EXPORTER"].lower()
        if kind == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # type: ignore
                OTLPSpanExporter,
            )

            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    _configured = True


def instrument_web() -> None:
    if not enabled():
        return
    configure()
    from opentelemetry.instrumentation.django import DjangoInstrumentor
    from opentelemetry.instrumentation.psycopg import PsycopgInstrumentor

    DjangoInstrumentor().instrument()
    PsycopgInstrumentor().instrument()


def instrument_worker() -> None:
    if not enabled():
        return
    configure()
    from opentelemetry.instrumentation.psycopg import PsycopgInstrumentor

    PsycopgInstrumentor().instrument()


def page_span(page: int) -> AbstractContextManager[object]:
    """The span of one converted page. Without a tracer provider (tracing off, the default) a
    shared no-op context: the API's no-op tracer still builds a span and a context manager per
    call (≈ 10 µs a page in the pool process)."""
    if not _configured:
        return _NO_SPAN
    return tracer.start_as_current_span("conversion.page", attributes={"quire.page": page})


_NO_SPAN = nullcontext()


def current_traceparent() -> str:
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier.get("traceparent", "")


def span_from_traceparent(
    name: str, traceparent: str, **attributes: object
) -> AbstractContextManager[None]:
    """A span whose parent is the trace context carried in ``traceparent``. Without a tracer
    provider (tracing off, the default) the shared no-op context, as ``page_span``: the API's
    no-op tracer would still parse the header, attach a context and build a non-recording span
    around every task (≈ 1.4 % of a pool process's Python time per one-page job; ADR 0017,
    session 10). Nothing reads the worker's current context then: the outbox rows a worker
    writes carry the job row's ``traceparent``, not the process's context."""
    if not _configured:
        return _NO_SPAN
    return _span_from_traceparent(name, traceparent, **attributes)


@contextmanager
def _span_from_traceparent(name: str, traceparent: str, **attributes: object) -> Iterator[None]:
    ctx = propagate.extract({"traceparent": traceparent}) if traceparent else None
    token = context.attach(ctx) if ctx is not None else None
    try:
        with tracer.start_as_current_span(name, attributes=attributes):  # type: ignore[arg-type]
            yield
    finally:
        if token is not None:
            context.detach(token)
