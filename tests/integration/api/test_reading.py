"""Reading: ETag / If-None-Match, long-poll, list with cursor pagination, capabilities, schema,
health, and the migration check (issue 2)."""

from __future__ import annotations

import io
import threading
import time
import uuid
from datetime import timedelta

import pytest
from django.core.management import call_command
from django.db import connections
from django.db.models import F
from django.db.models.functions import Now
from django.utils import timezone

from conversion_jobs.models import ConversionJob
from tests.integration.api.conftest import problem


def _get(client, job, **headers):
    return client.get(f"/api/v1/jobs/{job.id}", **headers)


def _current(client, job) -> tuple[str, dict]:
    """The ETag and body of the job's representation now (an unconditional GET)."""
    response = _get(client, job)
    assert response.status_code == 200
    return response["ETag"], response.json()


@pytest.mark.django_db
def test_get_job__etag_names_the_representation_and_if_none_match_is_304(api, make_job):
    job = make_job()
    client = api()
    first = _get(client, job)
    assert first.status_code == 200
    etag = first["ETag"]
    assert etag.startswith('"v1.') and etag.endswith('"')  # a strong validator
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
    assert _get(client, job)["ETag"] == etag  # nothing changed: the same validator

    for header in (etag, f"W/{etag}", f'"other", {etag}'):  # weak comparison, a list
        same = _get(client, job, HTTP_IF_NONE_MATCH=header)
        assert same.status_code == 304, header
        assert same["ETag"] == etag
        assert same.content == b""
    for header in ('"v1"', "*", "garbage", '"other"'):  # the old form, anything else: 200
        assert _get(client, job, HTTP_IF_NONE_MATCH=header).status_code == 200, header

    ConversionJob.objects.filter(id=job.id).update(state_version=F("state_version") + 1)
    changed = _get(client, job, HTTP_IF_NONE_MATCH=etag)
    assert changed.status_code == 200
    assert changed["ETag"] != etag and changed["ETag"].startswith('"v2.')
    assert changed.json()["state_version"] == 2


#: Writes that change the body without a transition (no state_version bump), each as the code
#: does it (services/checkpoints.py, services/execution.py, services/retention.py), and the
#: bare column changes (no updated_at) a hand-written UPDATE might make.
BODY_WRITES = {
    "page done": {"pages_done": F("pages_done") + 1, "updated_at": Now()},
    "page failed": {"pages_failed": F("pages_failed") + 1, "updated_at": Now()},
    "page total known": {"source_page_count": 50, "updated_at": Now()},
    "bare pages_done": {"pages_done": F("pages_done") + 1},
    "bare pages_failed": {"pages_failed": F("pages_failed") + 1},
    "updated_at only": {"updated_at": Now()},
}


@pytest.mark.django_db(transaction=True)  # each write its own transaction: its own now()
@pytest.mark.parametrize("write", sorted(BODY_WRITES))
def test_get_job__every_change_of_the_body_changes_the_etag(api, make_job, write):
    """Issue 22 point 4 (RFC 9110 §8.8.3): a 304 only ever names the body last seen."""
    job = make_job(state="running", source_page_count=None)
    client = api()
    etag, body = _current(client, job)
    time.sleep(0.002)  # updated_at moves on even at coarse clocks
    ConversionJob.objects.filter(id=job.id).update(**BODY_WRITES[write])
    answer = _get(client, job, HTTP_IF_NONE_MATCH=etag)
    assert answer.status_code == 200, write
    assert answer.json() != body and answer.json()["state_version"] == body["state_version"]
    assert answer["ETag"] != etag
    assert _get(client, job, HTTP_IF_NONE_MATCH=answer["ETag"]).status_code == 304


@pytest.mark.django_db
def test_get_job__expiry_changes_the_etag(api, make_job):
    job = make_job(state="succeeded")
    client = api()
    etag, body = _current(client, job)
    assert body["result"] is not None
    ConversionJob.objects.filter(id=job.id).update(
        expired_at=Now(), updated_at=timezone.now() + timedelta(seconds=1)
    )
    answer = _get(client, job, HTTP_IF_NONE_MATCH=etag)
    assert answer.status_code == 200 and answer.json()["result"] is None
    assert answer["ETag"] != etag


@pytest.mark.django_db
def test_get_job__the_etag_of_a_submission_is_the_etag_of_its_read(
    api, pdf_file, no_broker_publish
):
    client = api()
    with open(pdf_file(), "rb") as fh:
        accepted = client.post("/api/v1/jobs", {"file": fh, "output": "text"}, format="multipart")
    assert accepted.status_code == 202
    read = client.get(accepted["Location"], HTTP_IF_NONE_MATCH=accepted["ETag"])
    assert read.status_code == 304 and read["ETag"] == accepted["ETag"]


def _later(job_id, delay: float, **write) -> threading.Thread:
    def change() -> None:
        try:
            time.sleep(delay)
            ConversionJob.objects.filter(id=job_id).update(**write)
        finally:
            connections.close_all()

    thread = threading.Thread(target=change)
    thread.start()
    return thread


def _bump_later(job_id, delay: float) -> threading.Thread:
    return _later(job_id, delay, state_version=F("state_version") + 1, updated_at=Now())


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("with_etag", [True, False])
def test_get_job__wait_returns_as_soon_as_state_version_changes(api, make_job, with_etag):
    job = make_job()
    client = api()
    etag, _ = _current(client, job)
    headers = {"HTTP_IF_NONE_MATCH": etag} if with_etag else {}
    bumper = _bump_later(job.id, 0.5)
    started = time.monotonic()
    response = client.get(f"/api/v1/jobs/{job.id}?wait=2", **headers)
    elapsed = time.monotonic() - started
    bumper.join()
    assert response.status_code == 200
    assert response.json()["state_version"] == 2
    assert response["ETag"] == _current(client, job)[0] != etag
    assert 0.4 <= elapsed < 1.5, elapsed


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("with_etag", [True, False])
def test_get_job__wait_returns_as_soon_as_a_page_is_done(api, make_job, with_etag):
    """The long-poll wakes on page progress, not only on a state change (API_CONTRACT §2.2)."""
    job = make_job(state="running", source_page_count=50)
    client = api()
    etag, _ = _current(client, job)
    headers = {"HTTP_IF_NONE_MATCH": etag} if with_etag else {}
    writer = _later(job.id, 0.5, pages_done=F("pages_done") + 1, updated_at=Now())
    started = time.monotonic()
    response = client.get(f"/api/v1/jobs/{job.id}?wait=3", **headers)
    elapsed = time.monotonic() - started
    writer.join()
    assert response.status_code == 200
    body = response.json()
    assert (body["state_version"], body["pages"]["done"]) == (1, 1)
    assert response["ETag"] != etag
    assert 0.4 <= elapsed < 2.0, elapsed


@pytest.mark.django_db(transaction=True)
def test_get_job__wait_times_out_with_304_when_etag_matches(api, make_job):
    job = make_job()
    client = api()
    etag, _ = _current(client, job)
    started = time.monotonic()
    response = client.get(f"/api/v1/jobs/{job.id}?wait=1", HTTP_IF_NONE_MATCH=etag)
    elapsed = time.monotonic() - started
    assert response.status_code == 304
    assert response["ETag"] == etag
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
    client = api()
    stale, _ = _current(client, job)
    ConversionJob.objects.filter(id=job.id).update(pages_done=F("pages_done") + 1)
    started = time.monotonic()
    response = client.get(f"/api/v1/jobs/{job.id}?wait=5", HTTP_IF_NONE_MATCH=stale)
    assert response.status_code == 200
    assert response.json()["pages"]["done"] == 1
    assert response["ETag"] == _current(client, job)[0] != stale
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
    client = api()
    etag, _ = _current(client, job)
    headers = {"HTTP_IF_NONE_MATCH": etag} if with_etag else {}
    started = time.monotonic()
    response = client.get(f"/api/v1/jobs/{job.id}?wait=5", **headers)
    assert time.monotonic() - started < 1
    assert response.status_code == (304 if with_etag else 200)
    assert response["ETag"] == etag


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
