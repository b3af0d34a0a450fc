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
from quire_client._core import API, LONG_POLL_S, RetryPolicy, Upload
from quire_client.models import Job, JobList, Page, Progress


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
        self.retry = retry or RetryPolicy()
        self._http = httpx.Client(
            **_core.http_settings(base_url, token, timeout), transport=transport
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

    def _request(self, call: _core.Call) -> httpx.Response:
        """One call with retries (``_core.Tries`` decides after each try; the call's arguments
        are made afresh for each, so a file body is re-read from its start)."""
        tries = _core.Tries(self.retry, expect=call.expect)
        while True:
            step = tries.after(self._attempt(call))
            if isinstance(step, httpx.Response):
                return step
            self._sleep(step)

    def _attempt(self, call: _core.Call) -> httpx.Response | httpx.TransportError:
        """One try: its answer, or the connection error that ended it (for ``Tries`` to judge)."""
        try:
            return self._http.request(call.method, call.path, **call.arguments())
        except _core.TRANSPORT_ERRORS as exc:
            return exc

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
        opened: list[Any] = []

        def part() -> dict[str, Any]:
            name, body, owned = _core.open_upload(file)
            if owned:
                opened.append(body)  # closed once the call is over, whichever try it ends on
            return {"files": {"file": (name, body, "application/octet-stream")}}

        call = _core.submit_call(
            part, output=output, options=options, metadata=metadata, idempotency_key=idempotency_key
        )
        try:
            response = self._request(call)
        finally:
            for fh in opened:
                fh.close()
        return _core.job_of(response)

    def get(self, job_id: str) -> Job:
        """The job now (``GET /api/v1/jobs/{id}``). Raises
        :class:`~quire_client.errors.NotFound` for an unknown job or one of another tenant."""
        return _core.job_of(self._request(_core.Call("GET", f"{API}/jobs/{job_id}")))

    def poll(self, job_id: str, *, etag: str | None, wait: float = LONG_POLL_S) -> Job | None:
        """A conditional long-poll: the job once its ETag differs from ``etag`` (or at once if
        it already does, or the job is terminal); None when nothing changed within ``wait``
        seconds (304)."""
        return _core.poll_result(self._request(_core.poll_call(job_id, etag, wait)))

    def watch(self, job_id: str) -> Iterator[Progress]:
        """Snapshots of the job's progress (state and page counters) until it is terminal:
        the server's event stream (SSE, ``GET /jobs/{id}/events``), reconnected with
        ``Last-Event-ID`` when it ends early; long-polls when the stream is not available.
        The last snapshot yielded is terminal."""
        follow = _core.EventFollow(self.retry, job_id)
        while follow.streaming:
            try:
                with httpx_sse.connect_sse(
                    self._http, "GET", follow.path, **follow.options()
                ) as sse:
                    if sse.response.status_code != 200:
                        sse.response.read()
                        self._pause(follow.after_opening(sse.response))
                        continue
                    for event in sse.iter_sse():
                        if (snapshot := follow.snapshot(event)) is not None:
                            yield snapshot
                            if snapshot.terminal:
                                return
            except _core.TRANSPORT_ERRORS as exc:  # an SSEError too: no event stream here
                self._pause(follow.after_error(exc))
        yield from self._watch_polling(job_id)

    def _pause(self, wait: float | None) -> None:
        """Sleep ``wait`` seconds before connecting again (None: go on at once)."""
        if wait is not None:
            self._sleep(wait)

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
        return _core.job_list(
            self._request(_core.list_call(state=state, cursor=cursor, limit=limit))
        )

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
        cancel = _core.Call("POST", f"{API}/jobs/{job_id}/cancel", expect=(200, 202))
        return _core.job_of(self._request(cancel))

    def pages(self, job_id: str) -> builtins.list[Page]:
        """The job's page checkpoints (any state)."""
        return _core.page_list(self._request(_core.Call("GET", f"{API}/jobs/{job_id}/pages")))

    def capabilities(self) -> dict[str, Any]:
        """What this installation converts, and its limits (no token needed)."""
        return dict(self._request(_core.Call("GET", f"{API}/capabilities")).json())

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
        download = _core.Download(self.retry, dest)
        while True:
            try:
                digests = self._stream_to(path, download.part, sha256)
                break
            except BaseException as exc:  # an interrupt too: no .part file is left behind
                if (wait := download.after_failure(exc)) is None:
                    raise
                self._sleep(wait)
        return download.finish(digests)

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
