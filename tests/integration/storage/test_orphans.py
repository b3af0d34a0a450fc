"""The orphan sweep and the source lock: objects put whose row never committed are deleted
after the grace period; named, young and foreign objects never are (both backends)."""

from __future__ import annotations

import io
import socket
import threading
import time
import uuid

import pytest
from django.db import connection, transaction

from conversion_jobs import storage
from conversion_jobs.models import ConversionJob, InlineSource, PageCheckpoint
from conversion_jobs.services.artifacts import (
    artifacts_remove_orphans,
    source_delete_if_unused,
    source_lock,
)
from tests.integration.api.conftest import problem, row_counts, submit

pytestmark = pytest.mark.django_db(transaction=True)


def _put(key: str) -> str:
    storage.put(key, io.BytesIO(b"artifact"))
    return key


def test_orphans__unnamed_objects_past_the_grace_are_deleted(backend, make_job):
    job = make_job(state="succeeded")
    named_result = _put(storage.result_key(job_id=job.id, generation=2, ext="txt"))
    ConversionJob.objects.filter(id=job.id).update(result_key=named_result)
    # A worker of generation 1 crashed between storing its result and publishing it.
    crashed_result = _put(storage.result_key(job_id=job.id, generation=1, ext="txt"))
    named_page = _put(storage.page_key(job_id=job.id, page=1, generation=2, ext="txt"))
    PageCheckpoint.objects.create(
        job=job,
        page_number=1,
        state="done",
        artifact_key=named_page,
        artifact_sha256="0" * 64,
        generation=2,
    )
    # ... and a page it stored whose checkpoint batch never committed.
    crashed_page = _put(storage.page_key(job_id=job.id, page=2, generation=1, ext="txt"))
    # An upload whose acceptance transaction never committed.
    crashed_source = _put(storage.source_key("9f" * 32))
    used_source = _put(job.source_key)
    foreign = _put("pages/not-quire/readme.txt")

    assert artifacts_remove_orphans(grace_s=3600) == 0  # all young: nothing is touched

    time.sleep(1.1)  # S3 keeps whole-second modification times
    assert artifacts_remove_orphans(grace_s=0) == 3

    assert not any(storage.exists(k) for k in (crashed_result, crashed_page, crashed_source))
    assert all(storage.exists(k) for k in (named_result, named_page, used_source, foreign))
    assert artifacts_remove_orphans(grace_s=0) == 0  # idempotent


def test_orphans__objects_of_purged_jobs_are_orphans(backend, make_job):
    job = make_job(state="succeeded", expired_at=None)
    key = _put(storage.result_key(job_id=job.id, generation=1, ext="txt"))
    ConversionJob.objects.filter(id=job.id).update(result_key=key)
    source = _put(job.source_key)
    time.sleep(1.1)
    assert artifacts_remove_orphans(grace_s=0) == 0
    from django.utils import timezone

    ConversionJob.objects.filter(id=job.id).update(
        expired_at=timezone.now(), purged_at=timezone.now()
    )
    assert artifacts_remove_orphans(grace_s=0) == 2
    assert not storage.exists(key) and not storage.exists(source)


@pytest.mark.postgres
def test_source_lock__a_deleter_waits_for_the_accepting_transaction(backend, make_job):
    """While an acceptance holds a source shared (its row not yet committed), a deleter that
    found no row waits; once the row commits, the deleter sees it and keeps the object."""
    if connection.vendor != "postgresql":
        pytest.fail("needs Postgres")
    sha = "5e" * 32
    key = _put(storage.source_key(sha))
    holding, release, outcome = threading.Event(), threading.Event(), {}

    def accept() -> None:
        with transaction.atomic():
            source_lock(sha256=sha, exclusive=False)
            holding.set()
            release.wait(10)
            make_job(state="queued", source_sha256=sha)
        connection.close()

    def delete() -> None:
        holding.wait(10)
        outcome["deleted"] = source_delete_if_unused(sha256=sha, key=key, live_only=True, grace_s=0)
        connection.close()

    threads = [threading.Thread(target=accept), threading.Thread(target=delete)]
    for t in threads:
        t.start()
    holding.wait(10)
    time.sleep(0.5)
    assert "deleted" not in outcome  # blocked on the lock
    release.set()
    for t in threads:
        t.join(20)
    assert outcome == {"deleted": False}
    assert storage.exists(key)


def test_source_delete__an_object_younger_than_the_grace_is_kept(backend):
    """An acceptance that just uploaded a source commits without the lock: deleters leave
    young objects alone, whoever names them."""
    sha = "7a" * 32
    key = _put(storage.source_key(sha))
    assert source_delete_if_unused(sha256=sha, key=key, live_only=True) is False
    assert storage.exists(key)
    time.sleep(1.1)
    assert source_delete_if_unused(sha256=sha, key=key, live_only=True, grace_s=0) is True
    assert not storage.exists(key)


@pytest.mark.parametrize("inline", [False, True], ids=["stored", "inline"])
def test_accept__store_unreachable_is_503_and_nothing_is_written(
    api, pdf_file, settings, no_broker_publish, inline
):
    """A source above ``QUIRE_INLINE_SOURCE_MAX_BYTES`` needs the store: 503, nothing written.
    One within it never touches the store (ADR 0017 session 10): 202."""
    path = pdf_file()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once we leave: nothing listens there
    settings.QUIRE = {
        **settings.QUIRE,
        "STORAGE": "s3",
        "S3": {
            **settings.QUIRE["S3"],
            "BUCKET": "quire",
            "ENDPOINT_URL": f"http://127.0.0.1:{port}",
            "PREFIX": f"test-{uuid.uuid4().hex}",
        },
        "INLINE_SOURCE_MAX_BYTES": path.stat().st_size - (0 if inline else 1),
    }
    if inline:
        assert submit(api(), path).status_code == 202
        assert row_counts()["jobs"] == InlineSource.objects.count() == 1
        return
    problem(submit(api(), path), 503, "storage_unavailable")
    assert row_counts()["jobs"] == 0
