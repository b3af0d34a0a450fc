"""Two ASGI middlewares around the application: ``/health/live`` on the event loop, and one
content-free access line per request (ADR 0016)."""

from __future__ import annotations

import logging
import time
from typing import Any

access_logger = logging.getLogger("quire.access")


def log_access(
    *, method: str, path: str, query: bytes, status: int, started: float, sent: int
) -> None:
    """One line per request: method, path, the *names* of the query parameters (values may be
    secrets), status, duration and body bytes sent. No headers (tokens), no client address,
    no body (file names)."""
    names = sorted({p.split(b"=", 1)[0].decode("latin-1")[:32] for p in query.split(b"&") if p})
    shown_query = ("?" + "&".join(names)) if names else ""
    shown_path = path if len(path) <= 256 else path[:256] + "…"
    duration_ms = (time.perf_counter() - started) * 1000
    access_logger.info(
        "%s %s%s %d %.1fms %dB",
        method,
        shown_path,
        shown_query,
        status,
        duration_ms,
        sent,
        extra={
            "http_method": method,
            "http_path": shown_path,
            "http_query_names": names,
            "http_status": status,
            "duration_ms": round(duration_ms, 1),
            "response_bytes": sent,
        },
    )


class Liveness:
    """ASGI middleware: ``GET /health/live`` answered by the event loop itself, without Django.

    Liveness means "this process serves": its event loop turns. Through Django it would also
    wait for one of the request's sync threads, which a database outage can keep busy for
    seconds (connect timeouts) - and a liveness probe that fails then makes the orchestrator
    restart healthy web processes in the middle of somebody else's outage. The body is the one
    ``conversion_jobs.api.health.live`` gives."""

    BODY = b'{"status": "ok"}'

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if (
            scope["type"] != "http"
            or scope.get("path") != "/health/live"
            or scope.get("method") not in ("GET", "HEAD")
        ):
            await self.app(scope, receive, send)
            return
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(self.BODY)).encode()),
                    (b"x-content-type-options", b"nosniff"),
                    (b"cache-control", b"no-store"),
                ],
            }
        )
        body = self.BODY if scope["method"] == "GET" else b""
        await send({"type": "http.response.body", "body": body})


class AccessLog:
    """ASGI middleware: :func:`log_access` for every HTTP request the application answers
    (the server's own answers are logged by :class:`QuireHttpProtocol`)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status, sent = 0, 0

        async def send_counted(message: Any) -> None:
            nonlocal status, sent
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                sent += len(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        finally:
            log_access(
                method=scope.get("method", "-"),
                path=scope.get("path", "-"),
                query=scope.get("query_string", b""),
                status=status or 499,  # 499: the client went away before an answer
                started=started,
                sent=sent,
            )
