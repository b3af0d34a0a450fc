"""The API's lean paths (ADR 0017, session 7) answer exactly as the full ones.

* ``QuireASGIHandler`` runs the API's own views without ``ADMIN_ONLY_MIDDLEWARE``; the admin
  and every other path keep the whole chain.
* ``JobCollectionView.dispatch`` answers the common submission without DRF's ``Request``,
  authenticators, permission classes and content negotiation.

Each request below is sent twice through the web's ASGI application in-process: once as
``main`` had it (the whole middleware chain, DRF's dispatch for every POST) and once as
shipped; status, headers and body must be the same (ids and times aside).
"""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from django.db import connections
from django.urls import get_resolver

from conversion_jobs.api import views
from conversion_jobs.models import ConversionJob
from conversion_jobs.web import handler as web
from tests import multipart, testdocs
from tests.conftest import token

pytestmark = pytest.mark.django_db(transaction=True)

JOBS = "/api/v1/jobs"
UUID = re.compile(rb"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
TIME = re.compile(rb'"\d{4}-\d\d-\d\dT[^"]+"')
ETAG_TIME = re.compile(r'\.\d+"$')


def _asgi(
    app: Any,
    method: str,
    path: str,
    headers: dict[str, str],
    body: bytes = b"",
    *,
    run_on: Callable[[Any], Any] = asyncio.run,
) -> Any:
    """One request through ``app`` in-process: (status, headers, body). ``run_on``: what runs
    the request's coroutine (default a new event loop; a test's own loop's
    ``run_until_complete``)."""
    path, _, query = path.partition("?")
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query.encode(),
        "root_path": "",
        "headers": [
            (b"host", b"testserver"),
            (b"content-length", str(len(body)).encode()),
            *((k.lower().encode(), v.encode()) for k, v in headers.items()),
        ],
        "client": ("127.0.0.1", 1),
        "server": ("testserver", 80),
    }
    sent: list[dict[str, Any]] = []

    async def run() -> None:
        given = False

        async def receive() -> dict[str, Any]:
            nonlocal given
            if not given:
                given = True
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.sleep(3600)
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        await app(scope, receive, send)

    run_on(run())
    start = next(m for m in sent if m["type"] == "http.response.start")
    content = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], [(k.decode(), v.decode()) for k, v in start["headers"]], content


class _Both:
    """The two applications: ``full`` as before session 7, ``lean`` as shipped."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.monkeypatch = monkeypatch
        self.full_handler = web.QuireASGIHandler(lean_api=False)
        self.lean_handler = web.QuireASGIHandler()
        self.drf_dispatches = 0
        drf_dispatch = views.QuireView.dispatch  # APIView.dispatch

        def counted(view: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
            self.drf_dispatches += 1
            return drf_dispatch(view, request, *args, **kwargs)

        monkeypatch.setattr(views.QuireView, "dispatch", counted)

    def full(self, *args: Any, **kwargs: Any) -> Any:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(views, "_lean_submit_applies", lambda view, request: False)
            return _asgi(self.full_handler, *args, **kwargs)

    def lean(self, *args: Any, **kwargs: Any) -> Any:
        return _asgi(self.lean_handler, *args, **kwargs)

    def close(self) -> None:
        for handler in (self.full_handler, self.lean_handler):
            for thread in handler.threads:  # each thread's connection, then the thread
                thread.submit(connections.close_all).result()
                thread.shutdown()


@pytest.fixture
def both(monkeypatch: pytest.MonkeyPatch, no_broker_publish: Any) -> Any:
    apps = _Both(monkeypatch)
    yield apps
    apps.close()


def _normal(answer: Any) -> Any:
    status, headers, body = answer
    body = TIME.sub(b'"<time>"', UUID.sub(b"<id>", body))
    headers = [(k, UUID.sub(b"<id>", v.encode()).decode()) for k, v in headers]
    # the job's ETag ends in its updated_at (representation.py JobStatus.etag), a time as well
    headers = [(k, ETAG_TIME.sub('.<time>"', v) if k == "ETag" else v) for k, v in headers]
    # the content length follows the ids' and times' lengths only through the normalised body
    return status, sorted(headers), body


def _form(*, output: bytes = b"text", salt: str = "", file: bool = True) -> bytes:
    parts = []
    if file:
        salt = salt or uuid.uuid4().hex
        pdf = testdocs.pdf_bytes(pages=1, text_of=lambda n: f"Page {n} {salt}")
        parts.append(multipart.part("file", pdf, filename="doc.pdf"))
    parts.append(multipart.part("output", output))
    return multipart.body(*parts)


def _auth(**kwargs: Any) -> dict[str, str]:
    return {"Authorization": f"Bearer {token(**kwargs)}"}


FORM = {"Content-Type": multipart.CONTENT_TYPE}

#: name -> (extra headers, query, body factory, expected status); each sent to both apps.
CASES: dict[str, tuple[dict[str, str], str, Callable[[], bytes], int]] = {
    "accepted": ({}, "", _form, 202),
    "accept_any": ({"Accept": "*/*"}, "", _form, 202),
    "accept_json": ({"Accept": "application/json"}, "", _form, 202),
    "accept_json_indented": ({"Accept": "application/json; indent=2"}, "", _form, 202),
    "accept_html": ({"Accept": "text/html"}, "", _form, 406),
    "format_query": ({}, "?format=json", _form, 202),
    "bad_output": ({}, "", lambda: _form(output=b"gif"), 400),
    "no_file": ({}, "", lambda: _form(file=False), 400),
    "bad_key": ({"Idempotency-Key": "é"}, "", _form, 400),
    "not_multipart": ({"Content-Type": "application/json"}, "", lambda: b"{}", 400),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_submit__lean_answers_as_drf(both, case):
    extra, query, make_body, status = CASES[case]
    headers = {**_auth(tenant="tenant-full"), **FORM, **extra}
    body = make_body()  # the same document, for two tenants
    full = both.full("POST", JOBS + query, headers, body)
    headers["Authorization"] = _auth(tenant="tenant-lean")["Authorization"]
    lean = both.lean("POST", JOBS + query, headers, body)
    assert full[0] == status, full
    assert _normal(lean) == _normal(full)


def test_submit__lean_path_skips_drf_dispatch_for_the_common_submission(both):
    headers = {**_auth(), **FORM, "Idempotency-Key": "k-1"}
    body = _form()
    first = both.lean("POST", JOBS, headers, body)
    replay = both.lean("POST", JOBS, headers, body)
    assert (first[0], replay[0]) == (202, 200)
    assert ("Idempotent-Replayed", "true") in replay[1]
    assert both.drf_dispatches == 0
    assert ConversionJob.objects.count() == 1


#: A submission's auth failures: (headers, status, problem code).
def _string_exp_auth() -> dict[str, str]:
    """A correctly signed token whose exp is a string (RFC 7519 wants a number)."""
    import jwt
    from django.conf import settings

    claims = {"sub": "x", "tenant": "tenant-a", "scope": "jobs:submit", "exp": str(2**31)}
    return {"Authorization": f"Bearer {jwt.encode(claims, settings.QUIRE['JWT_KEY'])}"}


AUTH_FAILURES = [
    ({}, 401, "not_authenticated"),
    ({"Authorization": "Bearer not-a-token"}, 401, "invalid_token"),
    (_string_exp_auth(), 401, "invalid_token"),
    ({"Authorization": "Basic dXNlcjpwdw=="}, 401, "not_authenticated"),
    (_auth(scopes=("jobs:read",)), 403, "insufficient_scope"),
]


@pytest.mark.parametrize("headers, status, code", AUTH_FAILURES)
def test_submit__auth_failures_are_drfs_answers(both, headers, status, code):
    body = _form()
    full = both.full("POST", JOBS, {**headers, **FORM}, body)
    lean = both.lean("POST", JOBS, {**headers, **FORM}, body)
    assert full[0] == status
    assert json.loads(full[2])["code"] == code
    assert _normal(lean) == _normal(full)
    assert ConversionJob.objects.count() == 0


def test_submit__replay_and_duplicate_answer_as_drf(both):
    for name, app in (("full", both.full), ("lean", both.lean)):
        headers = {**_auth(tenant=f"tenant-{name}"), **FORM, "Idempotency-Key": "same"}
        body = _form(salt="fixed")
        app("POST", JOBS, headers, body)
        replay = app("POST", JOBS, headers, body)
        duplicate = app("POST", JOBS, {**headers, "Idempotency-Key": "other"}, body)
        if name == "full":
            answers = (_normal(replay), _normal(duplicate))
        else:
            assert (_normal(replay), _normal(duplicate)) == answers
    assert replay[0] == 200 and duplicate[0] == 200


def test_submit__errors_after_authentication_answer_as_drf(both, settings_quire):
    """A refusal the lean path answers itself (the quota's 429 with Retry-After, the upload
    limit's 413) is DRF's answer, finalized the same way."""
    for settings_case in ("quota", "size"):
        if settings_case == "quota":
            settings_quire(TENANT_QUOTA=0, MAX_UPLOAD_BYTES=10**8)
        else:
            settings_quire(TENANT_QUOTA=100, MAX_UPLOAD_BYTES=100)
        headers, body = {**_auth(), **FORM}, _form()
        full = both.full("POST", JOBS, headers, body)
        lean = both.lean("POST", JOBS, headers, body)
        assert full[0] == {"quota": 429, "size": 413}[settings_case], full
        assert _normal(lean) == _normal(full)
    assert both.drf_dispatches == 2  # the full ones only
    assert ConversionJob.objects.count() == 0


READS = [JOBS, JOBS + "?limit=2", "/api/v1/capabilities", f"/api/v1/jobs/{uuid.uuid4()}/pages"]


@pytest.mark.parametrize("path", READS)
@pytest.mark.parametrize("cookie", [None, "sessionid=0123456789abcdefghij; csrftoken=" + "a" * 32])
def test_reads__lean_chain_answers_as_the_whole_chain(both, path, cookie):
    headers = {**_auth(), **({"Cookie": cookie} if cookie else {})}
    full = both.full("GET", path, headers)
    lean = both.lean("GET", path, headers)
    assert _normal(lean) == _normal(full)


@pytest.mark.parametrize("path", READS)
def test_reads__api_answers_never_set_the_admins_cookies(both, path):
    """The one difference: the whole chain replaces a malformed CSRF cookie (and deletes an
    invalid session cookie) on any answer; an API answer no longer touches the admin's
    cookies. Everything else is the same."""
    headers = {**_auth(), "Cookie": "sessionid=short; csrftoken=short"}
    full = both.full("GET", path, headers)
    lean = both.lean("GET", path, headers)
    assert any(k == "Set-Cookie" for k, _ in full[1])
    assert not any(k in ("Set-Cookie", "Vary") for k, _ in lean[1])
    cookieless = [(k, v) for k, v in full[1] if k not in ("Set-Cookie", "Vary")]
    assert _normal(lean) == _normal((full[0], cookieless, full[2]))


def test_admin__keeps_sessions_and_csrf(both):
    """The admin keeps the whole chain: its login form sets the CSRF cookie, and a POST
    without the token is refused as a CSRF failure."""
    status, headers, _ = both.lean("GET", "/admin/login/", {})
    assert status == 200
    assert any(k.lower() == "set-cookie" and v.startswith("csrftoken=") for k, v in headers)
    status, headers, body = both.lean(
        "POST",
        "/admin/login/",
        {"Content-Type": "application/x-www-form-urlencoded"},
        b"username=a&password=b",
    )
    assert status == 403
    assert json.loads(body)["code"] == "csrf_failed"


def test_route__api_views_admin_and_waitable_views():
    resolver = get_resolver()
    assert web._route(resolver, JOBS) == web.ROUTE_API
    assert web._route(resolver, "/api/v1/capabilities") == web.ROUTE_API
    assert web._route(resolver, f"/api/v1/jobs/{uuid.uuid4()}/cancel") == web.ROUTE_API
    assert web._route(resolver, f"/api/v1/jobs/{uuid.uuid4()}") == web.ROUTE_ASYNC
    assert web._route(resolver, "/api/v1/schema") == web.ROUTE_OTHER
    assert web._route(resolver, "/admin/login/") == web.ROUTE_OTHER
    assert web._route(resolver, "/nope") == web.ROUTE_OTHER


def test_api_chain__leaves_out_only_the_admins_middleware(settings):
    handler = web.QuireASGIHandler()
    try:
        api = {type(m).__module__ for m in _chain(handler.api_handler)}
        whole = {type(m).__module__ for m in _chain(handler.sync_handler)}
    finally:
        for thread in handler.threads:
            thread.shutdown()
    assert "django.contrib.sessions.middleware" in whole
    assert "django.contrib.sessions.middleware" not in api
    assert "django.middleware.csrf" not in api
    assert {"django.middleware.security", "django.middleware.clickjacking"} <= api
    assert "conversion_jobs.api.middleware" in api and "conversion_jobs.api.problems" in api


def _chain(handler: Any) -> list[Any]:
    """The middleware instances of a loaded sync handler, outermost first (each layer is
    Django's ``convert_exception_to_response`` around one, which it ``wraps``)."""
    found = []
    layer = handler._middleware_chain
    while hasattr(getattr(layer, "__wrapped__", None), "get_response"):
        found.append(layer.__wrapped__)
        layer = layer.__wrapped__.get_response
    return found
