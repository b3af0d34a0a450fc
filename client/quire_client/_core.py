"""What the sync and the async client share: their httpx settings, the calls' requests, retry
policy and the retry decisions of a call, of an event stream and of a download, ``Retry-After``
parsing, turning an answer into a model or a typed error, the idempotency key, and digest checks.
No network I/O here: each client only sends, sleeps and reads, in its own colour."""

from __future__ import annotations

import email.utils
import hashlib
import json
import os
import random
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

import httpx
import httpx_sse

from quire_client import errors
from quire_client.models import OUTPUTS, Job, JobList, Page, Problem, Progress

API = "/api/v1"
#: statuses retried (honouring Retry-After): too many live jobs, capacity, a store or the
#: database briefly away (docs/API_CONTRACT.md §4)
RETRY_STATUSES = frozenset({429, 503})
#: connection-level failures retried for idempotent calls
TRANSPORT_ERRORS = (httpx.TransportError,)
USER_AGENT = "quire-client/0.1"
#: an event stream's timeouts: the server sends a keep-alive comment well within ``read``
EVENTS_TIMEOUT = httpx.Timeout(30.0, read=120.0)
#: seconds a long-poll asks the server to hold the request (the server caps it at 30)
LONG_POLL_S = 25
#: a download's failures worth another try from the start (any other one is final)
DOWNLOAD_RETRIED = (errors.ConnectionFailed, errors.ServiceUnavailable, errors.RateLimited)
Upload = str | os.PathLike[str] | bytes | IO[bytes]


def http_settings(base_url: str, token: str | None, timeout: float) -> dict[str, Any]:
    """The httpx client settings both clients share: the server, the User-Agent and bearer
    token, reads that outlast a long-poll, and redirects not followed (a download asks for
    them)."""
    headers = {"User-Agent": USER_AGENT}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return {
        "base_url": base_url.rstrip("/"),
        "headers": headers,
        "timeout": httpx.Timeout(timeout, read=max(timeout, LONG_POLL_S + 15.0)),
        "follow_redirects": False,
    }


@dataclass(frozen=True)
class RetryPolicy:
    """How 429 / 503 answers and connection errors are retried.

    ``max_attempts`` bounds the tries of one call (the first included) on 429 / 503;
    ``connection_attempts`` on connection errors (a server that is down is reported soon);
    ``max_wait_s`` caps a single wait, whatever ``Retry-After`` asks; without ``Retry-After``
    the wait is exponential from ``backoff_s`` (with jitter), also capped."""

    max_attempts: int = 8
    max_wait_s: float = 30.0
    backoff_s: float = 0.5
    connection_attempts: int = 4

    def delay(self, attempt: int, retry_after: float | None) -> float:
        """Seconds to wait before try ``attempt + 1`` (``attempt`` counts from 1)."""
        if retry_after is not None:
            return min(max(retry_after, 0.0), self.max_wait_s)
        base = self.backoff_s * (2 ** (attempt - 1))
        return float(min(base * (0.5 + random.random() / 2), self.max_wait_s))  # noqa: S311 - jitter


class Tries:
    """The tries of one call under ``policy``: after each, whether the answer is the call's, an
    error is raised, or the client waits (the seconds returned) and tries again."""

    def __init__(
        self, policy: RetryPolicy, *, idempotent: bool = True, expect: tuple[int, ...] = (200,)
    ) -> None:
        self.policy, self.idempotent, self.expect = policy, idempotent, expect
        self.attempt = 1

    def after(self, outcome: httpx.Response | Exception) -> httpx.Response | float:
        """What follows a try, given its answer or the connection error that ended it: that
        answer when it is the call's, else the seconds to wait before the next try (see
        :meth:`after_answer` and :meth:`after_error` for what raises)."""
        if isinstance(outcome, httpx.Response):
            wait = self.after_answer(outcome)
            return outcome if wait is None else wait
        return self.after_error(outcome)

    def after_error(self, exc: Exception) -> float:
        """A connection error: the wait before the next try; ConnectionFailed when the tries
        are spent or the call may not be repeated."""
        if not self.idempotent or self.attempt >= self.policy.connection_attempts:
            raise errors.ConnectionFailed(f"{type(exc).__name__}: {exc}") from exc
        return self._next(None)

    def after_answer(self, response: httpx.Response) -> float | None:
        """None: ``response`` is the call's answer (a status in ``expect``, or one outside it
        that is no error: 304, 302). A wait: a 429 / 503 with tries left. Any other error
        answer raises its typed error."""
        if response.status_code in RETRY_STATUSES and self.attempt < self.policy.max_attempts:
            return self._next(retry_after_of(response))
        if response.status_code not in self.expect:
            raise_for_problem(response)
        return None

    def _next(self, retry_after: float | None) -> float:
        wait = self.policy.delay(self.attempt, retry_after)
        self.attempt += 1
        return wait


class EventFollow:
    """Following a job's event stream (SSE) under ``policy``: where to connect and the
    ``Last-Event-ID`` to resume from, what an answer that opens no stream means, the snapshot an
    event carries, and the waits after a refusal or a lost connection (the tries count from the
    last event received). ``streaming`` turns False when the server has no event stream to
    give: the client follows the job by long-polls from there."""

    def __init__(self, policy: RetryPolicy, job_id: str) -> None:
        self.policy = policy
        self.path = f"{API}/jobs/{job_id}/events"
        self.last_id: str | None = None
        self.failures = 0
        self.streaming = True

    def options(self) -> dict[str, Any]:
        """The next connection's request arguments, fresh each time (httpx_sse adds its own
        headers to the dict it is given)."""
        return {"headers": self.headers(), "timeout": EVENTS_TIMEOUT}

    def headers(self) -> dict[str, str]:
        return {"Last-Event-ID": self.last_id} if self.last_id else {}

    def after_opening(self, response: httpx.Response) -> float | None:
        """An answer other than 200 to a connection (its body read): the wait before connecting
        again after a 429 / 503; the answer's typed error for any other error status (or when
        the tries are spent); None for a 2xx / 3xx that is no stream (``streaming`` turns
        False: long-polls from here)."""
        if response.status_code in RETRY_STATUSES:
            return self.after_refusal(response)
        raise_for_problem(response)
        self.streaming = False
        return None

    def after_refusal(self, response: httpx.Response) -> float:
        """A 429 / 503 (its body read): the wait before connecting again; its typed error when
        the tries are spent."""
        self.failures += 1
        if self.failures >= self.policy.max_attempts:
            raise_for_problem(response)
        return self.policy.delay(self.failures, retry_after_of(response))

    def after_error(self, exc: Exception) -> float | None:
        """A connection error: the wait before connecting again; ConnectionFailed when the
        tries are spent. None for an answer that is no event stream (an older server, a proxy:
        ``streaming`` turns False, long-polls from here)."""
        if isinstance(exc, httpx_sse.SSEError):
            self.streaming = False
            return None
        self.failures += 1
        if self.failures >= self.policy.connection_attempts:
            raise errors.ConnectionFailed(f"{type(exc).__name__}: {exc}") from exc
        return self.policy.delay(self.failures, None)

    def snapshot(self, event: Any) -> Progress | None:
        """The job's progress an event carries (None: another kind of event)."""
        if event.event not in ("state", "progress"):
            return None
        self.last_id = event.id or self.last_id
        self.failures = 0
        return Progress.from_dict(json.loads(event.data))


class Download:
    """One download to ``dest`` under ``policy``: written to ``part`` (created here with its
    folder's parents), tried again from the start after a lost connection or a 429 / 503, then
    verified and renamed (:meth:`finish`)."""

    def __init__(self, policy: RetryPolicy, dest: Path) -> None:
        self.policy, self.dest = policy, dest
        self.part = part_path(dest)
        self.attempt = 1
        dest.parent.mkdir(parents=True, exist_ok=True)

    def after_failure(self, exc: BaseException) -> float | None:
        """A try that raised ``exc``: its ``.part`` file is deleted (a retry starts afresh, and a
        failed download leaves nothing behind). The wait before the next try; None when ``exc``
        is final (not worth a retry, or the tries are spent): the client re-raises it."""
        self.part.unlink(missing_ok=True)
        if not isinstance(exc, DOWNLOAD_RETRIED) or self.attempt >= self.policy.connection_attempts:
            return None
        wait = self.policy.delay(self.attempt, None)
        self.attempt += 1
        return wait

    def finish(self, digests: tuple[str | None, str]) -> Path:
        """``part`` renamed to ``dest`` once its (expected, actual) digests agree."""
        return finish_download(self.part, self.dest, digests)


@dataclass(slots=True)
class Call:
    """One API call before any I/O: its request (method, path, httpx arguments), the statuses
    that are its answers, and ``build``, which makes arguments afresh for each try (an upload's
    body, re-read from its start)."""

    method: str
    path: str
    args: dict[str, Any] = field(default_factory=dict)
    expect: tuple[int, ...] = (200,)
    build: Callable[[], dict[str, Any]] | None = None

    def arguments(self) -> dict[str, Any]:
        """The next try's httpx arguments (``args`` itself when nothing is built per try)."""
        return self.args if self.build is None else {**self.args, **self.build()}


def submit_call(
    file_part: Callable[[], dict[str, Any]],
    *,
    output: str,
    options: dict[str, Any] | None,
    metadata: dict[str, Any] | None,
    idempotency_key: str | None,
) -> Call:
    """A submit (``POST /api/v1/jobs``): its headers and form fields (see :func:`submit_parts`),
    and ``file_part``, which makes the document's part (``files``) afresh for each try."""
    headers, data = submit_parts(
        output=output, options=options, metadata=metadata, idempotency_key=idempotency_key
    )
    args = {"headers": headers, "data": data}
    return Call("POST", f"{API}/jobs", args, expect=(200, 202), build=file_part)


def poll_call(job_id: str, etag: str | None, wait: float) -> Call:
    """A conditional long-poll of the job (``If-None-Match: etag``, held up to ``wait``
    seconds): 304 is one of its answers (nothing changed)."""
    args = {"params": {"wait": str(wait)}, "headers": {"If-None-Match": etag} if etag else {}}
    return Call("GET", f"{API}/jobs/{job_id}", args, expect=(200, 304))


def poll_result(response: httpx.Response) -> Job | None:
    """A long-poll's job; None when nothing changed (304)."""
    return None if response.status_code == 304 else job_of(response)


def submit_parts(
    *,
    output: str,
    options: dict[str, Any] | None,
    metadata: dict[str, Any] | None,
    idempotency_key: str | None,
) -> tuple[dict[str, str], dict[str, str]]:
    """A submit's headers (its Idempotency-Key: the given one, else a fresh one) and form
    fields but the file; an unknown output is refused before any request."""
    check_output(output)
    data = {"output": output}
    if (encoded := options_json(options)) is not None:
        data["options"] = encoded
    if metadata is not None:
        data["metadata"] = json.dumps(metadata, separators=(",", ":"))
    return {"Idempotency-Key": idempotency_key or new_idempotency_key()}, data


def job_of(response: httpx.Response) -> Job:
    """The job an answer carries, with its ETag."""
    return Job.from_dict(response.json(), etag=response.headers.get("ETag"))


def list_call(*, state: str | None, cursor: str | None, limit: int | None) -> Call:
    """One page of jobs (``GET /api/v1/jobs``)."""
    query = {k: str(v) for k, v in (("state", state), ("cursor", cursor), ("limit", limit)) if v}
    return Call("GET", f"{API}/jobs", {"params": query})


def job_list(response: httpx.Response) -> JobList:
    """The page of jobs an answer carries."""
    body = response.json()
    return JobList(jobs=[Job.from_dict(j) for j in body["jobs"]], next_cursor=body["next_cursor"])


def page_list(response: httpx.Response) -> list[Page]:
    """The page checkpoints an answer carries."""
    return [Page.from_dict(p) for p in response.json()["pages"]]


def parse_retry_after(value: str | None, *, now: datetime | None = None) -> float | None:
    """``Retry-After`` as seconds to wait: delta-seconds or an HTTP date (RFC 9110 §10.2.3);
    None when absent or unreadable; a date in the past is 0."""
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when is None:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - (now or datetime.now(UTC))).total_seconds())


def raise_for_problem(response: httpx.Response) -> None:
    """Raise the typed error of an error answer (its body must have been read)."""
    if response.status_code < 400:
        return
    try:
        body = response.json()
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError):
        body = None
    if not isinstance(body, dict):
        body = {"title": response.reason_phrase, "status": response.status_code}
    problem = Problem.from_dict(body, status=response.status_code)
    retry_after = parse_retry_after(response.headers.get("Retry-After"))
    if retry_after is None and problem.retry_after is not None:
        retry_after = float(problem.retry_after)
    raise errors.error_for(problem, retry_after=retry_after)


def retry_after_of(response: httpx.Response) -> float | None:
    """The wait a 429 / 503 answer asks for (header first, then the problem member)."""
    found = parse_retry_after(response.headers.get("Retry-After"))
    if found is None:
        try:
            member = response.json().get("retry_after")
            found = float(member) if member is not None else None
        except (ValueError, AttributeError, TypeError):
            found = None
    return found


def new_idempotency_key() -> str:
    """A fresh Idempotency-Key, for a submit whose caller names none."""
    return f"quire-client-{uuid.uuid4().hex}"


def options_json(options: dict[str, Any] | None) -> str | None:
    """The ``options`` part, compact and key-sorted (None: no part)."""
    if not options:
        return None
    return json.dumps(options, sort_keys=True, separators=(",", ":"))


def check_output(output: str) -> None:
    """Refuse an unknown output before any request."""
    if output not in OUTPUTS:
        raise ValueError(f"output must be one of {', '.join(OUTPUTS)}")


def open_upload(file: Upload) -> tuple[str, IO[bytes] | bytes, bool]:
    """(file name sent, body, whether the caller must close it). The name is not used by the
    server (types are sniffed) and is sent as ``document``, so no file name leaves here."""
    if isinstance(file, bytes):
        return "document", file, False
    if isinstance(file, str | os.PathLike):
        return "document", open(Path(file), "rb"), True
    if hasattr(file, "seek"):
        file.seek(0)  # a retry re-sends from the start
    return "document", file, False


def etag_digest(value: str | None) -> str | None:
    """The sha256 in an artifact ETag (``"<hex>"``, ``W/`` tolerated), or None."""
    if not value:
        return None
    value = value.strip().removeprefix("W/").strip('"')
    return (
        value.lower()
        if len(value) == 64 and all(c in "0123456789abcdef" for c in value.lower())
        else None
    )


def expected_digest(response: httpx.Response, known: str | None) -> str | None:
    """The digest a download must have: the job's recorded result digest if given, else the
    ETag of the first answer (a presigned redirect carries it; the store's own ETag is not a
    sha256)."""
    if known:
        return known.lower()
    first = response.history[0] if response.history else response
    return etag_digest(first.headers.get("ETag"))


def sha256_file(path: Path) -> str:
    """The file's sha256 (hex)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def part_path(dest: Path) -> Path:
    """Where a download is written before it is verified and renamed."""
    return dest.with_name(dest.name + ".part")


def finish_download(part: Path, dest: Path, digests: tuple[str | None, str]) -> Path:
    """Rename a verified ``.part`` to ``dest``; delete it and raise when its digest is not
    the announced one (or none was announced)."""
    expected, actual = digests
    if expected is None or expected != actual:
        part.unlink(missing_ok=True)
        raise errors.DigestMismatch(
            f"downloaded sha256 {actual} != announced {expected or '(none)'}"
        )
    os.replace(part, dest)
    return dest
