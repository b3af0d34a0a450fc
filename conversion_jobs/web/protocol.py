"""The HTTP server's own limits and answers: uvicorn's httptools protocol, bounded, answering
in problem+json (ADR 0016; kept by ADR 0024: no uvicorn setting bounds a request head or times
it out; Granian's settings would, the ADR says what a move to it still needs).

* request target > ``QUIRE_HTTP_MAX_URL_BYTES`` -> 414; request line + headers >
  ``QUIRE_HTTP_MAX_HEAD_BYTES`` -> 431 (httptools buffers an unfinished head without limit);
  ``Content-Length`` or chunked bytes > ``QUIRE_HTTP_MAX_BODY_BYTES`` -> 413; bytes httptools
  cannot parse -> 400;
* a request head must arrive within ``QUIRE_HTTP_HEADER_TIMEOUT_S`` of its first byte, a body
  may pause at most ``QUIRE_HTTP_BODY_IDLE_TIMEOUT_S`` -> 408; a fresh connection that sends
  nothing is closed after the keep-alive timeout;
* a refusal of a pipelined request waits for the answers before it.

It relies on private parts of ``uvicorn.protocols.http.httptools_impl`` (pinned in
pyproject.toml; ``tests/unit/test_web_private_apis.py`` fails when an upgrade moves them).
"""

from __future__ import annotations

import json
import logging
import os
import time
from asyncio import TimerHandle
from typing import Any

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from conversion_jobs.web.access import log_access

log = logging.getLogger(__name__)

MIB = 1024 * 1024


def _env_float(name: str, default: float) -> float:
    return float(os.environ.get(name, default))


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


HEADER_TIMEOUT_S = _env_float("QUIRE_HTTP_HEADER_TIMEOUT_S", 10.0)
BODY_IDLE_TIMEOUT_S = _env_float("QUIRE_HTTP_BODY_IDLE_TIMEOUT_S", 30.0)
MAX_URL_BYTES = _env_int("QUIRE_HTTP_MAX_URL_BYTES", 8192)
MAX_HEAD_BYTES = _env_int("QUIRE_HTTP_MAX_HEAD_BYTES", 32768)
MAX_BODY_BYTES = _env_int(
    "QUIRE_HTTP_MAX_BODY_BYTES", _env_int("QUIRE_MAX_UPLOAD_BYTES", 100 * MIB) + MIB
)

#: status -> (code, title, detail) of the answers the server gives without the application.
SERVER_PROBLEMS: dict[int, tuple[str, str, str]] = {
    400: ("malformed_request", "Malformed HTTP request", "the request is not valid HTTP/1.1"),
    408: (
        "request_timeout",
        "Request timed out",
        "the request was not received in time; send it again",
    ),
    413: (
        "payload_too_large",
        "Payload too large",
        f"the request body exceeds {MAX_BODY_BYTES} bytes",
    ),
    414: ("uri_too_long", "URI too long", f"the request target exceeds {MAX_URL_BYTES} bytes"),
    431: (
        "request_header_fields_too_large",
        "Request header fields too large",
        f"the request line and headers exceed {MAX_HEAD_BYTES} bytes",
    ),
}


def problem_bytes(status: int) -> bytes:
    code, title, detail = SERVER_PROBLEMS[status]
    body = {
        "type": f"https://quire.dev/problems/{code}",
        "title": title,
        "status": status,
        "code": code,
        "detail": detail,
    }
    return json.dumps(body, separators=(",", ":")).encode()


class QuireHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, bounded and answering in problem+json."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = False
        self._head_bytes = 0
        self._head_started = 0.0
        self._body_bytes = 0
        self._read_timer: TimerHandle | None = None
        #: a refusal held back until the answers to the requests before it are written
        self._refusal: tuple[int, Any] | None = None

    # -- connection -------------------------------------------------------------------------

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # uvicorn arms its keep-alive timer only after a response: a connection that never
        # sends a byte would be held forever. Treat it like an idle kept-alive connection.
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler
        )

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_read_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.transport.is_closing() or self._refusal is not None:
            return  # refused: ignore whatever else the client sends
        super().data_received(data)
        if self._in_head and not self.transport.is_closing():
            # httptools buffers a header it has not seen the end of: bound that buffer.
            self._head_bytes += len(data)
            if self._head_bytes > MAX_URL_BYTES + MAX_HEAD_BYTES:
                self._refuse(414 if len(self.url) > MAX_URL_BYTES else 431)

    # -- parser callbacks -------------------------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True
        self._head_bytes = 0
        self._body_bytes = 0
        self._head_started = time.perf_counter()
        self._arm_read_timer(HEADER_TIMEOUT_S)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._cancel_read_timer()
        head = len(self.url) + sum(len(n) + len(v) + 4 for n, v in self.headers)
        if len(self.url) > MAX_URL_BYTES:
            self._refuse(414)
            return
        if head > MAX_HEAD_BYTES:
            self._refuse(431)
            return
        length = content_length(self.headers)
        if length is not None and length > MAX_BODY_BYTES:
            self._refuse(413)
            return
        super().on_headers_complete()
        if length or _chunked(self.headers):
            self._arm_read_timer(BODY_IDLE_TIMEOUT_S)

    def on_body(self, body: bytes) -> None:
        if self.transport.is_closing():
            return
        self._body_bytes += len(body)
        if self._body_bytes > MAX_BODY_BYTES:
            self._refuse(413)
            return
        self._arm_read_timer(BODY_IDLE_TIMEOUT_S)
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._cancel_read_timer()
        if self.transport.is_closing() or self.cycle is None:
            return
        super().on_message_complete()

    # -- the server's own answers -----------------------------------------------------------

    def send_400_response(self, msg: str) -> None:
        self._refuse(400)

    def on_response_complete(self) -> None:
        last = not self.pipeline  # no request queued behind the one just answered
        super().on_response_complete()
        if last and self._refusal is not None:
            status, scope = self._refusal
            self._refusal = None
            self._unset_keepalive_if_required()
            self._refuse_now(status, scope)

    def _refuse(self, status: int) -> None:
        """Refuse the request being received: at once, or - while requests received before it
        (pipelined, RFC 9112 §9.3.2) are still being answered - once their answers are
        written, in order; nothing more is read meanwhile. A request whose own body is cut
        short (its application sees a disconnect) is refused at once, and one still queued
        behind another is dropped unanswered by the application."""
        self._cancel_read_timer()
        self._in_head = False
        if self.transport.is_closing() or self._refusal is not None:
            return
        cycle = self.cycle
        if cycle is not None and cycle.more_body and not cycle.response_complete:
            if self.pipeline and self.pipeline[0][0] is cycle:
                self.pipeline.popleft()  # queued, never started: the refusal answers it
                self._refusal = (status, self.scope)
                return
        elif self.pipeline or (cycle is not None and not cycle.response_complete):
            self._refusal = (status, self.scope)
            return
        self._refuse_now(status, self.scope)

    def _refuse_now(self, status: int, scope: Any) -> None:
        """Answer ``status`` as problem+json, close the connection, log it; the application
        never sees the request (or, mid-body, sees the client disconnect)."""
        if self.transport.is_closing():
            return
        body = problem_bytes(status)
        self.transport.write(
            b"".join(
                [
                    STATUS_LINE[status],
                    b"content-type: application/problem+json\r\n",
                    b"content-length: " + str(len(body)).encode() + b"\r\n",
                    b"connection: close\r\n\r\n",
                    body,
                ]
            )
        )
        self.transport.close()
        scope = scope or {}
        log_access(
            method=scope.get("method", "-"),
            path=scope.get("path", "-"),
            query=scope.get("query_string", b""),
            status=status,
            started=self._head_started or time.perf_counter(),
            sent=len(body),
        )

    def _read_timeout(self) -> None:
        self._read_timer = None
        if self.cycle is not None and self.cycle.response_started and not self._in_head:
            self.transport.close()  # the application is answering already: just hang up
            return
        if self.cycle is not None and not self.cycle.response_complete and not self._in_head:
            # Mid-body: the application is waiting for the rest; it sees a disconnect.
            self.cycle.disconnected = True
            self.cycle.message_event.set()
        self._refuse(408)

    def _arm_read_timer(self, seconds: float) -> None:
        self._cancel_read_timer()
        self._read_timer = self.loop.call_later(seconds, self._read_timeout)

    def _cancel_read_timer(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None


def content_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    for name, value in headers:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _chunked(headers: list[tuple[bytes, bytes]]) -> bool:
    return any(n == b"transfer-encoding" and b"chunked" in v.lower() for n, v in headers)
