"""The ASGI web tier from outside (issue 11 points 4, 5, 9; issue 10 point 4): the Procfile's
``web`` process on a real socket, real Postgres (LISTEN/NOTIFY), real transitions.

Clients are raw sockets or ``requests``: what the server sends is what is asserted, bytes and
all.
"""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import requests
from django.db import connection

from conversion_jobs.api.auth import token_mint
from conversion_jobs.models import ConversionJob
from conversion_jobs.representation import job_etag_of
from conversion_jobs.services.cancellation import conversion_job_cancel
from tests.e2e import harness

pytestmark = [pytest.mark.e2e, pytest.mark.postgres]

SCOPES = ["jobs:read", "jobs:submit", "jobs:cancel"]


def etag_now(job: Any) -> str:
    """The job's current ETag, from its row now (representation.py)."""
    return job_etag_of(ConversionJob.objects.get(id=job.id))


def token(tenant: str = "tenant-a") -> str:
    return token_mint(tenant=tenant, subject="e2e", scopes=SCOPES, ttl_s=600)


def auth(tenant: str = "tenant-a", **headers: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token(tenant)}", **headers}


@pytest.fixture
def web(start: Callable[..., harness.Proc]) -> Iterator[str]:
    proc = start("web", QUIRE_SSE_HEARTBEAT_S="0.5")
    yield f"http://127.0.0.1:{proc.port}"


def raw_exchange(port: int, data: bytes, *, timeout: float = 5.0) -> bytes:
    """Send ``data``, read until the server closes (or ``timeout``)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        out = b""
        try:
            while chunk := sock.recv(65536):
                out += chunk
        except TimeoutError:
            pass
        return out


def parse_response(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(lines[0].split()[1]), headers, body


def port_of(web: str) -> int:
    return int(web.rsplit(":", 1)[1])


def cancel_later(job_id: uuid.UUID, delay: float, stamp: list[float]) -> threading.Thread:
    """Cancel the (queued) job after ``delay`` through the real service; record when it
    committed."""

    def run() -> None:
        from django.db import connections

        try:
            time.sleep(delay)
            conversion_job_cancel(job_id=job_id, tenant="tenant-a", actor="e2e")
            stamp.append(time.monotonic())
        finally:
            connections.close_all()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


# --- long-polls ----------------------------------------------------------------------------------


@pytest.mark.parametrize("with_etag", [True, False])
def test_long_poll_is_woken_by_the_transition_not_its_deadline(web, submit, with_etag):
    """The transition's NOTIFY wakes the waiter: it answers long before its 20 s deadline (a
    waiter re-reads only when notified while the listener is up). How soon (the contract's
    100 ms; ≈ 10 ms measured) is a benchmark figure (tests/e2e/test_web_load.py prints it,
    bench/latency.py), not a timed assertion that a loaded CI runner would make flaky."""
    job = submit(pages=1)
    headers = auth(**({"If-None-Match": etag_now(job)} if with_etag else {}))
    committed: list[float] = []
    canceller = cancel_later(job.id, 1.0, committed)
    response = requests.get(f"{web}/api/v1/jobs/{job.id}?wait=20", headers=headers, timeout=30)
    answered = time.monotonic()
    canceller.join()
    assert response.status_code == 200
    assert response.json()["state"] == "cancelled"
    assert response.headers["ETag"] == etag_now(job)
    lag = answered - committed[0]
    assert lag < 3.0, f"answered {lag * 1000:.0f} ms after the transition committed"


def test_long_poll_on_a_terminal_job_answers_at_once(web, submit):
    job = submit(pages=1)
    conversion_job_cancel(job_id=job.id, tenant="tenant-a", actor="e2e")
    started = time.monotonic()
    response = requests.get(f"{web}/api/v1/jobs/{job.id}?wait=20", headers=auth(), timeout=30)
    assert response.status_code == 200
    assert response.json()["state"] == "cancelled"
    assert time.monotonic() - started < 5.0  # at once, not at the 20 s deadline
    # ... and with the current ETag: 304 at once, not after 20 s.
    started = time.monotonic()
    again = requests.get(
        f"{web}/api/v1/jobs/{job.id}?wait=20",
        headers=auth(**{"If-None-Match": response.headers["ETag"]}),
        timeout=30,
    )
    assert again.status_code == 304
    assert time.monotonic() - started < 5.0


def test_long_poll_times_out_with_304_and_problem_json_errors(web, submit):
    job = submit(pages=1)
    started = time.monotonic()
    response = requests.get(
        f"{web}/api/v1/jobs/{job.id}?wait=1",
        headers=auth(**{"If-None-Match": etag_now(job)}),
        timeout=30,
    )
    assert response.status_code == 304
    assert 0.9 <= time.monotonic() - started < 3
    bad = requests.get(f"{web}/api/v1/jobs/{job.id}?wait=soon", headers=auth(), timeout=10)
    assert bad.status_code == 400
    assert bad.headers["Content-Type"] == "application/problem+json"
    assert bad.json()["code"] == "invalid_request"
    anonymous = requests.get(f"{web}/api/v1/jobs/{job.id}?wait=5", timeout=10)
    assert anonymous.status_code == 401
    assert anonymous.json()["code"] == "not_authenticated"


def test_another_tenants_job_is_the_same_404_as_a_random_id(web, submit):
    job = submit(pages=1)
    answers = []
    for job_id in (job.id, uuid.uuid4()):
        for suffix, extra in (
            ("?wait=5", {}),
            ("/events", {"Accept": "text/event-stream"}),
            ("/events", {}),
        ):
            started = time.monotonic()
            r = requests.get(
                f"{web}/api/v1/jobs/{job_id}{suffix}", headers=auth("tenant-b", **extra), timeout=10
            )
            assert time.monotonic() - started < 2  # no waiting on somebody else's job
            answers.append((suffix, extra.get("Accept"), r.status_code, r.content))
    mine, random_id = answers[:3], answers[3:]
    assert mine == random_id
    assert all(status == 404 for _, _, status, _ in mine)


def test_the_listener_reconnects_after_its_connection_is_killed(web, submit):
    job = submit(pages=1)
    # One long-poll makes the worker process start its LISTEN connection.
    requests.get(
        f"{web}/api/v1/jobs/{job.id}?wait=0.5",
        headers=auth(**{"If-None-Match": etag_now(job)}),
        timeout=10,
    )

    def listeners() -> int:
        with connection.cursor() as cur:
            cur.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = "
                "'quire-web-listener' AND datname = current_database()"
            )
            return int(cur.fetchone()[0])

    harness.wait_until(lambda: listeners() >= 1, timeout=10, what="a listener")
    with connection.cursor() as cur:
        cur.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = "
            "'quire-web-listener' AND datname = current_database()"
        )
    committed: list[float] = []
    canceller = cancel_later(job.id, 2.0, committed)
    response = requests.get(
        f"{web}/api/v1/jobs/{job.id}?wait=20",
        headers=auth(**{"If-None-Match": etag_now(job)}),
        timeout=30,
    )
    answered = time.monotonic()
    canceller.join()
    assert response.status_code == 200
    assert response.json()["state"] == "cancelled"
    # Woken by the reconnected listener's NOTIFY: polling (every 1.5-2.5 s while it is down)
    # would answer this soon about one time in ten. 250 ms, not the API contract's 100: a wake-up on
    # a 2-core CI runner shared with two other lanes has taken 102 ms (test_web_load measures
    # the 100 ms as a median).
    assert answered - committed[0] < 0.25
    harness.wait_until(lambda: listeners() >= 1, timeout=10, what="the listener back")


# --- Server-Sent Events --------------------------------------------------------------------------


def read_events(response: requests.Response, *, until: Callable[[list[dict[str, Any]]], bool]):
    """Parse an SSE stream into dicts (``comment`` for heartbeats) until ``until`` holds or the
    server ends it."""
    events: list[dict[str, Any]] = []
    current: dict[str, Any] = {}
    for line in response.iter_lines(decode_unicode=True):
        if line == "":
            if current:
                events.append(current)
                current = {}
                if until(events):
                    break
            continue
        if line.startswith(":"):
            current = {"comment": line[1:].strip()}
            continue
        field, _, value = line.partition(":")
        current[field] = value.lstrip()
    return events


def test_event_stream_follows_a_real_job_to_its_end(web, submit, start):
    start("worker")
    job = submit(pages=4)
    with requests.get(
        f"{web}/api/v1/jobs/{job.id}/events",
        headers=auth(Accept="text/event-stream"),
        stream=True,
        timeout=60,
    ) as response:
        assert response.status_code == 200
        assert response.headers["Content-Type"].startswith("text/event-stream")
        assert response.headers["Cache-Control"] == "no-store"
        events = read_events(response, until=lambda ev: False)  # the server ends the stream
    data = [json.loads(e["data"]) for e in events if "data" in e]
    assert data[-1]["state"] == "succeeded"
    assert data[-1]["pages"] == {"total": 4, "done": 4, "failed": 0}
    assert {e["event"] for e in events if "event" in e} <= {"state", "progress"}
    assert [d["state_version"] for d in data] == sorted(d["state_version"] for d in data)
    ids = [e["id"] for e in events if "id" in e]
    assert len(ids) == len(set(ids))
    assert ids[-1] == f"{data[-1]['state_version']}.4.4.0"


def test_event_stream_heartbeat_and_last_event_id_resume(web, submit):
    job = submit(pages=1)
    url = f"{web}/api/v1/jobs/{job.id}/events"
    with requests.get(
        url, headers=auth(Accept="text/event-stream"), stream=True, timeout=30
    ) as response:
        events = read_events(response, until=lambda ev: any("comment" in e for e in ev))
    first = [e for e in events if "id" in e]
    assert len(first) == 1 and first[0]["event"] == "state"
    assert json.loads(first[0]["data"])["state"] == "queued"
    assert events[-1] == {"comment": "heartbeat"}
    # Resuming with the id already seen sends nothing new until the job changes ...
    committed: list[float] = []
    canceller = cancel_later(job.id, 1.0, committed)
    with requests.get(
        url,
        headers=auth(Accept="text/event-stream", **{"Last-Event-ID": first[0]["id"]}),
        stream=True,
        timeout=30,
    ) as response:
        resumed = read_events(response, until=lambda ev: False)
    canceller.join()
    data = [json.loads(e["data"]) for e in resumed if "data" in e]
    # ... and then the change, after which a terminal stream ends by itself.
    assert [d["state"] for d in data] == ["cancelled"]


def test_events_without_event_stream_accept_keep_the_json_audit_answer(web, submit):
    job = submit(pages=1)
    response = requests.get(f"{web}/api/v1/jobs/{job.id}/events", headers=auth(), timeout=10)
    assert response.status_code == 200
    assert response.headers["Content-Type"] == "application/json"
    assert [e["type"] for e in response.json()["events"]] == ["accepted"]


# --- the HTTP server's own answers ---------------------------------------------------------------

SERVER_REFUSALS = [
    ("malformed request line", b"NOT HTTP AT ALL\r\n\r\n", 400, "malformed_request"),
    ("bad header", b"GET /health/live HTTP/1.1\r\nHost x\r\n\r\n", 400, "malformed_request"),
    (
        "oversize URL",
        b"GET /api/v1/jobs?x=" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
        414,
        "uri_too_long",
    ),
    (
        "oversize header",
        b"GET /health/live HTTP/1.1\r\nHost: x\r\nX-Big: " + b"b" * 40000 + b"\r\n\r\n",
        431,
        "request_header_fields_too_large",
    ),
    (
        "many headers",
        b"GET /health/live HTTP/1.1\r\nHost: x\r\n"
        + b"".join(b"X-H%d: %s\r\n" % (i, b"c" * 100) for i in range(400))
        + b"\r\n",
        431,
        "request_header_fields_too_large",
    ),
    (
        "oversize body",
        b"POST /api/v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Length: 10000000000\r\n\r\n",
        413,
        "payload_too_large",
    ),
]


def test_the_servers_own_refusals_are_problem_json(web):
    """Every refusal against one web process (a process per case cost a start each), each on
    its own connection; the failures are reported together, by case."""
    wrong = {}
    for what, raw, status, code in SERVER_REFUSALS:
        got_status, headers, body = parse_response(raw_exchange(port_of(web), raw))
        got = (
            got_status,
            headers.get("content-type"),
            headers.get("connection"),
            json.loads(body).get("code") if got_status == status else None,
            json.loads(body).get("status") if got_status == status else None,
        )
        want = (status, "application/problem+json", "close", code, status)
        if got != want:
            wrong[what] = {"got": got, "want": want}
    assert not wrong, wrong


def exchange_to_eof(port: int, data: bytes, *, timeout: float = 15.0) -> bytes:
    """Send ``data`` in one write, read until the server closes; fails if it has not closed
    within ``timeout``."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        out = b""
        while chunk := sock.recv(65536):  # TimeoutError: the server kept the connection open
            out += chunk
        return out


def split_responses(raw: bytes) -> list[tuple[int, dict[str, str], bytes]]:
    """The responses in ``raw``, in the order they came (each with a ``Content-Length``)."""
    responses = []
    while raw:
        head, blank, rest = raw.partition(b"\r\n\r\n")
        assert blank, f"a cut response head: {raw[:200]!r}"
        status, headers, _ = parse_response(head + blank)
        length = int(headers["content-length"])
        assert len(rest) >= length, f"a cut response body: {raw[:200]!r}"
        responses.append((status, headers, rest[:length]))
        raw = rest[length:]
    return responses


def raw_submission(tenant: str, pdf: bytes, *, extra: bytes = b"") -> bytes:
    """A valid ``POST /api/v1/jobs`` (``Content-Length`` set) and ``extra`` bytes after its
    body."""
    from tests import multipart

    body = multipart.body(
        multipart.part("file", pdf, filename="doc.pdf"), multipart.part("output", b"text")
    )
    head = (
        "POST /api/v1/jobs HTTP/1.1\r\nHost: x\r\n"
        f"Authorization: Bearer {token(tenant)}\r\n"
        f"Content-Type: {multipart.CONTENT_TYPE}\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body + extra


#: case -> (pages of the upload, the bytes after it): one page is stored inline, 80 pages (over
#: 64 KiB) are staged.
PIPELINED_AFTER_A_SUBMISSION = {
    "trailing garbage": (1, b"GARBAGE\x01\r\n\r\n"),
    "trailing garbage after a large upload": (80, b"GARBAGE\x01\r\n\r\n"),
    "a body longer than its Content-Length": (
        1,
        b"--quire-test-boundary--\r\nmore body\r\n\r\n",
    ),
}


def test_a_request_is_answered_before_the_malformed_bytes_after_it_are_refused(web, submit):
    """Issue 22 point 6: the bytes after a request in the same write are the next (pipelined)
    request; when they are not HTTP, the requests before them are answered first, in order,
    and then the connection is refused (400) and closed. Before, the 400 was written and the
    connection closed at once: the 202 of a job that was accepted never reached its client.
    Each case on its own connection, against one web process; failures reported together."""
    wrong: dict[str, Any] = {}
    for what, (pages, extra) in PIPELINED_AFTER_A_SUBMISSION.items():
        tenant = f"pipe-{uuid.uuid4().hex[:12]}"
        try:
            answers = split_responses(
                exchange_to_eof(port_of(web), raw_submission(tenant, _pdf(pages), extra=extra))
            )
        except (TimeoutError, AssertionError, KeyError, ValueError) as exc:
            wrong[what] = repr(exc)
            continue
        statuses = [status for status, _, _ in answers]
        jobs = list(ConversionJob.objects.filter(tenant=tenant).values_list("id", flat=True))
        accepted = json.loads(answers[0][2]).get("id") if statuses[:1] == [202] else None
        refusal = json.loads(answers[1][2]).get("code") if statuses[1:2] == [400] else None
        got = (statuses, [str(j) for j in jobs] == [accepted], refusal)
        if got != ([202, 400], True, "malformed_request"):
            wrong[what] = {"statuses": statuses, "jobs": len(jobs), "refusal": refusal}
    assert not wrong, wrong

    # Two valid requests in one write are answered in order: the job (read on a sync thread)
    # before the liveness answer (on the event loop, at once).
    job = submit(pages=1)
    pair = (
        f"GET /api/v1/jobs/{job.id} HTTP/1.1\r\nHost: x\r\n"
        f"Authorization: Bearer {token()}\r\n\r\n"
        "GET /health/live HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    ).encode()
    answers = split_responses(exchange_to_eof(port_of(web), pair))
    assert [status for status, _, _ in answers] == [200, 200]
    assert json.loads(answers[0][2])["id"] == str(job.id)
    assert answers[1][2] == b'{"status": "ok"}'


def test_chunked_uploads_are_accepted_with_the_same_size_limits(start):
    """Issue 22 point 6: a submission with ``Transfer-Encoding: chunked`` is accepted as the
    same body sent with a ``Content-Length`` (docs/API_CONTRACT.md "Uploads"), from a raw socket
    sending its chunks in separate writes and from httpx streaming a generator; past the
    upload limit it is 413, and past the server's body limit the server refuses it while the
    chunks arrive. Before, every chunked upload was 400 "the file part is required"."""
    import hashlib

    import httpx

    from tests import multipart

    limit = 1024 * 1024  # the server's own body limit is this + 1 MiB
    proc = start("web", QUIRE_MAX_UPLOAD_BYTES=str(limit))
    tenant = f"chunk-{uuid.uuid4().hex[:12]}"
    small, large = _pdf(1), _pdf(1) + b"%" * 300_000

    def form(document: bytes) -> bytes:
        return multipart.body(
            multipart.part("file", document, filename="doc.pdf"), multipart.part("output", b"text")
        )

    head = (
        "POST /api/v1/jobs HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        f"Authorization: Bearer {token(tenant)}\r\nContent-Type: {multipart.CONTENT_TYPE}\r\n"
        "Transfer-Encoding: chunked\r\n\r\n"
    ).encode()

    def raw_chunked(body: bytes, *, size: int) -> tuple[int, dict[str, str], bytes] | None:
        """The answer; None when the server reset the connection while the chunks came."""
        with socket.create_connection(("127.0.0.1", proc.port), timeout=30) as sock:
            out = b""
            try:
                sock.sendall(head)
                for i in range(0, len(body), size):
                    piece = body[i : i + size]
                    sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
                sock.sendall(b"0\r\n\r\n")
                while chunk := sock.recv(65536):
                    out += chunk
            except (BrokenPipeError, ConnectionResetError):
                return None
        return parse_response(out)

    answer = raw_chunked(form(small), size=1000)
    assert answer is not None and answer[0] == 202, answer
    status, _, body = answer
    accepted = json.loads(body)
    job = ConversionJob.objects.get(tenant=tenant)
    assert str(job.id) == accepted["id"]
    assert job.source_sha256 == hashlib.sha256(small).hexdigest()

    def stream(body: bytes) -> Iterator[bytes]:
        for i in range(0, len(body), 64 * 1024):
            yield body[i : i + 64 * 1024]

    def post_streamed(body: bytes) -> httpx.Response:
        return httpx.post(
            f"http://127.0.0.1:{proc.port}/api/v1/jobs",
            headers={**auth(tenant), "Content-Type": multipart.CONTENT_TYPE},
            content=stream(body),  # no length: httpx sends it chunked
            timeout=30,
        )

    streamed = post_streamed(form(large))
    assert streamed.status_code == 202, streamed.text
    assert streamed.request.headers["Transfer-Encoding"] == "chunked"
    job = ConversionJob.objects.get(id=streamed.json()["id"])
    assert job.source_sha256 == hashlib.sha256(large).hexdigest()

    over = post_streamed(form(small + b"%" * limit))
    assert (over.status_code, over.json()["code"]) == (413, "payload_too_large")
    # Refused while the chunks arrive: the 413 is written and the connection closed with the
    # rest of the body unread, which the client's kernel may see as a reset before (or instead
    # of) the answer. Either way never a 202, nor the 400 of a body read to its end.
    answer = raw_chunked(form(b"%" * (3 * limit)), size=64 * 1024)
    if answer is not None:
        status, headers, body = answer
        assert (status, headers["content-type"]) == (413, "application/problem+json"), answer
        assert json.loads(body)["code"] == "payload_too_large"
    assert ConversionJob.objects.filter(tenant=tenant).count() == 2


def test_a_stalled_request_head_is_timed_out_with_408(start):
    proc = start("web", QUIRE_HTTP_HEADER_TIMEOUT_S="1")
    started = time.monotonic()
    raw = raw_exchange(proc.port, b"GET /health/live HTTP/1.1\r\nHost: x\r\n", timeout=10)
    status, headers, body = parse_response(raw)
    assert status == 408
    assert headers["content-type"] == "application/problem+json"
    assert json.loads(body)["code"] == "request_timeout"
    assert 0.9 <= time.monotonic() - started < 5


def test_a_stalled_body_is_timed_out(start):
    proc = start("web", QUIRE_HTTP_BODY_IDLE_TIMEOUT_S="1")
    head = (
        b"POST /api/v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; "
        b"boundary=b\r\nContent-Length: 5000\r\n\r\n--b\r\n"
    )
    started = time.monotonic()
    status, _, body = parse_response(raw_exchange(proc.port, head, timeout=10))
    assert status == 408
    assert json.loads(body)["code"] == "request_timeout"
    assert time.monotonic() - started < 5


# --- keep-alive ----------------------------------------------------------------------------------


def test_a_kept_alive_connection_is_reused_after_a_pause(web):
    request = b"GET /health/live HTTP/1.1\r\nHost: x\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port_of(web)), timeout=10) as sock:
        local = sock.getsockname()
        for pause in (0, 3, 5):
            time.sleep(pause)
            sock.sendall(request)
            raw = b""
            while b'"ok"}' not in raw:
                chunk = sock.recv(4096)
                assert chunk, f"the server closed the connection after a {pause} s pause"
                raw += chunk
            status, headers, _ = parse_response(raw)
            assert status == 200
            assert headers.get("connection") != "close"
            assert sock.getsockname() == local


# --- access log ----------------------------------------------------------------------------------


def test_access_log_has_one_line_per_request_without_secrets(start, submit):
    proc = start("web")
    web = f"http://127.0.0.1:{proc.port}"
    job = submit(pages=1)
    secret_token = token()
    requests.get(
        f"{web}/api/v1/jobs/{job.id}?wait=0&access_token=hunter2-secret&state=q",
        headers={"Authorization": f"Bearer {secret_token}"},
        timeout=10,
    )
    requests.post(
        f"{web}/api/v1/jobs",
        headers={"Authorization": f"Bearer {secret_token}"},
        files={"file": ("my-secret-name.pdf", b"%PDF-1.4 nothing", "application/pdf")},
        data={"output": "text"},
        timeout=10,
    )
    raw_exchange(proc.port, b"BROKEN\r\n\r\n")
    # A line is written when its exchange has ended (after the response's close on the
    # request's thread), so the three may land in any order: wait for all of them.
    harness.wait_until(
        lambda: (
            any(" 400 " in line for line in _access_lines(proc))
            and any(re.search(r"POST /api/v1/jobs \d{3} ", line) for line in _access_lines(proc))
        ),
        timeout=5,
        what="log lines",
    )
    lines = _access_lines(proc)
    assert any(
        f"GET /api/v1/jobs/{job.id}?access_token&state&wait 200 " in line for line in lines
    ), lines
    assert any(re.search(r"POST /api/v1/jobs (202|415) ", line) for line in lines), lines
    assert any(" 400 " in line and "B" in line for line in lines), lines
    for line in lines:
        assert line.split()[-2].endswith("ms") and line.split()[-1].endswith("B"), line
    text = proc.log.read_text(errors="replace")
    for secret in ("hunter2", secret_token, secret_token.split(".")[1], "my-secret-name"):
        assert secret not in text


def _access_lines(proc: harness.Proc) -> list[str]:
    return [
        line for line in proc.log.read_text(errors="replace").splitlines() if "quire.access" in line
    ]


def test_job_detail_without_wait_is_unchanged(web, submit):
    job = submit(pages=1)
    response = requests.get(f"{web}/api/v1/jobs/{job.id}", headers=auth(), timeout=10)
    assert response.status_code == 200
    assert response.headers["ETag"] == etag_now(job)
    again = requests.get(
        f"{web}/api/v1/jobs/{job.id}",
        headers=auth(**{"If-None-Match": response.headers["ETag"]}),
        timeout=10,
    )
    assert again.status_code == 304
    assert ConversionJob.objects.get(id=job.id).state == "queued"


# --- submissions through the real server ---------------------------------------------------------


def _pdf(pages: int) -> bytes:
    from tests import testdocs

    salt = uuid.uuid4().hex
    return testdocs.pdf_bytes(pages=pages, text_of=lambda n: f"Page {n} {salt} " * 20)


def test_submissions_are_accepted_published_replayed_and_refused_through_the_server(start):
    """Against the Procfile's web (two processes): a small upload is accepted (202 + Location,
    stored inline with its rows, the outbox row published by the background publisher), its
    replay and a duplicate answer 200; an upload above the inline size is stored; a bad token
    and a reused key are refused. (Until ADR 0024 a small upload was accepted on the event loop
    and this test counted which path answered; one path answers every submission now.)"""
    from conversion_jobs.models import ConversionOutbox, ExecutionAuditEvent, InlineSource

    proc = start("web", WEB_CONCURRENCY="2")
    base = f"http://127.0.0.1:{proc.port}"

    def post(pdf: bytes, **headers: str) -> requests.Response:
        return requests.post(
            f"{base}/api/v1/jobs",
            headers={**auth(), **headers},
            files={"file": ("doc.pdf", pdf, "application/pdf")},
            data={"output": "text"},
            timeout=30,
        )

    small = _pdf(1)
    key = uuid.uuid4().hex
    accepted = post(small, **{"Idempotency-Key": key})
    assert accepted.status_code == 202, accepted.text
    job_id = accepted.json()["id"]
    assert accepted.headers["Location"] == f"/api/v1/jobs/{job_id}"
    assert accepted.headers["ETag"] == etag_now(ConversionJob.objects.get(id=job_id))
    assert accepted.headers["X-Frame-Options"] == "DENY"
    replay = post(small, **{"Idempotency-Key": key})
    assert (replay.status_code, replay.headers.get("Idempotent-Replayed")) == (200, "true")
    assert replay.json()["id"] == job_id
    duplicate = post(small)
    assert (duplicate.status_code, duplicate.json()["id"]) == (200, job_id)

    job = ConversionJob.objects.get(id=job_id)
    assert job.source_key.startswith("inline:")
    assert bytes(InlineSource.objects.get(job_id=job.id).content) == small
    assert list(
        ExecutionAuditEvent.objects.filter(job_id=job.id).values_list("event_type", flat=True)
    ) == ["accepted"]
    harness.wait_until(
        lambda: ConversionOutbox.objects.filter(job_id=job.id, published_at__isnull=False).exists(),
        timeout=10,
        what="the acceptance published by the background publisher",
    )

    large = _pdf(80)
    assert len(large) > 64 * 1024
    stored = post(large)
    assert stored.status_code == 202, stored.text
    assert not ConversionJob.objects.get(id=stored.json()["id"]).source_key.startswith("inline:")

    bad = post(_pdf(1), Authorization="Bearer not-a-token")
    assert bad.status_code == 401
    assert bad.json()["code"] == "invalid_token"
    assert bad.headers["WWW-Authenticate"] == 'Bearer realm="quire", error="invalid_token"'
    reused = post(_pdf(1), **{"Idempotency-Key": key})
    assert reused.status_code == 422
    assert reused.json()["code"] == "idempotency_key_reused"


# --- the workers share one socket ---------------------------------------------------------------


def _burst(port: int, n: int) -> list[socket.socket]:
    """``n`` clients connecting at once, each answered once (kept open)."""
    socks = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(n)]
    for sock in socks:
        sock.sendall(b"GET /health/live HTTP/1.1\r\nHost: x\r\n\r\n")
    for sock in socks:
        assert sock.recv(1000).startswith(b"HTTP/1.1 200")
    return socks


def test_a_stopped_worker_does_not_hold_connections_back(start):
    """Work stealing: with one of two workers stopped (SIGSTOP, as a worker stuck on the CPU),
    new clients are all answered by the other one at once (both accept on gunicorn's shared
    socket; ADR 0024 removed the balance that spread a burst of connects evenly)."""
    import signal

    proc = start("web", WEB_CONCURRENCY="2")
    harness.wait_until(
        lambda: proc.log.read_text(errors="replace").count("Started server process") >= 2,
        timeout=60,
        what="both workers serving",
    )
    worker = max(pid for pid in proc.tree() if pid != proc.pid)
    os.kill(worker, signal.SIGSTOP)
    try:
        started = time.monotonic()
        socks = _burst(proc.port, 16)
        took = time.monotonic() - started
        for sock in socks:
            sock.close()
    finally:
        os.kill(worker, signal.SIGCONT)
    assert took < 1.0, took
