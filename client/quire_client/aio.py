"""The asynchronous client (httpx.AsyncClient): :class:`AsyncClient` has the calls of
:class:`quire_client.Client`, as coroutines and async iterators, with the same retries and
errors (docs/API_CONTRACT.md)."""

from __future__ import annotations

import asyncio
import builtins
import hashlib
import os
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import httpx_sse

from quire_client import _core, errors
from quire_client._core import API, LONG_POLL_S
from quire_client.models import Job, JobList, Page, Progress


class AsyncClient:
    """An asynchronous Quire client; see :class:`quire_client.Client` for the behaviour of
    each call. ``max_connections`` bounds each pool (each watched job holds one connection
    while its event stream is open). ``lanes`` > 1 gives short requests that many pools of one
    connection each, one request per lane at a time: httpcore scans every connection of a pool
    on each request, so a batch of many concurrent submissions spends less CPU per request on
    lanes than on one shared pool (bench/cli.py). Use ``async with``, or await :meth:`aclose`."""

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        *,
        timeout: float = 30.0,
        retry: _core.RetryPolicy | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        max_connections: int = 100,
        lanes: int = 1,
    ) -> None:
        self.retry = retry or _core.RetryPolicy()
        config: dict[str, Any] = {
            **_core.http_settings(base_url, token, timeout),
            "transport": transport,
            # one TLS context for every pool (loading the CA bundle costs ~30 ms a context)
            "verify": httpx.create_ssl_context(),
            "limits": httpx.Limits(
                max_connections=max_connections, max_keepalive_connections=max_connections
            ),
        }
        # Two pools: short requests, and long-lived event streams and downloads. httpcore
        # scans every connection of a pool for each request, so keeping the held streams out
        # of the submissions' pool keeps a busy batch's CPU per submission down (bench/cli.py).
        self._http = httpx.AsyncClient(**config)
        self._streams = httpx.AsyncClient(**config)
        one = {**config, "limits": httpx.Limits(max_connections=1, max_keepalive_connections=1)}
        self._lane_clients = [httpx.AsyncClient(**one) for _ in range(lanes if lanes > 1 else 0)]
        self._lanes: asyncio.Queue[httpx.AsyncClient] = asyncio.Queue()
        for lane in self._lane_clients:
            self._lanes.put_nowait(lane)
        self._sleep: Callable[[float], Any] = asyncio.sleep

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self._http.aclose()
        await self._streams.aclose()
        for lane in self._lane_clients:
            await lane.aclose()

    async def _request(self, call: _core.Call) -> httpx.Response:
        """One call with retries; see :meth:`quire_client.Client._request`."""
        tries = _core.Tries(self.retry, expect=call.expect)
        while True:
            step = tries.after(await self._attempt(call))
            if isinstance(step, httpx.Response):
                return step
            await self._sleep(step)

    async def _attempt(self, call: _core.Call) -> httpx.Response | httpx.TransportError:
        """One try (on a lane when there are lanes): its answer, or the connection error that
        ended it."""
        try:
            request = self._http.build_request(call.method, call.path, **call.arguments())
            # A multipart body is a stream of small parts, one socket write each; read into one
            # buffer it goes in one write (a submission is in memory already: see submit).
            request.read()
            if not self._lane_clients:
                return await self._http.send(request)
            lane = await self._lanes.get()
            try:
                return await lane.send(request)
            finally:
                self._lanes.put_nowait(lane)
        except _core.TRANSPORT_ERRORS as exc:
            return exc

    async def submit(
        self,
        file: _core.Upload,
        *,
        output: str,
        options: dict[str, Any] | None = None,
        idempotency_key: str | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> Job:
        """Submit a document for conversion; see :meth:`quire_client.Client.submit`. A path
        is read into memory once per try (the sync client streams it)."""

        def part() -> dict[str, Any]:
            name, body, owned = _core.open_upload(file)
            if owned:
                with body:  # type: ignore[union-attr]
                    body = body.read()  # type: ignore[union-attr]
            elif not isinstance(body, bytes):
                body = body.read()
            return {"files": {"file": (name, body, "application/octet-stream")}}

        call = _core.submit_call(
            part, output=output, options=options, metadata=metadata, idempotency_key=idempotency_key
        )
        return _core.job_of(await self._request(call))

    async def get(self, job_id: str) -> Job:
        """The job now; see :meth:`quire_client.Client.get`."""
        return _core.job_of(await self._request(_core.Call("GET", f"{API}/jobs/{job_id}")))

    async def poll(self, job_id: str, *, etag: str | None, wait: float = LONG_POLL_S) -> Job | None:
        """A conditional long-poll; see :meth:`quire_client.Client.poll`."""
        return _core.poll_result(await self._request(_core.poll_call(job_id, etag, wait)))

    async def watch(self, job_id: str) -> AsyncIterator[Progress]:
        """Progress snapshots until terminal, over SSE with long-poll fallback; see
        :meth:`quire_client.Client.watch`."""
        follow = _core.EventFollow(self.retry, job_id)
        while follow.streaming:
            try:
                async with httpx_sse.aconnect_sse(
                    self._streams, "GET", follow.path, **follow.options()
                ) as sse:
                    if sse.response.status_code != 200:
                        await sse.response.aread()
                        await self._pause(follow.after_opening(sse.response))
                        continue
                    async for event in sse.aiter_sse():
                        if (snapshot := follow.snapshot(event)) is not None:
                            yield snapshot
                            if snapshot.terminal:
                                return
            except _core.TRANSPORT_ERRORS as exc:  # an SSEError too: no event stream here
                await self._pause(follow.after_error(exc))
        job = await self.get(job_id)
        yield Progress.of(job)
        while not job.terminal:
            changed = await self.poll(job_id, etag=job.etag)
            if changed is not None:
                job = changed
                yield Progress.of(job)

    async def _pause(self, wait: float | None) -> None:
        """Sleep ``wait`` seconds before connecting again (None: go on at once)."""
        if wait is not None:
            await self._sleep(wait)

    async def wait(
        self,
        job_id: str,
        *,
        timeout: float | None = None,
        on_progress: Callable[[Progress], None] | None = None,
    ) -> Job:
        """Until the job is terminal; see :meth:`quire_client.Client.wait`."""
        deadline = None if timeout is None else time.monotonic() + timeout

        async def follow() -> None:
            async for snapshot in self.watch(job_id):
                if on_progress is not None:
                    on_progress(snapshot)

        if deadline is None:
            await follow()
        else:
            try:
                await asyncio.wait_for(follow(), timeout)
            except TimeoutError as exc:
                raise TimeoutError(f"job not finished within {timeout} s") from exc
        return await self.get(job_id)

    async def list_page(
        self, *, state: str | None = None, cursor: str | None = None, limit: int | None = None
    ) -> JobList:
        """One page of the tenant's jobs; see :meth:`quire_client.Client.list_page`."""
        call = _core.list_call(state=state, cursor=cursor, limit=limit)
        return _core.job_list(await self._request(call))

    async def list(self, *, state: str | None = None, page_size: int = 100) -> AsyncIterator[Job]:
        """Every job of the tenant, newest first, following the cursor."""
        cursor: str | None = None
        while True:
            page = await self.list_page(state=state, cursor=cursor, limit=page_size)
            for job in page.jobs:
                yield job
            if not page.next_cursor:
                return
            cursor = page.next_cursor

    async def cancel(self, job_id: str) -> Job:
        """Cancel the job; see :meth:`quire_client.Client.cancel`."""
        cancel = _core.Call("POST", f"{API}/jobs/{job_id}/cancel", expect=(200, 202))
        return _core.job_of(await self._request(cancel))

    async def pages(self, job_id: str) -> builtins.list[Page]:
        """The job's page checkpoints."""
        call = _core.Call("GET", f"{API}/jobs/{job_id}/pages")
        return _core.page_list(await self._request(call))

    async def capabilities(self) -> dict[str, Any]:
        """What this installation converts, and its limits."""
        return dict((await self._request(_core.Call("GET", f"{API}/capabilities"))).json())

    async def download(
        self, job_id: str, dest: str | os.PathLike[str], *, sha256: str | None = None
    ) -> Path:
        """Download and verify the result; see :meth:`quire_client.Client.download`."""
        return await self._download(f"{API}/jobs/{job_id}/result", Path(dest), sha256)

    async def download_page(
        self, job_id: str, page: int, dest: str | os.PathLike[str], *, sha256: str | None = None
    ) -> Path:
        """Download and verify one page artifact."""
        return await self._download(f"{API}/jobs/{job_id}/pages/{page}", Path(dest), sha256)

    async def _download(self, path: str, dest: Path, sha256: str | None) -> Path:
        download = _core.Download(self.retry, dest)
        while True:
            try:
                digests = await self._stream_to(path, download.part, sha256)
                break
            except BaseException as exc:  # a cancellation too: no .part file is left behind
                if (wait := download.after_failure(exc)) is None:
                    raise
                await self._sleep(wait)
        return download.finish(digests)

    async def _stream_to(self, path: str, part: Path, sha256: str | None) -> tuple[str | None, str]:
        try:
            async with self._streams.stream("GET", path, follow_redirects=True) as response:
                if response.status_code != 200:
                    await response.aread()
                    _core.raise_for_problem(response)
                expected = _core.expected_digest(response, sha256)
                digest = hashlib.sha256()
                with open(part, "wb") as fh:
                    async for chunk in response.aiter_bytes(1 << 16):
                        digest.update(chunk)
                        fh.write(chunk)
        except _core.TRANSPORT_ERRORS as exc:
            raise errors.ConnectionFailed(f"{type(exc).__name__}: {exc}") from exc
        return expected, digest.hexdigest()
