"""The control flow both clients share (client/quire_client/_core.py): a call's retries, the
long-poll's 304, the event stream's reconnects and its long-poll fallback, a submit's retried
upload, and a download's retry and digest check.

Each test runs the sync :class:`Client` and the :class:`AsyncClient` (with one pool, and with
lanes) against the same scripted server, an ``httpx.MockTransport`` that plays the server's side
of the HTTP exchange; the clients' sleeps are recorded instead of slept. The live stack is
tests/e2e/test_client_cli.py."""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from quire_client import AsyncClient, Client, RetryPolicy, errors

URL = "http://quire.test"
JOB_ID = "0b9a6f5e-0000-4000-8000-000000000001"
JOB_PATH = f"/api/v1/jobs/{JOB_ID}"
KINDS = ["sync", "async", "async-lanes"]


class Server:
    """Answers each request with the next scripted answer; an exception in the script is raised
    as that request's connection failure. ``seen`` keeps the requests, bodies read."""

    def __init__(self, *answers: httpx.Response | Exception) -> None:
        self.answers = list(answers)
        self.seen: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        request.read()
        self.seen.append(request)
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


def run(kind: str, server: Server, op: str, *args: Any, **kwargs: Any) -> tuple[Any, list[float]]:
    """Call ``op`` on a client of ``kind`` against ``server``: its result (a list of the
    snapshots for ``watch``) and the waits the client slept, in order."""
    waits: list[float] = []
    transport = httpx.MockTransport(server)
    retry = RetryPolicy(max_attempts=4, connection_attempts=3, backoff_s=0.5, max_wait_s=20.0)
    if kind == "sync":
        with Client(URL, "t", retry=retry, transport=transport) as client:
            client._sleep = waits.append
            result = getattr(client, op)(*args, **kwargs)
            return (list(result) if op == "watch" else result), waits

    async def run_async() -> Any:
        async def sleep(seconds: float) -> None:
            waits.append(seconds)

        lanes = 2 if kind == "async-lanes" else 1
        async with AsyncClient(URL, "t", retry=retry, transport=transport, lanes=lanes) as client:
            client._sleep = sleep
            if op == "watch":
                return [s async for s in client.watch(*args, **kwargs)]
            return await getattr(client, op)(*args, **kwargs)

    return asyncio.run(run_async()), waits


def requested(server: Server) -> list[str]:
    """The requests the server saw, as ``METHOD path``."""
    return [f"{r.method} {r.url.path}" for r in server.seen]


def problem(status: int, code: str, **headers: str) -> httpx.Response:
    body = {"type": f"https://quire.dev/problems/{code}", "title": code, "status": status}
    return httpx.Response(
        status,
        json={**body, "code": code},
        headers={"Content-Type": "application/problem+json", **headers},
    )


def job(state: str, version: int = 1, etag: str = '"v1"', status: int = 200) -> httpx.Response:
    body = {
        "id": JOB_ID,
        "state": state,
        "generation": 1,
        "state_version": version,
        "output": "text",
        "options": {},
        "source": {"media_type": "application/pdf", "size": 9, "sha256": "a" * 64, "page_count": 1},
        "attempts": 1,
        "max_attempts": 3,
        "pages": {"total": 1, "done": int(state == "succeeded"), "failed": 0},
        "error": None,
        "next_attempt_at": None,
        "created_at": "2026-12-03T12:00:00Z",
        "updated_at": "2026-12-03T12:00:01Z",
        "finished_at": None,
        "result": None,
        "links": {
            "self": JOB_PATH,
            "result": f"{JOB_PATH}/result",
            "cancel": f"{JOB_PATH}/cancel",
            "pages": f"{JOB_PATH}/pages",
            "events": f"{JOB_PATH}/events",
        },
    }
    return httpx.Response(status, json=body, headers={"ETag": etag})


def events(*states: tuple[str, str]) -> httpx.Response:
    """An event stream of ``(event id, state)`` snapshots, with a keep-alive comment and an
    event of another kind in between (neither is a snapshot); it ends after the last one."""
    text = ": keep-alive\n\nevent: hello\ndata: {}\n\n"
    for version, (event_id, state) in enumerate(states, 1):
        data = {"id": JOB_ID, "state": state, "state_version": version}
        data["pages"] = {"total": 1, "done": int(state == "succeeded"), "failed": 0}
        text += f"id: {event_id}\nevent: state\ndata: {json.dumps(data)}\n\n"
    return httpx.Response(200, text=text, headers={"Content-Type": "text/event-stream"})


def refused() -> httpx.ConnectError:
    return httpx.ConnectError("connection refused")


# -- a call's retries --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_call__connection_errors_are_retried_then_it_succeeds(kind):
    server = Server(refused(), refused(), httpx.Response(200, json={"conversions": {}}))
    result, waits = run(kind, server, "capabilities")
    assert result == {"conversions": {}}
    assert len(server.seen) == 3
    assert 0.25 <= waits[0] <= 0.5 and 0.5 <= waits[1] <= 1.0  # exponential, with jitter


@pytest.mark.parametrize("kind", KINDS)
def test_call__connection_errors_past_the_tries_raise_connection_failed(kind):
    server = Server(refused(), refused(), refused())
    with pytest.raises(errors.ConnectionFailed, match="ConnectError: connection refused"):
        run(kind, server, "get", JOB_ID)
    assert len(server.seen) == 3


@pytest.mark.parametrize("kind", KINDS)
def test_call__503_with_retry_after_then_an_error_answer_raises_its_type(kind):
    server = Server(
        problem(503, "capacity_exceeded", **{"Retry-After": "4"}), problem(404, "not_found")
    )
    with pytest.raises(errors.NotFound):
        run(kind, server, "cancel", JOB_ID)
    assert requested(server) == ["POST " + JOB_PATH + "/cancel"] * 2


@pytest.mark.parametrize("kind", KINDS)
def test_list_page__asks_for_the_given_filters_only(kind):
    body = {"jobs": [json.loads(job("running").content)], "next_cursor": "c2"}
    server = Server(httpx.Response(200, json=body))
    page, _ = run(kind, server, "list_page", state="running", limit=5)
    assert [j.id for j in page.jobs] == [JOB_ID] and page.next_cursor == "c2"
    assert dict(server.seen[0].url.params) == {"state": "running", "limit": "5"}


@pytest.mark.parametrize("kind", KINDS)
def test_pages__the_checkpoints_of_the_answer(kind):
    checkpoint = {"page": 1, "state": "succeeded", "attempts": 1, "media_type": "image/png"}
    checkpoint |= {"sha256": "b" * 64, "size": 3, "error_code": None}
    checkpoint["links"] = {"self": f"{JOB_PATH}/pages/1"}
    server = Server(httpx.Response(200, json={"pages": [checkpoint]}))
    pages, _ = run(kind, server, "pages", JOB_ID)
    assert [(p.page, p.sha256, p.links.self) for p in pages] == [
        (1, "b" * 64, f"{JOB_PATH}/pages/1")
    ]
    assert requested(server) == ["GET " + JOB_PATH + "/pages"]


# -- long-polls ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_poll__304_is_none_and_asks_with_the_etag(kind):
    server = Server(httpx.Response(304))
    result, _ = run(kind, server, "poll", JOB_ID, etag='"v1"', wait=3)
    assert result is None
    (request,) = server.seen
    assert request.headers["If-None-Match"] == '"v1"'
    assert request.url.params["wait"] == "3"


@pytest.mark.parametrize("kind", KINDS)
def test_poll__a_changed_job_after_a_refusal(kind):
    server = Server(problem(429, "tenant_quota_exceeded", **{"Retry-After": "2"}), job("running"))
    result, waits = run(kind, server, "poll", JOB_ID, etag=None)
    assert result.state == "running" and result.etag == '"v1"'
    assert waits == [2.0]
    assert "If-None-Match" not in server.seen[0].headers
    assert server.seen[0].url.params["wait"] == "25"


# -- event streams ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_watch__reconnects_after_a_refusal_an_early_end_and_a_lost_connection(kind):
    server = Server(
        problem(503, "capacity_exceeded", **{"Retry-After": "2"}),
        events(("e1", "running")),  # ends before the job does
        refused(),
        events(("e2", "succeeded")),
    )
    snapshots, waits = run(kind, server, "watch", JOB_ID)
    assert [s.state for s in snapshots] == ["running", "succeeded"]
    assert snapshots[-1].terminal and snapshots[-1].pages.done == 1
    assert waits[0] == 2.0 and 0.25 <= waits[1] <= 0.5  # the tries count from the last event
    assert len(waits) == 2  # no wait after a stream that ended early
    assert [r.headers.get("Last-Event-ID") for r in server.seen] == [None, None, "e1", "e1"]
    assert all(r.url.path == f"{JOB_PATH}/events" for r in server.seen)
    assert all(r.headers["Accept"] == "text/event-stream" for r in server.seen)


@pytest.mark.parametrize("kind", KINDS)
def test_watch__reads_no_further_than_the_terminal_snapshot(kind):
    server = Server(events(("e1", "running"), ("e2", "failed"), ("e3", "running")))
    snapshots, waits = run(kind, server, "watch", JOB_ID)
    assert [s.state for s in snapshots] == ["running", "failed"]
    assert waits == [] and len(server.seen) == 1


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    ("status", "body"), [(200, {"not": "a stream"}), (204, None)], ids=["200-json", "204"]
)
def test_watch__long_polls_when_the_server_has_no_event_stream(kind, status, body):
    server = Server(
        httpx.Response(status, json=body),  # 200: an older server, a proxy
        job("running"),
        httpx.Response(304),
        job("succeeded", version=2, etag='"v2"'),
    )
    snapshots, waits = run(kind, server, "watch", JOB_ID)
    assert [s.state for s in snapshots] == ["running", "succeeded"]
    assert waits == []
    polls = server.seen[2:]
    assert [r.headers["If-None-Match"] for r in polls] == ['"v1"', '"v1"']
    assert requested(server)[1:] == ["GET " + JOB_PATH] * 3


@pytest.mark.parametrize("kind", KINDS)
def test_watch__an_error_answer_raises_its_typed_error(kind):
    server = Server(problem(404, "not_found"))
    with pytest.raises(errors.NotFound):
        run(kind, server, "watch", JOB_ID)


@pytest.mark.parametrize("kind", KINDS)
def test_watch__refusals_past_the_tries_raise_the_refusal(kind):
    server = Server(*(problem(503, "capacity_exceeded", **{"Retry-After": "1"}) for _ in range(4)))
    with pytest.raises(errors.CapacityExceeded):
        run(kind, server, "watch", JOB_ID)
    assert len(server.seen) == 4


@pytest.mark.parametrize("kind", KINDS)
def test_watch__lost_connections_past_the_tries_raise_connection_failed(kind):
    server = Server(refused(), refused(), refused())
    with pytest.raises(errors.ConnectionFailed):
        run(kind, server, "watch", JOB_ID)
    assert len(server.seen) == 3


# -- submits ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("upload", ["path", "bytes"])
def test_submit__a_retry_sends_the_whole_document_again_with_the_same_key(kind, upload, tmp_path):
    document = b"%PDF-1.7 the document"
    path = tmp_path / "in.pdf"
    path.write_bytes(document)
    refusal = problem(503, "storage_unavailable", **{"Retry-After": "1"})
    server = Server(refusal, job("queued", status=202))
    file = path if upload == "path" else document
    result, waits = run(kind, server, "submit", file, output="text", options={"dpi": 9})
    assert result.state == "queued" and waits == [1.0]
    keys = {r.headers["Idempotency-Key"] for r in server.seen}
    assert len(keys) == 1 and keys.pop().startswith("quire-client-")
    for request in server.seen:
        assert request.method == "POST" and request.url.path == "/api/v1/jobs"
        assert document in request.content
        assert b'name="output"\r\n\r\ntext' in request.content
        assert b'name="options"\r\n\r\n{"dpi":9}' in request.content


# -- downloads ----------------------------------------------------------------------------------


def result_answer(content: bytes) -> httpx.Response:
    etag = f'"{hashlib.sha256(content).hexdigest()}"'
    return httpx.Response(200, content=content, headers={"ETag": etag})


@pytest.mark.parametrize("kind", KINDS)
def test_download__retried_after_a_503_and_a_lost_connection_then_verified(kind, tmp_path):
    content = b"the converted text\n" * 1000
    server = Server(problem(503, "storage_unavailable"), refused(), result_answer(content))
    dest = tmp_path / "out" / "r.txt"
    result, waits = run(kind, server, "download", JOB_ID, dest)
    assert result == dest and dest.read_bytes() == content
    assert not Path(f"{dest}.part").exists()
    assert len(waits) == 2 and len(server.seen) == 3
    assert requested(server) == ["GET " + JOB_PATH + "/result"] * 3


@pytest.mark.parametrize("kind", KINDS)
def test_download__a_digest_mismatch_leaves_nothing_behind(kind, tmp_path):
    server = Server(result_answer(b"bytes"))
    dest = tmp_path / "r.txt"
    with pytest.raises(errors.DigestMismatch):
        run(kind, server, "download", JOB_ID, dest, sha256="0" * 64)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kind", KINDS)
def test_download__a_final_error_is_not_retried_and_leaves_nothing_behind(kind, tmp_path):
    server = Server(problem(409, "not_ready"))
    with pytest.raises(errors.NotReady):
        run(kind, server, "download", JOB_ID, tmp_path / "r.txt")
    assert list(tmp_path.iterdir()) == [] and len(server.seen) == 1


@pytest.mark.parametrize("kind", KINDS)
def test_download__lost_connections_past_the_tries_raise_connection_failed(kind, tmp_path):
    server = Server(refused(), refused(), refused())
    with pytest.raises(errors.ConnectionFailed):
        run(kind, server, "download_page", JOB_ID, 2, tmp_path / "p2.png")
    assert requested(server) == ["GET " + JOB_PATH + "/pages/2"] * 3
    assert list(tmp_path.iterdir()) == []
