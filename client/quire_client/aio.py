"""The asynchronous client (httpx.AsyncClient): :class:`AsyncClient` has the calls of
:class:`quire_client.Client`, as coroutines and async iterators, with the same retries and
errors (docs/API_CONTRACT.md)."""

from __future__ import annotations

import asyncio
import builtins
import hashlib
import json
import os
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import httpx_sse

from quire_client import _core, errors
from quire_client._core import API, RETRY_STATUSES, RetryPolicy, Upload
from quire_client.client import LONG_POLL_S
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
        retry: RetryPolicy | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        max_connections: int = 100,
        lanes: int = 1,
    ) -> None:
        headers = {"User-Agent": _core.USER_AGENT}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self.retry = retry or RetryPolicy()
        config: dict[str, Any] = {
            "base_url": base_url.rstrip("/"),
            "headers": headers,
            "timeout": httpx.Timeout(timeout, read=max(timeout, LONG_POLL_S + 15.0)),
            "transport": transport,
            "follow_redirects": False,
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

    async def _request(
        self,
        method: str,
        path: str,
        *,
        idempotent: bool = True,
        expect: tuple[int, ...] = (200,),
        build: Callable[[], dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> httpx.Response:
        attempt = 0
        while True:
            attempt += 1
            try:
                response = await self._send(method, path, {**kwargs, **(build() if build else {})})
            except _core.TRANSPORT_ERRORS as exc:
                if not idempotent or attempt >= self.retry.connection_attempts:
                    raise errors.ConnectionFailed(f"{type(exc).__name__}: {exc}") from exc
                await self._sleep(self.retry.delay(attempt, None))
                continue
            if response.status_code in RETRY_STATUSES and attempt < self.retry.max_attempts:
                await self._sleep(self.retry.delay(attempt, _core.retry_after_of(response)))
                continue
            if response.status_code in expect:
                return response
            _core.raise_for_problem(response)
            return response

    async def _send(self, method: str, path: str, kwargs: dict[str, Any]) -> httpx.Response:
        request = self._http.build_request(method, path, **kwargs)
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

    async def submit(
        self,
        file: Upload,
        *,
        output: str,
        options: dict[str, Any] | None = None,
        idempotency_key: str | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> Job:
        """Submit a document for conversion; see :meth:`quire_client.Client.submit`. A path
        is read into memory once per try (the sync client streams it)."""
        _core.check_output(output)
        key = idempotency_key or _core.new_idempotency_key()
        data = {"output": output}
        if (encoded := _core.options_json(options)) is not None:
            data["options"] = encoded
        if metadata is not None:
            data["metadata"] = json.dumps(metadata, separators=(",", ":"))

        def build() -> dict[str, Any]:
            name, body, owned = _core.open_upload(file)
            if owned:
                with body:  # type: ignore[union-attr]
                    body = body.read()  # type: ignore[union-attr]
            elif not isinstance(body, bytes):
                body = body.read()
            return {"files": {"file": (name, body, "application/octet-stream")}, "data": data}

        response = await self._request(
            "POST", f"{API}/jobs", expect=(200, 202), headers={"Idempotency-Key": key}, build=build
        )
        return Job.from_dict(response.json(), etag=response.headers.get("ETag"))

    async def get(self, job_id: str) -> Job:
        """The job now; see :meth:`quire_client.Client.get`."""
        response = await self._request("GET", f"{API}/jobs/{job_id}")
        return Job.from_dict(response.json(), etag=response.headers.get("ETag"))

    async def poll(self, job_id: str, *, etag: str | None, wait: float = LONG_POLL_S) -> Job | None:
        """A conditional long-poll; see :meth:`quire_client.Client.poll`."""
        headers = {"If-None-Match": etag} if etag else {}
        response = await self._request(
            "GET",
            f"{API}/jobs/{job_id}",
            params={"wait": str(wait)},
            headers=headers,
            expect=(200, 304),
        )
        if response.status_code == 304:
            return None
        return Job.from_dict(response.json(), etag=response.headers.get("ETag"))

    async def watch(self, job_id: str) -> AsyncIterator[Progress]:
        """Progress snapshots until terminal, over SSE with long-poll fallback; see
        :meth:`quire_client.Client.watch`."""
        last_id: str | None = None
        failures = 0
        while True:
            headers = {"Last-Event-ID": last_id} if last_id else {}
            try:
                async with httpx_sse.aconnect_sse(
                    self._streams,
                    "GET",
                    f"{API}/jobs/{job_id}/events",
                    headers=headers,
                    timeout=httpx.Timeout(30.0, read=120.0),
                ) as source:
                    status = source.response.status_code
                    if status in RETRY_STATUSES:
                        await source.response.aread()
                        failures += 1
                        if failures >= self.retry.max_attempts:
                            _core.raise_for_problem(source.response)
                        await self._sleep(
                            self.retry.delay(failures, _core.retry_after_of(source.response))
                        )
                        continue
                    if status != 200:
                        await source.response.aread()
                        _core.raise_for_problem(source.response)
                        break
                    async for event in source.aiter_sse():
                        if event.event not in ("state", "progress"):
                            continue
                        last_id = event.id or last_id
                        failures = 0
                        snapshot = Progress.from_dict(json.loads(event.data))
                        yield snapshot
                        if snapshot.terminal:
                            return
            except httpx_sse.SSEError:
                break
            except _core.TRANSPORT_ERRORS as exc:
                failures += 1
                if failures >= self.retry.connection_attempts:
                    raise errors.ConnectionFailed(f"{type(exc).__name__}: {exc}") from exc
                await self._sleep(self.retry.delay(failures, None))
        job = await self.get(job_id)
        yield Progress.of(job)
        while not job.terminal:
            changed = await self.poll(job_id, etag=job.etag)
            if changed is not None:
                job = changed
                yield Progress.of(job)

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
        params = {
            k: str(v) for k, v in (("state", state), ("cursor", cursor), ("limit", limit)) if v
        }
        body = (await self._request("GET", f"{API}/jobs", params=params)).json()
        return JobList(
            jobs=[Job.from_dict(j) for j in body["jobs"]], next_cursor=body["next_cursor"]
        )

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
        response = await self._request("POST", f"{API}/jobs/{job_id}/cancel", expect=(200, 202))
        return Job.from_dict(response.json(), etag=response.headers.get("ETag"))

    async def pages(self, job_id: str) -> builtins.list[Page]:
        """The job's page checkpoints."""
        body = (await self._request("GET", f"{API}/jobs/{job_id}/pages")).json()
        return [Page.from_dict(p) for p in body["pages"]]

    async def capabilities(self) -> dict[str, Any]:
        """What this installation converts, and its limits."""
        return dict((await self._request("GET", f"{API}/capabilities")).json())

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
        part = _core.part_path(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        attempt = 0
        while True:
            attempt += 1
            try:
                digests = await self._stream_to(path, part, sha256)
                break
            except (errors.ConnectionFailed, errors.ServiceUnavailable, errors.RateLimited):
                part.unlink(missing_ok=True)
                if attempt >= self.retry.connection_attempts:
                    raise
                await self._sleep(self.retry.delay(attempt, None))
            except BaseException:
                part.unlink(missing_ok=True)
                raise
        return _core.finish_download(part, dest, digests)

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
