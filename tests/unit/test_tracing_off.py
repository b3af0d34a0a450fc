"""Tracing off (no tracer provider, the default): the task's span around each conversion is the
shared no-op context, as each page's is — no header parsed, no context attached, no span built
(ADR 0017, session 10). Tracing on is tests/integration/observability/test_tracing.py."""

from __future__ import annotations

import pytest
from opentelemetry import trace

from conversion_jobs.observability import tracing

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_span_from_traceparent__off_attaches_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tracing, "_configured", False)
    span = tracing.span_from_traceparent("conversion.run", TRACEPARENT, attempt=1)
    assert span is tracing.page_span(1)  # the one shared no-op context
    with span:
        assert not trace.get_current_span().get_span_context().is_valid
    assert not trace.get_current_span().get_span_context().is_valid
