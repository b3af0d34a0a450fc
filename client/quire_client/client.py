"""The synchronous client (httpx). Its async twin is :mod:`quire_client.aio`; both follow the
server's docs/API_CONTRACT.md."""

from __future__ import annotations

import builtins
import hashlib
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import httpx_sse

from quire_client import _core, errors
from quire_client._core import API, RetryPolicy, Upload
from quire_client.models import Job, JobList, Page, Progress

#: seconds a long-poll asks the server to hold the request (the server caps it at 30)
LONG_POLL_S = 25


class Client:
    """A synchronous Quire client.

    ``base_url`` is the server (``http://127.0.0.1:8000``), ``token`` a bearer JWT. Answers
    429 and 503 are retried honouring ``Retry-After`` within ``retry``'s caps; connection
    errors are retried for idempotent calls (every call here: a submit always carries an
    Idempotency-Key). Errors raise subclasses of :class:`quire_client.errors.QuireError`.
    Use as a context manager, or call :meth:`close`.
    """

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        *,
        timeout: float = 30.0,
        retry: RetryPolicy | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        headers = {"User-Agent": _core.USER_AGENT}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self.retry = retry or RetryPolicy()
        self._http = httpx.Client(
            base_url=base_url.rstrip("/"),
            headers=headers,
            timeout=httpx.Timeout(timeout, read=max(timeout, LONG_POLL_S + 15.0)),
            transport=transport,
            follow_redirects=False,
        )
        self._sleep: Callable[[float], None] = time.sleep

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    # -- transport ------------------------------------------------------------------------------

    def _request(
        self,
        method: str,
        path: str,
        *,
        idempotent: bool = True,
        expect: tuple[int, ...] = (200,),
        build: Callable[[], dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> httpx.Response:
        """One call with retries (``_core.Tries``); ``build`` makes fresh request arguments for
        each try (a file body is re-read from its start)."""
        tries = _core.Tries(self.retry, idempotent=idempotent, expect=expect)
        while True:
            try:
                response = self._http.request(
                    method, path, **{**kwargs, **(build() if build else {})}
                )
            except _core.TRANSPORT_ERRORS as exc:
                self._sleep(tries.after_error(exc))
                continue
            wait = tries.after_answer(response)
            if wait is None:
                return response
            self._sleep(wait)

    # -- jobs -----------------------------------------------------------------------------------

    def submit(
        self,
        file: Upload,
        *,
        output: str,
        options: dict[str, Any] | None = None,
        idempotency_key: str | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> Job:
        """Submit a document (a path, bytes or a binary file object) for conversion to
        ``output`` (``text``, ``png``, ``pdf``) with ``options`` (``dpi``, ``pages``,
        ``password``, ``allow_partial``), and the client's own ``metadata`` object (≤ 2 KB of
        JSON, echoed in the job and in its webhook events). Always sends an Idempotency-Key (a
        fresh one unless given), so a retried submit never creates a second job; the same key
        with the same document, output and options returns the original job. Returns the
        accepted job (202) or the existing one (200: a replay, or an identical live or succeeded
        job).

        Raises :class:`~quire_client.errors.UnsupportedMediaType`,
        :class:`~quire_client.errors.InvalidOptions`,
        :class:`~quire_client.errors.IdempotencyKeyReused`, … (API_CONTRACT §2.1)."""
        headers, data = _core.submit_parts(
            output=output, options=options, metadata=metadata, idempotency_key=idempotency_key
        )
        opened: list[Any] = []

        def build() -> dict[str, Any]:
            name, body, owned = _core.open_upload(file)
            if owned:
                opened.append(body)
            return {"files": {"file": (name, body, "application/octet-stream")}, "data": data}

        try:
            response = self._request(
                "POST", f"{API}/jobs", expect=(200, 202), headers=headers, build=build
            )
        finally:
            for fh in opened:
                fh.close()
        return _core.job_of(response)

    def get(self, job_id: str) -> Job:
        """The job now (``GET /api/v1/jobs/{id}``). Raises
        :class:`~quire_client.errors.NotFound` for an unknown job or one of another tenant."""
        return _core.job_of(self._request("GET", f"{API}/jobs/{job_id}"))

    def poll(self, job_id: str, *, etag: str | None, wait: float = LONG_POLL_S) -> Job | None:
        """A conditional long-poll: the job once its ETag differs from ``etag`` (or at once if
        it already does, or the job is terminal); None when nothing changed within ``wait``
        seconds (304)."""
        headers = {"If-None-Match": etag} if etag else {}
        response = self._request(
            "GET",
            f"{API}/jobs/{job_id}",
            params={"wait": str(wait)},
            headers=headers,
            expect=(200, 304),
        )
        if response.status_code == 304:
            return None
        return _core.job_of(response)

    def watch(self, job_id: str) -> Iterator[Progress]:
        """Snapshots of the job's progress (state and page counters) until it is terminal:
        the server's event stream (SSE, ``GET /jobs/{id}/events``), reconnected with
        ``Last-Event-ID`` when it ends early; long-polls when the stream is not available.
        The last snapshot yielded is terminal."""
        follow = _core.EventFollow(self.retry)
        while True:
            try:
                with httpx_sse.connect_sse(
                    self._http,
                    "GET",
                    f"{API}/jobs/{job_id}/events",
                    headers=follow.headers(),
                    timeout=_core.EVENTS_TIMEOUT,
                ) as source:
                    if source.response.status_code in RETRY:
                        source.response.read()
                        self._sleep(follow.after_refusal(source.response))
                        continue
                    if source.response.status_code != 200:
                        source.response.read()
                        _core.raise_for_problem(source.response)
                        break  # a 2xx/3xx that is not a stream: use long-polls
                    for event in source.iter_sse():
                        snapshot = follow.snapshot(event)
                        if snapshot is not None:
                            yield snapshot
                            if snapshot.terminal:
                                return
            except httpx_sse.SSEError:
                break  # not an event stream (an older server, a proxy): long-polls
            except _core.TRANSPORT_ERRORS as exc:
                self._sleep(follow.after_error(exc))
        yield from self._watch_polling(job_id)

    def _watch_polling(self, job_id: str) -> Iterator[Progress]:
        job = self.get(job_id)
        yield Progress.of(job)
        while not job.terminal:
            changed = self.poll(job_id, etag=job.etag)
            if changed is not None:
                job = changed
                yield Progress.of(job)

    def wait(
        self,
        job_id: str,
        *,
        timeout: float | None = None,
        on_progress: Callable[[Progress], None] | None = None,
    ) -> Job:
        """Block until the job is terminal and return it; ``on_progress`` sees every
        snapshot. Raises :class:`TimeoutError` after ``timeout`` seconds (None: no limit)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for snapshot in self.watch(job_id):
            if on_progress is not None:
                on_progress(snapshot)
            if deadline is not None and time.monotonic() > deadline and not snapshot.terminal:
                raise TimeoutError(f"job not finished within {timeout} s")
        return self.get(job_id)

    def list_page(
        self, *, state: str | None = None, cursor: str | None = None, limit: int | None = None
    ) -> JobList:
        """One page of the tenant's jobs, newest first (``GET /api/v1/jobs``)."""
        params = _core.list_params(state=state, cursor=cursor, limit=limit)
        return _core.job_list(self._request("GET", f"{API}/jobs", params=params).json())

    def list(self, *, state: str | None = None, page_size: int = 100) -> Iterator[Job]:
        """Every job of the tenant (optionally in ``state``), newest first, following
        ``next_cursor`` page by page."""
        cursor: str | None = None
        while True:
            page = self.list_page(state=state, cursor=cursor, limit=page_size)
            yield from page.jobs
            if not page.next_cursor:
                return
            cursor = page.next_cursor

    def cancel(self, job_id: str) -> Job:
        """Cancel the job (``POST /jobs/{id}/cancel``): the job is ``cancelled`` or
        ``cancelling`` afterwards. Raises :class:`~quire_client.errors.TooLate` when it had
        already finished."""
        return _core.job_of(self._request("POST", f"{API}/jobs/{job_id}/cancel", expect=(200, 202)))

    def pages(self, job_id: str) -> builtins.list[Page]:
        """The job's page checkpoints (any state)."""
        body = self._request("GET", f"{API}/jobs/{job_id}/pages").json()
        return [Page.from_dict(p) for p in body["pages"]]

    def capabilities(self) -> dict[str, Any]:
        """What this installation converts, and its limits (no token needed)."""
        return dict(self._request("GET", f"{API}/capabilities").json())

    # -- downloads ------------------------------------------------------------------------------

    def download(
        self, job_id: str, dest: str | os.PathLike[str], *, sha256: str | None = None
    ) -> Path:
        """Download the result to ``dest``: streamed to ``<dest>.part``, checked against
        ``sha256`` (the job's ``result.sha256``) or else the answer's ETag (the sha256 of the
        result), then renamed. A mismatch deletes the ``.part`` file and raises
        :class:`~quire_client.errors.DigestMismatch`. Raises
        :class:`~quire_client.errors.NotReady` / :class:`~quire_client.errors.NoResult`."""
        return self._download(f"{API}/jobs/{job_id}/result", Path(dest), sha256)

    def download_page(
        self, job_id: str, page: int, dest: str | os.PathLike[str], *, sha256: str | None = None
    ) -> Path:
        """Download one page artifact to ``dest``, verified like :meth:`download`."""
        return self._download(f"{API}/jobs/{job_id}/pages/{page}", Path(dest), sha256)

    def _download(self, path: str, dest: Path, sha256: str | None) -> Path:
        part = _core.part_path(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        attempt = 0
        while True:
            attempt += 1
            try:
                digest = self._stream_to(path, part, sha256)
                break
            except (errors.ConnectionFailed, errors.ServiceUnavailable, errors.RateLimited):
                part.unlink(missing_ok=True)
                if attempt >= self.retry.connection_attempts:
                    raise
                self._sleep(self.retry.delay(attempt, None))
            except BaseException:
                part.unlink(missing_ok=True)
                raise
        return _core.finish_download(part, dest, digest)

    def _stream_to(self, path: str, part: Path, sha256: str | None) -> tuple[str | None, str]:
        """(expected, actual) digests of the bytes written to ``part``."""
        try:
            with self._http.stream("GET", path, follow_redirects=True) as response:
                if response.status_code != 200:
                    response.read()
                    _core.raise_for_problem(response)
                expected = _core.expected_digest(response, sha256)
                digest = hashlib.sha256()
                with open(part, "wb") as fh:
                    for chunk in response.iter_bytes(1 << 16):
                        digest.update(chunk)
                        fh.write(chunk)
                    fh.flush()
                    os.fsync(fh.fileno())
        except _core.TRANSPORT_ERRORS as exc:
            raise errors.ConnectionFailed(f"{type(exc).__name__}: {exc}") from exc
        return expected, digest.hexdigest()


RETRY = _core.RETRY_STATUSES
