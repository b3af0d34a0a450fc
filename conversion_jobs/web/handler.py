"""Django's ASGI handler with the sync parts of every request on ``WEB_THREADS`` long-lived
threads per process, downloads streamed a batch at a time, and chunked uploads given their
length (ADR 0016, ADR 0024).

It overrides private methods of ``django.core.handlers.asgi.ASGIHandler`` (pinned in
pyproject.toml; ``tests/unit/test_web_private_apis.py`` fails when an upgrade changes them).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import Executor, Future
from queue import SimpleQueue
from typing import Any

from asgiref.sync import ThreadSensitiveContext, iscoroutinefunction, sync_to_async
from django.conf import settings
from django.core import signals
from django.core.exceptions import RequestAborted
from django.core.handlers.asgi import ASGIHandler, get_script_prefix
from django.core.handlers.base import BaseHandler
from django.db import connection
from django.http import HttpRequest, HttpResponseBase, StreamingHttpResponse
from django.urls import Resolver404, get_resolver, set_script_prefix
from rest_framework.views import APIView

from conversion_jobs.store.db import health_check_by_socket

log = logging.getLogger(__name__)

#: A streamed response body is read this much at a time (more when one chunk is larger): the
#: most of it the web holds per download, and one thread hop per batch.
STREAM_BATCH_BYTES = 256 * 1024


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

    def __init__(self, *, lean_api: bool = True) -> None:
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
        health_check_by_socket(connection)  # no SELECT 1 per request (conversion_jobs/store/db.py)
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
        """Django 5.2's ``ASGIHandler.handle`` with two changes: ``request_started`` (its
        receivers reset the query log and recycle the thread's database connection) is sent
        on the request's thread in the same hop as the view (``get_response_async``), not in a
        hop of its own before the request is built (ADR 0017 addendum); a chunked body gets
        the ``Content-Length`` it had (``_dechunked``)."""
        try:
            body_file = await self.read_body(receive)
        except RequestAborted:
            return
        scope = _dechunked(scope, body_file)
        set_script_prefix(get_script_prefix(scope))
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
