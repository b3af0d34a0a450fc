"""One trace covers a job from POST to its terminal state: web request -> outbox publish ->
task (continued from the traceparent carried in the message headers) -> pages -> finalize."""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.instrumentation.django import DjangoInstrumentor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from conversion_jobs.models import ConversionJob, ConversionOutbox
from conversion_jobs.observability import tracing
from tasks.conversion import run_conversion
from tests.conftest import token


@pytest.fixture
def spans():
    exporter = InMemorySpanExporter()
    if tracing._configured:
        # configure() installs the provider once per process; attach this exporter to it.
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor

        trace.get_tracer_provider().add_span_processor(SimpleSpanProcessor(exporter))  # type: ignore[attr-defined]
    else:
        tracing.configure(exporter=exporter)
    DjangoInstrumentor().instrument()
    try:
        yield exporter
    finally:
        DjangoInstrumentor().uninstrument()


@pytest.mark.django_db(transaction=True)
def test_trace__one_trace_from_post_to_terminal_state(spans, pdf_file, monkeypatch):
    from rest_framework.test import APIClient

    from conversion_jobs.services import broker

    sent: list[dict[str, str]] = []
    # The broker leg is replaced by capturing the headers the message would carry; the task
    # below is then invoked with exactly those headers.
    monkeypatch.setattr(
        broker, "_send", lambda app, *, job_id, generation, headers: sent.append(headers)
    )
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token()}")
    with open(pdf_file(pages=3), "rb") as fh:
        response = client.post("/api/v1/jobs", {"file": fh, "output": "text"}, format="multipart")
    assert response.status_code == 202
    job = ConversionJob.objects.get(id=response.json()["id"])
    assert job.traceparent and ConversionOutbox.objects.get(job=job).traceparent == job.traceparent
    assert sent == [{"traceparent": job.traceparent}]

    outcome = run_conversion.apply(args=[str(job.id), 1], headers=sent[0]).get()
    assert outcome == "succeeded"

    finished = spans.get_finished_spans()
    trace_id = int(job.traceparent.split("-")[1], 16)
    names = [s.name for s in finished if s.context.trace_id == trace_id]
    assert any(n.startswith(("POST", "jobs")) or "api/v1/jobs" in n for n in names), names
    assert "outbox.publish" in names
    assert "conversion.run" in names
    assert names.count("conversion.page") == 3
    assert "conversion.finalize" in names
    # nothing of the document or the tenant in span attributes
    for span in finished:
        for value in (span.attributes or {}).values():
            assert "tenant-a" not in str(value) and ".pdf" not in str(value)
