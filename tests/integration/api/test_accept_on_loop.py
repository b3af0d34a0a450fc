"""A small upload accepted on the event loop (ADR 0017 session 11) answers exactly as the sync
path, and every request it cannot fully answer is answered by the sync path.

Each request goes through the web's ASGI application in-process, on one event loop per test:
``thread`` is the handler as before this session (every submission on a sync thread), ``loop``
the handler as ``project.asgi`` builds it. Status, headers and body must be the same (ids and
times aside), and so must the rows written; ``quire_accept_paths`` says who answered.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from types import SimpleNamespace
from typing import Any

import psycopg
import pytest
from django.db import connections

from conversion_jobs import loop_db
from conversion_jobs.models import (
    ConversionJob,
    ConversionOutbox,
    ExecutionAuditEvent,
    IdempotencyRecord,
    InlineSource,
)
from conversion_jobs.observability import metrics
from conversion_jobs.services import publisher, transitions
from conversion_jobs.web import handler as web
from tests import multipart, testdocs
from tests.conftest import token
from tests.integration.api.test_lean_paths import AUTH_FAILURES, _asgi, _normal

# The loop path needs Postgres; the standalone profile keeps the sync path
# (test_accept_on_loop_switch.py).
pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

JOBS = "/api/v1/jobs"
FORM = {"Content-Type": multipart.CONTENT_TYPE}


class _Apps:
    """The two handlers on one event loop, with one recording background publisher."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.published: list[Any] = []
        fake = SimpleNamespace(submit=lambda item: self.published.append(item) or True)
        monkeypatch.setattr(publisher, "current", lambda: fake)
        monkeypatch.setattr(loop_db, "_pool", None)
        self.thread_handler = web.QuireASGIHandler()
        self.loop_handler = web.QuireASGIHandler(accept_on_loop=True)
        assert self.thread_handler.loop_handler is None
        assert self.loop_handler.loop_handler is not None
        self.loop = asyncio.new_event_loop()

    def thread(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(self.thread_handler, *args, **kwargs)

    def on_loop(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(self.loop_handler, *args, **kwargs)

    def _call(
        self, app: Any, method: str, path: str, headers: dict[str, str], body: bytes = b""
    ) -> Any:
        return _asgi(app, method, path, headers, body, run_on=self.loop.run_until_complete)

    def close(self) -> None:
        self.loop.run_until_complete(loop_db.pool().aclose())
        self.loop.close()
        for handler in (self.thread_handler, self.loop_handler):
            for thread in handler.threads:
                thread.submit(connections.close_all).result()
                thread.shutdown()


@pytest.fixture
def apps(monkeypatch: pytest.MonkeyPatch, settings_quire: Any) -> Any:
    from conversion_jobs.services.admission import admission_admit

    # A fresh admission snapshot: a stale one sends the loop's request to the thread (tested
    # on its own below).
    settings_quire(ADMISSION_SNAPSHOT_S=60)
    admission_admit(tenant="tenant-warm")
    both = _Apps(monkeypatch)
    yield both
    both.close()


def paths() -> dict[str, float]:
    """``quire_accept_paths`` by ``path`` or ``thread:<reason>``."""
    counts = {"loop": metrics.ACCEPT_PATHS.labels(path="loop", reason="")._value.get()}
    for reason in metrics.ACCEPT_HANDOFF_REASONS:
        counts[f"thread:{reason}"] = metrics.ACCEPT_PATHS.labels(
            path="thread", reason=reason
        )._value.get()
    return counts


def moved(before: dict[str, float]) -> dict[str, float]:
    return {k: v - before[k] for k, v in paths().items() if v != before[k]}


def _form(*, output: bytes = b"text", salt: str = "", file: bool = True, pages: int = 1) -> bytes:
    parts = []
    if file:
        salt = salt or uuid.uuid4().hex
        pdf = testdocs.pdf_bytes(pages=pages, text_of=lambda n: f"Page {n} {salt} " * 20)
        parts.append(multipart.part("file", pdf, filename="doc.pdf"))
    parts.append(multipart.part("output", output))
    return multipart.body(*parts)


def _auth(**kwargs: Any) -> dict[str, str]:
    return {"Authorization": f"Bearer {token(**kwargs)}"}


def _rows(tenant: str) -> list[Any]:
    """What an acceptance wrote for ``tenant``, without ids and times."""
    job = ConversionJob.objects.get(tenant=tenant)
    skip = {"id", "tenant", "created_at", "updated_at", "queued_at", "audit_head"}
    fields = {
        f.attname: getattr(job, f.attname)
        for f in ConversionJob._meta.concrete_fields
        if f.attname not in skip
    }
    outbox = list(
        ConversionOutbox.objects.filter(job_id=job.id).values_list(
            "generation", "traceparent", "published_at", "publish_attempts"
        )
    )
    audit = list(
        ExecutionAuditEvent.objects.filter(job_id=job.id).values_list(
            "seq", "event_type", "generation", "attempt_id", "details"
        )
    )
    keys = list(IdempotencyRecord.objects.filter(job_id=job.id).values_list("key", "fingerprint"))
    inline = bytes(InlineSource.objects.get(job_id=job.id).content)
    return [fields, outbox, audit, keys, inline]


#: name -> (extra headers, query, body factory, expected status, who answers on the loop app)
CASES: dict[str, tuple[dict[str, str], str, Any, int, str]] = {
    "accepted": ({}, "", _form, 202, "loop"),
    "accept_any": ({"Accept": "*/*"}, "", _form, 202, "loop"),
    "accept_json": ({"Accept": "application/json"}, "", _form, 202, "loop"),
    "with_key": ({"Idempotency-Key": "k-1"}, "", _form, 202, "loop"),
    "accept_indented": ({"Accept": "application/json; indent=2"}, "", _form, 202, "thread:auth"),
    "accept_html": ({"Accept": "text/html"}, "", _form, 406, "thread:auth"),
    "format_query": ({}, "?format=json", _form, 202, ""),
    "bad_output": ({}, "", lambda: _form(output=b"gif"), 400, "thread:checks"),
    "unsupported_output": ({}, "", lambda: _form(output=b"pdf"), 422, "thread:checks"),
    "bad_options": (
        {},
        "",
        lambda: (
            _form()[: -len(f"--{multipart.BOUNDARY}--\r\n")]
            + multipart.body(multipart.part("options", b"["))
        ),
        400,
        "thread:checks",
    ),
    "with_metadata": (
        {},
        "",
        lambda: (
            _form()[: -len(f"--{multipart.BOUNDARY}--\r\n")]
            + multipart.body(multipart.part("metadata", b'{"batch": "b-1", "n": 2}'))
        ),
        202,
        "loop",
    ),
    "bad_metadata": (
        {},
        "",
        lambda: (
            _form()[: -len(f"--{multipart.BOUNDARY}--\r\n")]
            + multipart.body(multipart.part("metadata", b"[1]"))
        ),
        400,
        "thread:checks",
    ),
    "no_file": ({}, "", lambda: _form(file=False), 400, "thread:checks"),
    "bad_key": ({"Idempotency-Key": "é"}, "", _form, 400, "thread:checks"),
    "not_multipart": (
        {"Content-Type": "application/json"},
        "",
        lambda: b"{}",
        400,
        "thread:checks",
    ),
    "not_a_document": (
        {},
        "",
        lambda: multipart.body(
            multipart.part("file", b"hello", filename="a.pdf"), multipart.part("output", b"text")
        ),
        415,
        "thread:checks",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_submit__the_loop_answers_as_the_thread(apps, case):
    extra, query, make_body, status, who = CASES[case]
    body = make_body()  # the same document, for two tenants
    headers = {**_auth(tenant="tenant-thread"), **FORM, **extra}
    before = paths()
    thread = apps.thread("POST", JOBS + query, headers, body)
    assert moved(before) == {}
    headers["Authorization"] = _auth(tenant="tenant-loop")["Authorization"]
    loop = apps.on_loop("POST", JOBS + query, headers, body)
    assert thread[0] == status, thread
    assert _normal(loop) == _normal(thread)
    assert moved(before) == ({who: 1} if who else {})
    if status == 202:
        assert _rows("tenant-loop") == _rows("tenant-thread")
        assert len(apps.published) == 2  # one hand-over to the publisher per path
        job = ConversionJob.objects.get(tenant="tenant-loop")
        outbox = ConversionOutbox.objects.get(job_id=job.id)
        assert (apps.published[1].outbox_id, apps.published[1].job_id) == (outbox.id, job.id)
        assert json.loads(loop[2])["id"] == str(job.id)
        assert ("Location", f"/api/v1/jobs/{job.id}") in loop[1]


def test_submit__a_large_upload_takes_the_thread(apps):
    """Above the inline size the source is stored, on the sync path (staging file, store put)."""
    body = _form(pages=80)
    assert len(body) > 64 * 1024
    headers = {**_auth(tenant="tenant-thread"), **FORM}
    before = paths()
    thread = apps.thread("POST", JOBS, headers, body)
    headers["Authorization"] = _auth(tenant="tenant-loop")["Authorization"]
    loop = apps.on_loop("POST", JOBS, headers, body)
    assert thread[0] == 202
    assert _normal(loop) == _normal(thread)
    assert moved(before) == {"thread:large": 1}
    job = ConversionJob.objects.get(tenant="tenant-loop")
    assert not job.source_key.startswith("inline:")
    assert not InlineSource.objects.filter(job_id=job.id).exists()


def test_submit__an_upload_above_the_inline_size_takes_the_thread(apps, settings_quire):
    settings_quire(INLINE_SOURCE_MAX_BYTES=1000)
    apps.loop_handler = web.QuireASGIHandler(accept_on_loop=True)
    before = paths()
    status, _, _ = apps.on_loop("POST", JOBS, {**_auth(), **FORM}, _form())
    assert status == 202
    assert moved(before) == {"thread:large": 1}
    assert not ConversionJob.objects.get().source_key.startswith("inline:")


@pytest.mark.parametrize("headers, status, code", AUTH_FAILURES)
def test_submit__auth_failures_are_the_threads_answers(apps, headers, status, code):
    body = _form()
    before = paths()
    thread = apps.thread("POST", JOBS, {**headers, **FORM}, body)
    loop = apps.on_loop("POST", JOBS, {**headers, **FORM}, body)
    assert thread[0] == status
    assert json.loads(thread[2])["code"] == code
    assert _normal(loop) == _normal(thread)
    assert moved(before) == {"thread:auth": 1}
    assert ConversionJob.objects.count() == 0


def test_submit__replay_duplicate_and_key_conflict_answer_as_the_thread(apps):
    answers = {}
    before = paths()
    for name, app in (("thread", apps.thread), ("loop", apps.on_loop)):
        headers = {**_auth(tenant=f"tenant-{name}"), **FORM, "Idempotency-Key": "same"}
        body = _form(salt="fixed")
        first = app("POST", JOBS, headers, body)
        replay = app("POST", JOBS, headers, body)
        duplicate = app("POST", JOBS, {**headers, "Idempotency-Key": "other"}, body)
        no_key = app(
            "POST", JOBS, {k: v for k, v in headers.items() if k != "Idempotency-Key"}, body
        )
        conflict = app("POST", JOBS, headers, _form(salt="another"))
        answers[name] = [_normal(a) for a in (first, replay, duplicate, no_key, conflict)]
    assert answers["loop"] == answers["thread"]
    assert [a[0] for a in answers["loop"]] == [202, 200, 200, 200, 422]
    assert json.loads(answers["loop"][4][2])["code"] == "idempotency_key_reused"
    assert ("Idempotent-Replayed", "true") in answers["loop"][1][1]
    # replay and conflict meet the key's binding (the statement aborts), the duplicates the
    # content identity (the statement writes nothing); the answer is read on the request's
    # thread, as the sync path reads it; the conflict's 422 is the sync path's own answer
    assert moved(before) == {"loop": 4, "thread:existing": 1}
    assert ConversionJob.objects.filter(tenant="tenant-loop").count() == 1
    assert IdempotencyRecord.objects.filter(tenant="tenant-loop").count() == 2


@pytest.mark.parametrize(
    "limits, status, code",
    [
        ({"TENANT_QUOTA": 0}, 429, "tenant_quota_exceeded"),
        ({"GLOBAL_CAPACITY": 0}, 503, "capacity_exceeded"),
    ],
)
def test_submit__admission_refusals_are_the_threads_answers(
    apps, settings_quire, limits, status, code
):
    settings_quire(**limits)
    body = _form()
    before = paths()
    thread = apps.thread("POST", JOBS, {**_auth(tenant="tenant-thread"), **FORM}, body)
    loop = apps.on_loop("POST", JOBS, {**_auth(tenant="tenant-loop"), **FORM}, body)
    assert thread[0] == status
    assert json.loads(thread[2])["code"] == code
    assert any(k == "Retry-After" for k, _ in thread[1])
    assert _normal(loop) == _normal(thread)
    assert moved(before) == {"thread:admission": 1}
    assert ConversionJob.objects.count() == 0


def test_submit__a_stale_admission_snapshot_is_refreshed_on_the_requests_thread(apps, monkeypatch):
    """The snapshot is refreshed by a query, which runs on the request's sync thread (Django's
    ORM); the request stays on the loop, and the next one is admitted on the fresh snapshot
    without a hop."""
    import threading

    from conversion_jobs.services import admission

    admission.admission_snapshot_reset()
    refreshed_on: list[str] = []
    counts = admission._Snapshot.counts

    def spied(self: Any, **kwargs: Any) -> Any:
        refreshed_on.append(threading.current_thread().name)
        return counts(self, **kwargs)

    monkeypatch.setattr(admission._Snapshot, "counts", spied)
    before = paths()
    first = apps.on_loop("POST", JOBS, {**_auth(), **FORM}, _form())
    second = apps.on_loop("POST", JOBS, {**_auth(), **FORM}, _form())
    assert (first[0], second[0]) == (202, 202)
    assert moved(before) == {"loop": 2}
    assert len(refreshed_on) == 1 and refreshed_on[0].startswith("quire-sync-")


def test_submit__database_unreachable_from_the_loop_goes_to_the_thread(apps, monkeypatch):
    """The loop's pool cannot connect: the thread answers (here it can: 202), and the pool
    refuses at once for a while instead of waiting out a connect per request."""
    params = loop_db._params

    def unreachable() -> dict[str, Any]:
        return {**params(), "host": "127.0.0.1", "port": 1, "connect_timeout": 2}

    monkeypatch.setattr(loop_db, "_params", unreachable)
    before = paths()
    for _ in range(2):
        status, _, _ = apps.on_loop("POST", JOBS, {**_auth(), **FORM}, _form())
        assert status == 202
    assert moved(before) == {"thread:database": 2}
    assert ConversionJob.objects.count() == 2


def test_submit__database_down_answers_503_with_retry_after_as_the_thread(apps, monkeypatch):
    """Neither the loop nor the thread reaches Postgres: the thread's 503 answers, nothing is
    written, and service resumes when it is back."""
    from django.db import connections as conns

    params = loop_db._params
    monkeypatch.setattr(loop_db, "_params", lambda: {**params(), "host": "127.0.0.1", "port": 1})
    settings_dict = conns["default"].settings_dict
    body = _form()
    before = paths()

    def down(app: Any, tenant: str) -> Any:
        for thread in apps.thread_handler.threads + apps.loop_handler.threads:
            thread.submit(conns.close_all).result()
        monkeypatch.setitem(settings_dict, "PORT", 1)
        monkeypatch.setitem(settings_dict, "HOST", "127.0.0.1")
        try:
            return app("POST", JOBS, {**_auth(tenant=tenant), **FORM}, body)
        finally:
            monkeypatch.undo()
            monkeypatch.setattr(loop_db, "_params", lambda: {**params(), "port": 1})

    thread = down(apps.thread, "tenant-thread")
    loop = down(apps.on_loop, "tenant-loop")
    assert thread[0] == 503, thread
    assert json.loads(thread[2])["code"] == "database_unavailable"
    assert any(k == "Retry-After" for k, _ in thread[1])
    assert _normal(loop) == _normal(thread)
    assert moved(before) == {"thread:database": 1}
    for thread in apps.thread_handler.threads + apps.loop_handler.threads:
        thread.submit(conns.close_all).result()
    assert ConversionJob.objects.count() == 0


def test_submit__connection_lost_mid_statement_loses_and_doubles_nothing(apps, monkeypatch):
    """The statement committed but its answer was lost: the loop cannot know, hands the request
    to the thread, which finds the job by its content identity and answers it (200); one job,
    its outbox row left to the sweep."""
    real = transitions.job_insert_queued_on_loop

    async def committed_then_lost(new: Any, db: Any) -> int | None:
        await real(new, db)
        raise psycopg.OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr(transitions, "job_insert_queued_on_loop", committed_then_lost)
    before = paths()
    status, _, body = apps.on_loop("POST", JOBS, {**_auth(), **FORM}, _form())
    assert status == 200
    assert moved(before) == {"thread:database": 1}
    job = ConversionJob.objects.get()
    assert json.loads(body)["id"] == str(job.id)
    assert ConversionOutbox.objects.filter(job_id=job.id, published_at__isnull=True).count() == 1
    assert apps.published == []  # the sweep publishes it


def test_submit__a_dead_pooled_connection_is_replaced(apps):
    """A pooled connection the server ended (a restart, ``pg_terminate_backend``) is seen by
    its readable socket and replaced before the statement; the request stays on the loop."""
    before = paths()
    assert apps.on_loop("POST", JOBS, {**_auth(), **FORM}, _form())[0] == 202
    ((_, conn),) = loop_db.pool()._idle
    with connections["default"].cursor() as cursor:
        cursor.execute("SELECT pg_terminate_backend(%s)", [conn.info.backend_pid])
    import time

    time.sleep(0.2)
    assert apps.on_loop("POST", JOBS, {**_auth(), **FORM}, _form())[0] == 202
    assert moved(before) == {"loop": 2}
    ((_, fresh),) = loop_db.pool()._idle
    assert fresh is not conn


def test_submit__jwks_token_not_yet_verified_goes_to_the_thread(apps, settings_quire):
    """With an identity provider, a token not in the verified cache may need a key fetch,
    which blocks: the thread checks it (here: 401, as the thread answers)."""
    settings_quire(JWT_JWKS_URL="http://127.0.0.1:1/jwks.json", JWT_ISSUER="i", JWT_AUDIENCE="a")
    before = paths()
    loop = apps.on_loop("POST", JOBS, {**_auth(), **FORM}, _form())
    thread = apps.thread("POST", JOBS, {**_auth(), **FORM}, _form(salt="x"))
    assert _normal(loop)[0] == _normal(thread)[0]
    assert moved(before) == {"thread:auth": 1}


def test_submit__metadata_stored_and_echoed_on_the_loop(apps):
    body = _form()[: -len(f"--{multipart.BOUNDARY}--\r\n")] + multipart.body(
        multipart.part("metadata", b'{"batch": "b-9"}')
    )
    before = paths()
    status, _, answer = apps.on_loop("POST", JOBS, {**_auth(tenant="tenant-meta"), **FORM}, body)[
        :3
    ]
    assert status == 202 and moved(before) == {"loop": 1}
    assert json.loads(answer)["metadata"] == {"batch": "b-9"}
    assert ConversionJob.objects.get(tenant="tenant-meta").metadata == {"batch": "b-9"}
