"""The web tier's HTTP server: gunicorn managing uvicorn workers (ADR 0016).

* :class:`QuireUvicornWorker` - the gunicorn worker class the Procfile names: uvloop, httptools,
  :class:`QuireHttpProtocol`, and an even spread of the shared socket's connections over the
  workers (:class:`_BalancedAccept`).
* :class:`QuireHttpProtocol` - uvicorn's httptools protocol with what a public listener needs:
  bounded request heads (414 / 431), a body cap (413), a deadline for the request head and an
  idle limit for the body (408), an idle limit on a fresh connection, and every answer the
  server gives itself as ``application/problem+json`` with a stable code.
* :class:`QuireASGIHandler` - Django's ASGI handler, with the sync parts of every request
  (middleware, DRF views, ORM) on a fixed set of ``WEB_THREADS`` long-lived threads per process
  instead of a new thread per request; the API's own views without the admin's middleware; a
  small upload accepted on the event loop itself (``JobCollectionView.submit_on_loop``).
* :class:`Liveness` - ``/health/live`` answered on the event loop, never behind a busy thread.
* :class:`AccessLog` - one content-free line per request.

Limits (environment; docs/OPERABILITY.md "Slow clients"):

=================================  =======  =============================================
``QUIRE_HTTP_HEADER_TIMEOUT_S``    10       first byte to end of the request head
``QUIRE_HTTP_BODY_IDLE_TIMEOUT_S`` 30       longest silence while a body is being received
``QUIRE_HTTP_MAX_URL_BYTES``       8192     request target (path + query)
``QUIRE_HTTP_MAX_HEAD_BYTES``      32768    request line + headers
``QUIRE_HTTP_MAX_BODY_BYTES``      upload   ``QUIRE_MAX_UPLOAD_BYTES`` + 1 MiB of multipart
``QUIRE_HTTP_BALANCE``             1        spread connections evenly over the workers
``QUIRE_HTTP_ACCEPT_DEFER_S``      0.005    a worker above its share leaves a connect so long
=================================  =======  =============================================
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import sys
import tempfile
import threading
import time
from asyncio import TimerHandle
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import Executor, Future
from queue import SimpleQueue
from typing import Any

from asgiref.sync import ThreadSensitiveContext, iscoroutinefunction, sync_to_async
from django.conf import settings
from django.core import signals
from django.core.exceptions import DisallowedHost, RequestAborted
from django.core.handlers.asgi import ASGIHandler, get_script_prefix
from django.core.handlers.base import BaseHandler
from django.db import connection
from django.http import HttpRequest, HttpResponseBase, StreamingHttpResponse
from django.urls import Resolver404, get_resolver, set_script_prefix
from gunicorn.arbiter import Arbiter
from rest_framework.views import APIView
from uvicorn import Server as UvicornServer
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol
from uvicorn_worker import UvicornWorker

from conversion_jobs.db import health_check_by_socket

log = logging.getLogger(__name__)
access_logger = logging.getLogger("quire.access")

MIB = 1024 * 1024
#: A streamed response body is read this much at a time (more when one chunk is larger): the
#: most of it the web holds per download, and one thread hop per batch.
STREAM_BATCH_BYTES = 256 * 1024


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


class _SyncThread(Executor):
    """One long-lived thread that runs one request's sync calls at a time; counts its queue.

    A minimal executor rather than a ``ThreadPoolExecutor``: its ``submit`` takes the
    module-wide shutdown lock of ``concurrent.futures`` that every executor of the process
    shares, a visible part of each thread hop in the accept profile (ADR 0017 addendum)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.pending = 0
        self._lock = threading.Lock()
        self._queue: SimpleQueue[tuple[Future[Any], Any, tuple[Any, ...], dict[str, Any]] | None]
        self._queue = SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Future[Any]:
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                    self._thread.start()
        future: Future[Any] = Future()
        with self._lock:
            self.pending += 1
        self._queue.put((future, fn, args, kwargs))
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._queue.put(None)
        if wait and self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            future, fn, args, kwargs = item
            try:
                if future.set_running_or_notify_cancel():
                    try:
                        result = fn(*args, **kwargs)
                    except BaseException as exc:
                        future.set_exception(exc)
                    else:
                        future.set_result(result)
            finally:
                with self._lock:
                    self.pending -= 1
                del item, future, fn, args, kwargs


class QuireASGIHandler(ASGIHandler):
    """Django's ASGI handler gives every request a thread of its own for its sync parts
    (``ThreadSensitiveContext()``), kept until the response ends: a waiting client would hold an
    idle thread - and that thread's database connection - for as long as it waits, and every
    request would open a new database connection. Here each request borrows, for its sync
    calls only, the least busy of ``WEB_THREADS`` long-lived threads: all of one request's
    sync calls still run on one thread (Django's thread-sensitivity contract), persistent
    database connections work as under gthread, and an awaiting request holds nothing."""

    def __init__(self, *, lean_api: bool = True, accept_on_loop: bool = False) -> None:
        super().__init__()
        count = max(1, int(os.environ.get("WEB_THREADS", "4")))
        self.threads = [_SyncThread(f"quire-sync-{n}") for n in range(count)]
        # The same middleware, built for sync views: a request to a sync view (every view but
        # the long-poll / event-stream wrappers) runs its whole middleware chain and view in
        # one hop onto its thread, instead of one hop per middleware hook and one for the view
        # (ADR 0017 addendum: ~10 hops, each a context copy and two thread hand-overs).
        self.sync_handler = BaseHandler()
        self.sync_handler.load_middleware(is_async=False)
        # The API's own views get the chain without the admin's middleware (sessions, CSRF,
        # users, messages: ``ADMIN_ONLY_MIDDLEWARE``), ≈ 0.1 ms of the web's CPU per request
        # (ADR 0017, session 7); the admin and every other path keep the whole chain.
        self.api_handler = self.sync_handler
        if lean_api:
            self.api_handler = BaseHandler()
            _load_sync_middleware(
                self.api_handler,
                [m for m in settings.MIDDLEWARE if m not in settings.ADMIN_ONLY_MIDDLEWARE],
            )
        self._sync_response = sync_to_async(self._started_then_respond, thread_sensitive=True)
        # A small upload accepted on the event loop (ADR 0017 session 11) is answered through
        # the API's middleware chain too, run on the loop around the answer already made.
        self.loop_handler: _LoopAnswerHandler | None = None
        if accept_on_loop and loop_accept_possible():
            self.loop_handler = _LoopAnswerHandler()
            _load_sync_middleware(
                self.loop_handler,
                [m for m in settings.MIDDLEWARE if m not in settings.ADMIN_ONLY_MIDDLEWARE],
            )

    def _started_then_respond(self, request: HttpRequest) -> HttpResponseBase:
        """``request_started``, the sync middleware chain and view, and - for a response whose
        body is already in memory - ``response.close()`` (``request_finished``: its receivers
        recycle the thread's database connection), all in one hop onto the request's thread.

        Closing before the bytes are sent changes nothing the client sees: a non-streaming
        body is a list of bytes that ``close()`` leaves alone, and the transaction committed
        before the view returned. It saves the second hop per request that Django spends on
        ``response.close`` after the send (ADR 0017, session 6). A streaming response (a
        download) is still closed after its body was sent, on its thread."""
        signals.request_started.send(sender=self.__class__, scope=request.scope)  # type: ignore[attr-defined]
        health_check_by_socket(connection)  # no SELECT 1 per request (conversion_jobs/db.py)
        handler = self.api_handler if _api_view(request.path_info) else self.sync_handler
        response = handler.get_response(request)
        if not response.streaming:
            response._handler_class = self.__class__  # type: ignore[attr-defined]  # as Django's
            response.close()
        return response

    async def send_response(self, response: HttpResponseBase, send: Any) -> None:
        """Django's, except that a streaming body from a sync iterator (a download: a stored
        result or page, the ZIP of a PNG result) is read a batch at a time on the request's
        thread, each batch once the client took the one before. Django would read it whole
        into memory before sending a byte (``StreamingHttpResponse.__aiter__`` runs ``list()``
        on it): the web's memory would grow by the whole result, and a ZIP result's page that
        vanishes after the response started would go unnoticed (ADR 0018, session 5)."""
        if isinstance(response, StreamingHttpResponse) and not response.is_async:
            chunks = response.streaming_content
            assert isinstance(chunks, Iterator)  # noqa: S101 - not is_async: a sync map()
            response.streaming_content = _batches_on_thread(chunks)
        await super().send_response(response, send)

    async def get_response_async(self, request: HttpRequest) -> HttpResponseBase:
        if _async_view(request.path_info):
            await signals.request_started.asend(sender=self.__class__, scope=request.scope)  # type: ignore[attr-defined]
            return await super().get_response_async(request)
        return await self._sync_response(request)

    async def handle(self, scope: Any, receive: Any, send: Any) -> None:
        """Django 5.2's ``ASGIHandler.handle`` with one change: ``request_started`` (its
        receivers reset the query log and recycle the thread's database connection) is sent
        on the request's thread in the same hop as the view (``get_response_async``), not in a
        hop of its own before the request is built (ADR 0017 addendum)."""
        try:
            body_file = await self.read_body(receive)
        except RequestAborted:
            return
        scope = _dechunked(scope, body_file)
        set_script_prefix(get_script_prefix(scope))
        request, error_response = self.create_request(scope, body_file)
        if request is not None and error_response is None and self.loop_handler is not None:
            view = _loop_submission_view(scope)
            if view is not None:
                answer = await self._answer_on_loop(request, *view)
                if answer is not None:
                    await self.send_response(answer, send)
                    body_file.close()
                    return
                # The sync path answers, from a request of its own over the same body.
                body_file = _body_again(request, body_file)
                request, error_response = self.create_request(scope, body_file)
        if request is None or error_response is not None:
            await signals.request_started.asend(sender=self.__class__, scope=scope)
            body_file.close()
            if error_response is not None:
                await self.send_response(error_response, send)
                await sync_to_async(error_response.close)()
            return

        async def process_request(request: Any, send: Any) -> Any:
            response = await self.run_get_response(request)
            try:
                await self.send_response(response, send)
            except asyncio.CancelledError:
                pass  # the client disconnected during send_response
            return response

        tasks = [
            asyncio.create_task(self.listen_for_disconnect(receive)),
            asyncio.create_task(process_request(request, send)),
        ]
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in tasks:
            if task.done():
                try:
                    task.result()
                except RequestAborted:
                    pass  # client disconnects are ignored
                except AssertionError:
                    body_file.close()
                    raise
            else:
                task.cancel()  # let views handle cancellation
                try:
                    await task
                except asyncio.CancelledError:
                    pass
        try:
            response = tasks[1].result()
        except asyncio.CancelledError:
            await signals.request_finished.asend(sender=self.__class__)
        else:
            if not response.closed:  # a streaming body, or an async view's answer
                await sync_to_async(response.close)()
        body_file.close()

    async def _answer_on_loop(
        self, request: HttpRequest, view_class: Any, initkwargs: dict[str, Any]
    ) -> HttpResponseBase | None:
        """A submission answered on the event loop (``JobCollectionView.submit_on_loop``), then
        through the API's middleware chain on the loop (its hooks are in-memory header work:
        ``loop_accept_possible`` holds them to the shipped list), with ``request_started``
        and ``request_finished`` as the sync path sends them. None: the sync path answers.
        Whatever the chain's request hooks would refuse (a host not allowed) is left to it
        before anything is written."""
        try:
            request.get_host()
        except DisallowedHost:
            _count_handoff("shape")
            return None
        view = view_class(**initkwargs)  # as ``as_view`` makes it
        view.setup(request)
        answer = await view.submit_on_loop(request)
        if answer is None:
            return None
        request.quire_loop_answer = answer  # type: ignore[attr-defined]
        signals.request_started.send(sender=self.__class__, scope=request.scope)  # type: ignore[attr-defined]
        assert self.loop_handler is not None  # noqa: S101 - the caller checked
        response = self.loop_handler.get_response(request)
        response._handler_class = self.__class__  # type: ignore[attr-defined]  # as Django's
        response.close()
        return response

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            raise ValueError(f"Django can only handle ASGI/HTTP connections, not {scope['type']}.")
        thread = min(self.threads, key=lambda t: t.pending)
        async with ThreadSensitiveContext(executor=thread):
            await self.handle(scope, receive, send)


def _dechunked(scope: Any, body_file: Any) -> Any:
    """``scope`` of a request whose body came ``Transfer-Encoding: chunked`` as the request
    with the ``Content-Length`` of the body received; any other scope as it is.

    The server decoded the chunks and bounded their total (``MAX_BODY_BYTES``: 413 while they
    arrive), and ``read_body`` spooled them to a file as they came (on disk past
    ``FILE_UPLOAD_MAX_MEMORY_SIZE``). Django reads a body only as far as ``Content-Length``
    (``CONTENT_LENGTH`` missing: an empty body, so a chunked upload had "no file part"), and
    every upload limit reads it too: with it the body is read, parsed and limited exactly as
    one sent with that length (docs/API_CONTRACT.md §2.1)."""
    headers = scope.get("headers", [])
    codings = [v for n, v in headers if n == b"transfer-encoding"]
    if [c.strip().lower() for c in codings] != [b"chunked"]:
        return scope
    if any(n == b"content-length" for n, _ in headers):
        return scope  # never both: the server refuses such a request (request smuggling)
    size = body_file.seek(0, os.SEEK_END)
    body_file.seek(0)
    kept = [(n, v) for n, v in headers if n != b"transfer-encoding"]
    return {**scope, "headers": [*kept, (b"content-length", str(size).encode())]}


def _body_again(request: HttpRequest, body_file: Any) -> Any:
    """The request body to build a second request from: ``body_file`` rewound, or - when the
    first request read it (Django closes the file it read ``request.body`` from) - a new file
    with the bytes it read (at most ``SMALL_BODY_BYTES``: the loop reads only small bodies)."""
    if not body_file.closed:
        body_file.seek(0)
        return body_file
    again = tempfile.SpooledTemporaryFile(max_size=settings.FILE_UPLOAD_MAX_MEMORY_SIZE, mode="w+b")
    again.write(request.body)
    again.seek(0)
    return again


def _next_batch(chunks: Iterator[bytes]) -> bytes | None:
    """The next ``STREAM_BATCH_BYTES`` or more of ``chunks`` (one chunk may be larger); None at
    the end. Runs on the request's thread (a read may block on the disk or the S3 server)."""
    batch: list[bytes] = []
    size = 0
    for chunk in chunks:
        batch.append(chunk)
        size += len(chunk)
        if size >= STREAM_BATCH_BYTES:
            break
    return b"".join(batch) if batch else None


class DownloadCut(Exception):
    """A download's stored bytes could not be read after its response started (a PNG result's
    page deleted meanwhile, say): the server can only close the connection short of its
    ``Content-Length``. Raised in place of the store's error, whose message names the object's
    path or key (the job id): the server logs this one's traceback instead."""


async def _batches_on_thread(chunks: Iterator[bytes]) -> AsyncIterator[bytes]:
    """``chunks`` as an async iterator, a batch per hop onto the request's thread; the next
    batch is read only when the server asks for it, after the client drained the last one
    (uvicorn's ``send`` waits while the transport is paused). A read that fails is logged by
    its error's class only and ends the body with ``DownloadCut``."""
    next_batch = sync_to_async(_next_batch, thread_sensitive=True)
    while True:
        try:
            batch = await next_batch(chunks)
        except Exception as exc:
            log.warning("download cut short", extra={"error": type(exc).__name__})
            raise DownloadCut("a stored object of this download could not be read") from None
        if batch is None:
            return
        yield batch


#: What a path resolves to (``_route``): an async view, one of the API's own sync views, or
#: anything else (another view, or nothing: its 404 comes from the whole chain).
ROUTE_ASYNC, ROUTE_API, ROUTE_OTHER = "async", "api", "other"


def _async_view(path: str) -> bool:
    """Whether ``path`` resolves to an async view (it must stay on the event loop); a path that
    resolves to nothing goes the sync way (its 404 comes from the same middleware)."""
    return _route(get_resolver(), path) == ROUTE_ASYNC


def _api_view(path: str) -> bool:
    """Whether ``path`` resolves to one of the API's own DRF views (``conversion_jobs.api``):
    bearer tokens, no session, no forms; they run without ``ADMIN_ONLY_MIDDLEWARE``."""
    return _route(get_resolver(), path) == ROUTE_API


@functools.lru_cache(maxsize=4096)
def _route(resolver: Any, path: str) -> str:
    """Memoised per URL configuration and path: the answer never changes for them, and
    resolving on the event loop for every request was ≈ 2.5 % of the web's CPU per accepted
    job (ADR 0017, session 6). Bounded: paths with ids in them only cost their own miss."""
    try:
        match = resolver.resolve(path)
    except Resolver404:
        return ROUTE_OTHER
    if iscoroutinefunction(match.func):
        return ROUTE_ASYNC
    view_class = getattr(match.func, "cls", None)
    if (
        isinstance(view_class, type)
        and issubclass(view_class, APIView)
        and view_class.__module__.startswith("conversion_jobs.api.")
    ):
        return ROUTE_API
    return ROUTE_OTHER


#: The API's middleware chain the loop's answer runs through, as shipped: each hook is
#: in-memory work on the request and response headers, so it may run on the event loop. Any
#: other chain (a middleware added, a setting that makes one redirect or refuse) keeps every
#: submission on the sync path.
LOOP_SAFE_API_MIDDLEWARE = (
    "conversion_jobs.api.middleware.ProblemResponseMiddleware",
    "conversion_jobs.api.problems.DatabaseUnavailableMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
)


def loop_accept_possible() -> bool:
    """Whether a small upload may be accepted on the event loop in this process (ADR 0017
    session 11): on (``QUIRE_ACCEPT_ON_LOOP``), Postgres (the standalone profile's SQLite keeps
    the sync path: its driver has no async form and its writers queue on a file lock), inline
    sources on, the background publisher running (an inline publish would wait for the
    broker's confirm), tracing off (the request's span is the sync path's), and the API's
    middleware chain as shipped, with no setting that makes it redirect or refuse by itself."""
    from conversion_jobs.observability import tracing
    from conversion_jobs.services import publisher

    api_chain = tuple(m for m in settings.MIDDLEWARE if m not in settings.ADMIN_ONLY_MIDDLEWARE)
    return bool(
        settings.QUIRE["ACCEPT_ON_LOOP"]
        and settings.DATABASES["default"]["ENGINE"].endswith("postgresql")
        and settings.QUIRE["INLINE_SOURCE_MAX_BYTES"] > 0
        and publisher.current() is not None
        and not tracing.enabled()
        and api_chain == LOOP_SAFE_API_MIDDLEWARE
        and not settings.SECURE_SSL_REDIRECT
        and not settings.PREPEND_WWW
        and not settings.DISALLOWED_USER_AGENTS
    )


class _LoopAnswerHandler(BaseHandler):
    """The API's middleware chain around an answer made on the event loop: the "view" it
    resolves every request to returns that answer (``request.quire_loop_answer``)."""

    def resolve_request(self, request: HttpRequest) -> Any:
        return _loop_answer, (), {}


def _loop_answer(request: HttpRequest) -> HttpResponseBase:
    answer: HttpResponseBase = request.quire_loop_answer  # type: ignore[attr-defined]
    return answer


def _loop_submission_view(scope: Any) -> Any:
    """The view class whose submissions may be tried on the loop (``submit_on_loop``), for a
    POST to it with no query string and a body no larger than the plain-form split and an
    inline source take; else None (counted ``large`` when the body is what keeps it off the
    loop)."""
    from conversion_jobs.api.uploads import SMALL_BODY_BYTES

    if scope.get("method") != "POST" or scope.get("query_string"):
        return None
    view = _loop_view(get_resolver(), scope.get("path", ""))
    if view is None:
        return None
    # No larger than an inline source: the upload is then never staged to a file (a write to
    # the disk, which must not happen on the loop).
    limit = min(SMALL_BODY_BYTES, settings.QUIRE["INLINE_SOURCE_MAX_BYTES"])
    length = _content_length(scope.get("headers", []))
    if length is None or length > limit:
        _count_handoff("large")
        return None
    return view


@functools.lru_cache(maxsize=4096)
def _loop_view(resolver: Any, path: str) -> tuple[Any, dict[str, Any]] | None:
    """(the view class, its ``as_view`` arguments) when ``path`` resolves to a view with
    ``submit_on_loop``; memoised as ``_route``."""
    try:
        match = resolver.resolve(path)
    except Resolver404:
        return None
    view_class = getattr(match.func, "cls", None)
    if not hasattr(view_class, "submit_on_loop"):
        return None
    return view_class, dict(getattr(match.func, "initkwargs", {}))


def _count_handoff(reason: str) -> None:
    from conversion_jobs.observability import metrics

    metrics.ACCEPT_PATHS.labels(path="thread", reason=reason).inc()


def _load_sync_middleware(handler: BaseHandler, middleware: list[str]) -> None:
    """``handler.load_middleware(is_async=False)`` over ``middleware`` instead of
    ``settings.MIDDLEWARE`` (Django reads the setting; it is swapped for the call, once, while
    the process starts)."""
    whole = settings.MIDDLEWARE
    settings.MIDDLEWARE = middleware
    try:
        handler.load_middleware(is_async=False)
    finally:
        settings.MIDDLEWARE = whole


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
        if _shares is not None:  # the others read this worker's count when they accept
            _shares.update(len(self.server_state.connections))

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
        length = _content_length(self.headers)
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


def _content_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    for name, value in headers:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _chunked(headers: list[tuple[bytes, bytes]]) -> bool:
    return any(n == b"transfer-encoding" and b"chunked" in v.lower() for n, v in headers)


#: A worker holding more than its share of the web's connections leaves a pending connection
#: to the other workers for this long before it accepts it itself (ADR 0017 session 11).
ACCEPT_DEFER_S = _env_float("QUIRE_HTTP_ACCEPT_DEFER_S", 0.005)


class _ConnectionShares:
    """The open connections of each worker process of one gunicorn master, in memory the master
    maps before it forks them (``QuireUvicornWorker.__init__`` runs in the master): one slot
    (pid, count) per worker. A worker writes its own slot; what it reads of the others may be
    a little stale, which only makes it accept a connection it could have left."""

    SLOTS = 64

    def __init__(self) -> None:
        import multiprocessing

        self._pids = multiprocessing.RawArray("i", self.SLOTS)
        self._counts = multiprocessing.RawArray("i", self.SLOTS)
        self._lock = multiprocessing.Lock()
        self._slot = -1

    def claim(self) -> None:
        """This process's slot: a free one or one whose process is gone (after a fork)."""
        pid = os.getpid()
        with self._lock:
            for slot in range(self.SLOTS):
                other = self._pids[slot]
                if other == 0 or other == pid or not _alive(other):
                    self._pids[slot], self._counts[slot], self._slot = pid, 0, slot
                    return

    def update(self, mine: int) -> None:
        """This worker's connections now (a connection closed)."""
        if self._slot >= 0:
            self._counts[self._slot] = mine

    def over_share(self, mine: int) -> bool:
        """Whether this worker holds more than an even share of the connections of the live
        slots (False when it is alone, or has no slot)."""
        if self._slot < 0:
            return False
        self._counts[self._slot] = mine
        workers, total = self._totals()
        return workers > 1 and mine * workers > total

    def others(self) -> int:
        """The connections the other workers hold (as they last wrote them)."""
        return self._totals()[1] - (self._counts[self._slot] if self._slot >= 0 else 0)

    def _totals(self) -> tuple[int, int]:
        workers = total = 0
        for slot in range(self.SLOTS):
            if self._pids[slot]:
                workers += 1
                total += self._counts[slot]
        return workers, total


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _BalancedAccept:
    """Accepts the connections of one listening socket shared by every worker (gunicorn's) with
    an even spread: every worker is woken by a pending connection; one that holds more than its
    share leaves it to the others for ``ACCEPT_DEFER_S``, then takes one, or - the others took
    none in two deferrals - a whole batch (a busy or stuck worker holds a connection back for
    at most two deferrals: work stealing is kept).
    uvloop's own server accepts everything pending at once, so the worker that woke first took
    most of a burst of connects (15 / 1 of 16 kept-alive clients; ADR 0017 session 5
    "Connection balance"). Quacks as the ``asyncio.Server`` uvicorn's shutdown closes."""

    def __init__(self, sock: Any, protocol_factory: Any, shares: _ConnectionShares, live: Any):
        self.sockets = [sock]
        self._sock, self._factory, self._shares, self._live = sock, protocol_factory, shares, live
        self._loop = asyncio.get_running_loop()
        self._closed = asyncio.Event()
        self._deferred: TimerHandle | None = None
        self._starting = 0
        self._others = 0
        self._idle_deferrals = 0
        sock.setblocking(False)
        self._loop.add_reader(sock.fileno(), self._ready)

    def _ready(self, force: int = 0) -> None:
        for _ in range(16):  # a bounded batch per wake-up, as the loop's own accept
            if force > 0:
                force -= 1
            elif self._shares.over_share(len(self._live) + self._starting):
                self._loop.remove_reader(self._sock.fileno())
                self._others = self._shares.others()
                self._deferred = self._loop.call_later(ACCEPT_DEFER_S, self._resume)
                return
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE and the like: the loop's server logs and goes on
                log.warning("accept failed", extra={"error": type(exc).__name__})
                return
            conn.setblocking(False)
            self._starting += 1  # counted until its protocol is in the live set
            task = self._loop.create_task(self._loop.connect_accepted_socket(self._factory, conn))
            task.add_done_callback(self._started)
        self._shares.over_share(len(self._live) + self._starting)

    def _started(self, task: asyncio.Task[Any]) -> None:
        self._starting -= 1
        if not task.cancelled() and task.exception() is not None:
            log.warning("connection setup failed", extra={"error": type(task.exception()).__name__})

    def _resume(self) -> None:
        self._deferred = None
        if self._closed.is_set():
            return
        self._loop.add_reader(self._sock.fileno(), self._ready)
        # Still pending after the deferral: this one takes one, then the share decides again.
        # When the others took none in two deferrals running (busy or stuck, or not scheduled
        # on a loaded host), it takes a whole batch.
        idle = self._shares.others() == self._others
        self._idle_deferrals = self._idle_deferrals + 1 if idle else 0
        if self._idle_deferrals >= 2:
            self._idle_deferrals = 0
            self._ready(force=16)
        else:
            self._ready(force=1)

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        if self._deferred is not None:
            self._deferred.cancel()
        else:
            self._loop.remove_reader(self._sock.fileno())

    async def wait_closed(self) -> None:
        await self._closed.wait()


_shares: _ConnectionShares | None = None


class _BalancedServer(UvicornServer):
    """uvicorn's server with :class:`_BalancedAccept` on gunicorn's sockets instead of the
    loop's own ``create_server``; everything else (state, shutdown) is uvicorn's."""

    async def startup(self, sockets: list[Any] | None = None) -> None:
        await super().startup(sockets=[])
        if not self.started or not sockets or _shares is None:
            return
        config = self.config

        def create_protocol() -> asyncio.Protocol:
            return config.http_protocol_class(  # type: ignore[call-arg]
                config=config, server_state=self.server_state, app_state=self.lifespan.state
            )

        _shares.claim()
        accepts: list[Any] = [  # each quacks as the asyncio.Server uvicorn's shutdown closes
            _BalancedAccept(sock, create_protocol, _shares, self.server_state.connections)
            for sock in sockets
        ]
        self.servers = accepts


class QuireUvicornWorker(UvicornWorker):
    """gunicorn worker: an asyncio event loop (uvloop) per process serving ``project.asgi``
    with :class:`QuireHttpProtocol`. gunicorn still owns the processes (restarts a dead
    worker, graceful reload and shutdown, ``--timeout`` for a stuck event loop);
    ``--keep-alive`` sets the idle connection timeout. The workers spread the connections of
    their shared listening socket evenly (:class:`_BalancedAccept`; ``QUIRE_HTTP_BALANCE=0``:
    uvloop's own accept)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        global _shares
        super().__init__(*args, **kwargs)
        if _shares is None and os.environ.get("QUIRE_HTTP_BALANCE", "1") != "0":
            _shares = _ConnectionShares()  # in the master, before the fork: shared by all

    async def _serve(self) -> None:
        if _shares is None:
            await super()._serve()
            return
        self.config.app = self.wsgi
        server = _BalancedServer(config=self.config)
        self._install_sigquit_handler()
        await server.serve(sockets=self.sockets)
        if not server.started:
            sys.exit(Arbiter.WORKER_BOOT_ERROR)

    CONFIG_KWARGS = {
        "loop": "uvloop",
        "http": "project.web:QuireHttpProtocol",
        "lifespan": "off",
        "server_header": False,
        "access_log": False,
    }
