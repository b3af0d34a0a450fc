"""Reading: ETag / If-None-Match, long-poll, list with cursor pagination, capabilities, schema,
health, and the migration check (issue 2)."""

from __future__ import annotations

import io
import threading
import time
import uuid

import pytest
from django.core.management import call_command
from django.db import connections
from django.db.models import F

from conversion_jobs.models import ConversionJob
from tests.integration.api.conftest import problem


@pytest.mark.django_db
def test_get_job__etag_is_state_version_and_if_none_match_is_304(api, make_job):
    job = make_job()
    client = api()
    first = client.get(f"/api/v1/jobs/{job.id}")
    assert first.status_code == 200
    assert first["ETag"] == '"v1"'
    body = first.json()
    assert body["id"] == str(job.id) and body["state_version"] == 1
    assert set(body) >= {
        "id",
        "state",
        "generation",
        "state_version",
        "output",
        "options",
        "source",
        "attempts",
        "max_attempts",
        "pages",
        "error",
        "next_attempt_at",
        "created_at",
        "updated_at",
        "finished_at",
        "links",
    }
    assert body["links"]["self"] == f"/api/v1/jobs/{job.id}"

    same = client.get(f"/api/v1/jobs/{job.id}", HTTP_IF_NONE_MATCH='"v1"')
    assert same.status_code == 304
    assert same["ETag"] == '"v1"'
    assert same.content == b""

    ConversionJob.objects.filter(id=job.id).update(state_version=F("state_version") + 1)
    changed = client.get(f"/api/v1/jobs/{job.id}", HTTP_IF_NONE_MATCH='"v1"')
    assert changed.status_code == 200
    assert changed["ETag"] == '"v2"'
    assert changed.json()["state_version"] == 2


def _bump_later(job_id, delay: float) -> threading.Thread:
    def bump() -> None:
        try:
            time.sleep(delay)
            ConversionJob.objects.filter(id=job_id).update(state_version=F("state_version") + 1)
        finally:
            connections.close_all()

    thread = threading.Thread(target=bump)
    thread.start()
    return thread


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("with_etag", [True, False])
def test_get_job__wait_returns_as_soon_as_state_version_changes(api, make_job, with_etag):
    job = make_job()
    headers = {"HTTP_IF_NONE_MATCH": '"v1"'} if with_etag else {}
    bumper = _bump_later(job.id, 0.5)
    started = time.monotonic()
    response = api().get(f"/api/v1/jobs/{job.id}?wait=2", **headers)
    elapsed = time.monotonic() - started
    bumper.join()
    assert response.status_code == 200
    assert response.json()["state_version"] == 2
    assert response["ETag"] == '"v2"'
    assert 0.4 <= elapsed < 1.5, elapsed


@pytest.mark.django_db(transaction=True)
def test_get_job__wait_times_out_with_304_when_etag_matches(api, make_job):
    job = make_job()
    started = time.monotonic()
    response = api().get(f"/api/v1/jobs/{job.id}?wait=1", HTTP_IF_NONE_MATCH='"v1"')
    elapsed = time.monotonic() - started
    assert response.status_code == 304
    assert 0.9 <= elapsed < 2.0, elapsed


@pytest.mark.django_db(transaction=True)
def test_get_job__wait_times_out_with_200_without_etag(api, make_job):
    job = make_job()
    started = time.monotonic()
    response = api().get(f"/api/v1/jobs/{job.id}?wait=1")
    elapsed = time.monotonic() - started
    assert response.status_code == 200
    assert response.json()["state_version"] == 1
    assert 0.9 <= elapsed < 2.0, elapsed


@pytest.mark.django_db
def test_get_job__stale_etag_with_wait_answers_at_once(api, make_job):
    job = make_job(state_version=5)
    started = time.monotonic()
    response = api().get(f"/api/v1/jobs/{job.id}?wait=5", HTTP_IF_NONE_MATCH='"v3"')
    assert response.status_code == 200
    assert response["ETag"] == '"v5"'
    assert time.monotonic() - started < 1


@pytest.mark.django_db
def test_get_job__bad_wait_is_400(api, make_job):
    problem(api().get(f"/api/v1/jobs/{make_job().id}?wait=soon"), 400, "invalid_request")


@pytest.mark.django_db
def test_list__newest_first_with_cursor_pagination(api, make_job):
    created = [make_job(state="queued" if i % 2 else "succeeded") for i in range(7)]
    newest_first = [str(j.id) for j in reversed(created)]
    client = api()
    seen, cursor, pages = [], None, 0
    while True:
        url = "/api/v1/jobs?limit=3" + (f"&cursor={cursor}" if cursor else "")
        body = client.get(url).json()
        seen += [j["id"] for j in body["jobs"]]
        pages += 1
        cursor = body["next_cursor"]
        if cursor is None:
            break
    assert seen == newest_first
    assert pages == 3


@pytest.mark.django_db
def test_list__ties_on_created_at_are_paged_by_id(api, make_job):
    jobs = [make_job() for _ in range(5)]
    stamp = jobs[0].created_at
    ConversionJob.objects.update(created_at=stamp)
    client = api()
    first = client.get("/api/v1/jobs?limit=2").json()
    second = client.get(f"/api/v1/jobs?limit=10&cursor={first['next_cursor']}").json()
    ids = [j["id"] for j in first["jobs"] + second["jobs"]]
    assert sorted(ids) == sorted(str(j.id) for j in jobs)
    assert len(set(ids)) == 5


@pytest.mark.django_db
def test_list__state_filter(api, make_job):
    queued = [make_job(state="queued") for _ in range(2)]
    make_job(state="failed")
    make_job(state="running")
    body = api().get("/api/v1/jobs?state=queued").json()
    assert sorted(j["id"] for j in body["jobs"]) == sorted(str(j.id) for j in queued)
    assert {j["state"] for j in body["jobs"]} == {"queued"}
    assert body["next_cursor"] is None


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("query", "code"),
    [
        ("state=bogus", "invalid_request"),
        ("limit=0", "invalid_request"),
        ("limit=101", "invalid_request"),
        ("limit=x", "invalid_request"),
        ("cursor=%25%25%25", "invalid_cursor"),
        ("cursor=bm90LWEtY3Vyc29y", "invalid_cursor"),
    ],
)
def test_list__bad_parameters_are_400(api, query, code):
    problem(api().get(f"/api/v1/jobs?{query}"), 400, code)


@pytest.mark.django_db
def test_events__metadata_only_chain(api, pdf_file, no_broker_publish):
    client = api()
    with open(pdf_file(name="Secret Merger Plan.pdf"), "rb") as fh:
        job_id = client.post(
            "/api/v1/jobs", {"file": fh, "output": "text"}, format="multipart"
        ).json()["id"]
    events = client.get(f"/api/v1/jobs/{job_id}/events").json()["events"]
    assert [e["type"] for e in events] == ["accepted"]
    assert events[0]["seq"] == 1 and events[0]["generation"] == 1
    text = str(events)
    assert "Secret" not in text and "tenant-a" not in text and "tester" not in text


@pytest.mark.django_db
def test_capabilities__lists_conversions_and_limits(client, settings_quire):
    settings_quire(MAX_UPLOAD_BYTES=12345)
    response = client.get("/api/v1/capabilities")
    assert response.status_code == 200
    body = response.json()
    assert "text" in body["conversions"]["application/pdf"]
    assert body["limits"]["max_upload_bytes"] == 12345
    assert set(body["outputs"]) == {"text", "png", "pdf"}
    assert body["engines"]["libreoffice"]["warm"] is True  # soffice is installed here


def test_capabilities__says_whether_warm_engines_are_on(client, settings_quire):
    settings_quire(OFFICE_ENGINE="fresh")
    engine = client.get("/api/v1/capabilities").json()["engines"]["libreoffice"]
    assert engine["warm"] is False
    settings_quire(OFFICE_ENGINE="warm", OFFICE_ENGINE_MAX_CONVERSIONS=7)
    engine = client.get("/api/v1/capabilities").json()["engines"]["libreoffice"]
    assert engine == {"warm": True, "max_conversions": 7}


@pytest.mark.django_db
def test_schema__is_openapi_3(client):
    response = client.get("/api/v1/schema?format=json")
    assert response.status_code == 200
    schema = response.json()
    assert schema["openapi"].startswith("3.")
    assert {"/api/v1/jobs", "/api/v1/jobs/{job_id}", "/api/v1/jobs/{job_id}/cancel"} <= set(
        schema["paths"]
    )
    assert client.get("/api/v1/docs").status_code == 200


def test_health__live(client):
    response = client.get("/health/live")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


@pytest.mark.django_db
def test_health__ready_with_database_and_broker_up(client):
    response = client.get("/health/ready")
    assert response.status_code == 200, response.content
    assert response.json()["checks"] == {
        "database": True,
        "migrations": True,
        "broker": True,
        "sandbox": True,
        "sweeps": True,
    }


@pytest.mark.django_db
def test_migrations__makemigrations_check_is_clean():
    out = io.StringIO()
    call_command("makemigrations", check=True, dry_run=True, stdout=out)
    assert "No changes detected" in out.getvalue()


@pytest.mark.django_db
@pytest.mark.parametrize("with_etag", [False, True])
def test_get_job__wait_on_a_terminal_job_answers_at_once(api, make_job, with_etag):
    job = make_job(state="cancelled", state_version=3)
    headers = {"HTTP_IF_NONE_MATCH": '"v3"'} if with_etag else {}
    started = time.monotonic()
    response = api().get(f"/api/v1/jobs/{job.id}?wait=5", **headers)
    assert time.monotonic() - started < 1
    assert response.status_code == (304 if with_etag else 200)
    assert response["ETag"] == '"v3"'


def _stream(response) -> str:
    """The whole event stream (an async iterator: the view is async)."""
    from asgiref.sync import async_to_sync

    async def collect() -> bytes:
        return b"".join([chunk async for chunk in response.streaming_content])

    return async_to_sync(collect)().decode()


@pytest.mark.django_db
def test_events__event_stream_of_a_finished_job_is_one_state_event(api, make_job):
    job = make_job(state="failed", state_version=4, error_code="attempts_exhausted")
    response = api().get(f"/api/v1/jobs/{job.id}/events", HTTP_ACCEPT="text/event-stream")
    assert response.status_code == 200
    assert response["Content-Type"] == "text/event-stream"
    text = _stream(response)
    assert text.startswith("retry: 1000\n\n")
    assert "id: 4..0.0\nevent: state\ndata: " in text
    assert '"state":"failed"' in text
    assert text.count("event:") == 1  # terminal: the stream ends after it


@pytest.mark.django_db
def test_events__resume_with_the_last_id_sends_nothing_for_a_finished_job(api, make_job):
    job = make_job(state="cancelled", state_version=2)
    response = api().get(
        f"/api/v1/jobs/{job.id}/events",
        HTTP_ACCEPT="text/event-stream",
        HTTP_LAST_EVENT_ID="2..0.0",
    )
    assert _stream(response) == "retry: 1000\n\n"


@pytest.mark.django_db
def test_events__format_query_parameter_does_not_start_a_stream(api, make_job):
    job = make_job()
    response = api().get(f"/api/v1/jobs/{job.id}/events?format=sse")
    assert response.status_code in (200, 404)
    assert response["Content-Type"] != "text/event-stream"


@pytest.mark.django_db
def test_events__stream_of_another_tenants_job_is_the_plain_404(api, make_job):
    job = make_job(tenant="tenant-b")
    theirs = api().get(f"/api/v1/jobs/{job.id}/events", HTTP_ACCEPT="text/event-stream")
    missing = api().get(f"/api/v1/jobs/{uuid.uuid4()}/events", HTTP_ACCEPT="text/event-stream")
    problem(theirs, 404, "not_found")
    assert theirs.content == missing.content
    assert theirs["Content-Type"] == "application/problem+json"
