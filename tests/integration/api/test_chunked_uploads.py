"""A submission whose body comes ``Transfer-Encoding: chunked`` (issue 22 point 6), through the
web's ASGI application in-process, its body in several ``http.request`` messages as the server
hands over the chunks it decoded: read, parsed and limited exactly as the same body sent with a
``Content-Length`` - the plain-form fast path for a small one, Django's parser for a larger one,
413 past the upload limit. Before, Django read no body without a ``Content-Length``: every chunked
upload was "the file part is required" (400)."""

from __future__ import annotations

import asyncio
import hashlib
import json
from typing import Any

import pytest
from django.db import connections

from conversion_jobs.models import ConversionJob
from conversion_jobs.web import handler as web
from tests import multipart, testdocs
from tests.conftest import token
from tests.integration.api.conftest import row_counts, staged_uploads, stored_objects

pytestmark = pytest.mark.django_db(transaction=True)

LIMIT = 200_000


def _chunked(app: Any, body: bytes, *, chunk: int = 7_000) -> tuple[int, dict[str, Any]]:
    """POST ``body`` to /api/v1/jobs as a chunked request: (status, JSON body)."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/api/v1/jobs",
        "raw_path": b"/api/v1/jobs",
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"testserver"),
            (b"authorization", f"Bearer {token()}".encode()),
            (b"content-type", multipart.CONTENT_TYPE.encode()),
            (b"transfer-encoding", b"chunked"),
        ],
        "client": ("127.0.0.1", 1),
        "server": ("testserver", 80),
    }
    pieces = [body[i : i + chunk] for i in range(0, len(body), chunk)]
    sent: list[dict[str, Any]] = []

    async def run() -> None:
        async def receive() -> dict[str, Any]:
            if pieces:
                await asyncio.sleep(0)  # the chunks arrive one by one
                return {"type": "http.request", "body": pieces.pop(0), "more_body": bool(pieces)}
            await asyncio.sleep(3600)
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        await app(scope, receive, send)

    asyncio.run(run())
    start = next(m for m in sent if m["type"] == "http.response.start")
    content = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], json.loads(content)


@pytest.fixture
def app(no_broker_publish: Any) -> Any:
    handler = web.QuireASGIHandler()
    yield handler
    for thread in handler.threads:  # each thread's connection, then the thread
        thread.submit(connections.close_all).result()
        thread.shutdown()


def _form(document: bytes) -> bytes:
    return multipart.body(
        multipart.part("file", document, filename="doc.pdf"), multipart.part("output", b"text")
    )


@pytest.mark.parametrize("padding", [0, 100_000], ids=["small_plain_form", "large_django_parser"])
def test_chunked_submission__is_accepted_as_with_a_content_length(app, settings_quire, padding):
    settings_quire(MAX_UPLOAD_BYTES=LIMIT)
    document = testdocs.pdf_bytes(pages=1) + b"%" * padding
    assert (len(document) < 64 * 1024) == (padding == 0)  # the fast path's size
    status, body = _chunked(app, _form(document))
    assert status == 202, body
    job = ConversionJob.objects.get()
    assert str(job.id) == body["id"]
    assert job.source_sha256 == hashlib.sha256(document).hexdigest()
    assert body["source"]["size"] == len(document)


def test_chunked_submission__past_the_upload_limit_is_413_and_leaves_nothing(app, settings_quire):
    settings_quire(MAX_UPLOAD_BYTES=LIMIT)
    document = testdocs.pdf_bytes(pages=1)
    document += b"%" * (LIMIT + 1 - len(document))
    status, body = _chunked(app, _form(document))
    assert (status, body["code"]) == (413, "payload_too_large"), body
    assert row_counts()["jobs"] == 0
    assert [*stored_objects(), *staged_uploads()] == []
