"""A checkpoint batch of done pages (one statement on Postgres, ``store.checkpoints.DONE_PAGES``;
the ORM transaction elsewhere): fenced like every write of an attempt, and all or nothing."""

from __future__ import annotations

import dataclasses
import uuid

import pytest

from conversion_jobs.models import ConversionJob, PageCheckpoint, PageState
from conversion_jobs.services import transitions
from conversion_jobs.services.checkpoints import (
    INLINE_PREFIX,
    page_checkpoint_done,
    page_checkpoints_record,
)
from conversion_jobs.services.leases import LeaseLost
from conversion_jobs.store.checkpoints import CHECKPOINT_COLUMNS
from tests import testdocs
from tests.integration.execution.jobkit import submit

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("fast_quire", "no_broker_publish"),
]


def _claimed(tmp_path):
    source = testdocs.make_pdf(tmp_path / f"{uuid.uuid4().hex}.pdf", pages=3)
    job = submit(source, output="text")
    claim = transitions.claim(job_id=job.id, generation=job.generation, worker="w")
    assert claim is not None
    return job, claim.lease


def _done(lease, page: int, text: bytes) -> PageCheckpoint:
    key = f"pages/{lease.job_id}/{page:05d}.g{lease.generation}.txt"
    return PageCheckpoint(
        job_id=lease.job_id,
        page_number=page,
        state=PageState.DONE,
        attempts=1,
        artifact_key=INLINE_PREFIX + key,
        artifact_sha256="0" * 64,
        artifact_size=len(text),
        media_type="text/plain; charset=utf-8",
        generation=lease.generation,
        content=text,
    )


def test_batch__records_every_page_with_its_bytes_and_moves_the_counter(tmp_path):
    job, lease = _claimed(tmp_path)
    # A page recorded pending earlier (its try spent) is overwritten by its done row.
    page_checkpoints_record(
        lease=lease,
        checkpoints=[
            PageCheckpoint(
                job_id=job.id,
                page_number=2,
                state=PageState.PENDING,
                attempts=1,
                error_code="converter_crashed",
                generation=lease.generation,
            )
        ],
    )
    page_checkpoints_record(
        lease=lease, checkpoints=[_done(lease, n, f"page {n}".encode()) for n in (1, 2, 3)]
    )
    rows = {p.page_number: p for p in PageCheckpoint.objects.filter(job_id=job.id)}
    assert {n: (r.state, bytes(r.content), r.error_code) for n, r in rows.items()} == {
        n: ("done", f"page {n}".encode(), None) for n in (1, 2, 3)
    }
    job.refresh_from_db()
    assert job.pages_done == 3


@pytest.mark.parametrize("stale", ["token", "generation"])
def test_batch__a_stale_lease_writes_nothing(tmp_path, stale):
    job, lease = _claimed(tmp_path)
    if stale == "token":
        stale_lease = dataclasses.replace(lease, token=uuid.uuid4())
    else:
        stale_lease = dataclasses.replace(lease, generation=lease.generation + 1)
    with pytest.raises(LeaseLost):
        page_checkpoints_record(lease=stale_lease, checkpoints=[_done(lease, 1, b"x")])
    assert not PageCheckpoint.objects.filter(job_id=job.id).exists()
    job.refresh_from_db()
    assert job.pages_done == 0


def test_batch__after_a_cancel_writes_nothing(tmp_path):
    job, lease = _claimed(tmp_path)
    ConversionJob.objects.filter(id=job.id).update(state="cancelling")
    with pytest.raises(LeaseLost):
        page_checkpoints_record(lease=lease, checkpoints=[_done(lease, 1, b"x")])
    assert not PageCheckpoint.objects.filter(job_id=job.id).exists()


#: Bytes a text literal would have to escape: quotes, backslashes, braces and commas of an
#: array literal, a NUL, bytes that are not UTF-8; and an empty page.
AWKWARD = [b"'quoted' \\back\\slash {a,b} \"x\"", b"\x00\x01\xff\xfe", b"", "π ≠ 3".encode()]


def test_batch__page_bytes_travel_unchanged_in_binary(tmp_path):
    from django.db import connection

    job, lease = _claimed(tmp_path)
    assert not connection.queries_logged  # the cursor as it runs in production
    page_checkpoints_record(
        lease=lease, checkpoints=[_done(lease, n, body) for n, body in enumerate(AWKWARD, 1)]
    )
    rows = PageCheckpoint.objects.filter(job_id=job.id).order_by("page_number")
    assert [bytes(r.content) for r in rows] == AWKWARD


def test_batch__page_bytes_travel_unchanged_while_queries_are_logged(tmp_path):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    job, lease = _claimed(tmp_path)
    with CaptureQueriesContext(connection) as captured:
        page_checkpoints_record(
            lease=lease, checkpoints=[_done(lease, n, body) for n, body in enumerate(AWKWARD, 1)]
        )
    assert captured.captured_queries  # logged (its text is the cursor's business)
    rows = PageCheckpoint.objects.filter(job_id=job.id).order_by("page_number")
    assert [bytes(r.content) for r in rows] == AWKWARD


@pytest.mark.postgres
def test_batch__inline_page_texts_are_compressed_with_lz4_where_postgres_has_it():
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT 'lz4' = ANY(enumvals) FROM pg_settings WHERE name = 'default_toast_compression'"
        )
        (has_lz4,) = cursor.fetchone()
        cursor.execute(
            "SELECT attcompression FROM pg_attribute"
            " WHERE attrelid = 'page_checkpoint'::regclass AND attname = 'content'"
        )
        (method,) = cursor.fetchone()
    assert method == ("l" if has_lz4 else "")  # migration 0010


def test_page_checkpoint_done__fields_are_the_models_in_order():
    assert tuple(f.attname for f in PageCheckpoint._meta.concrete_fields) == CHECKPOINT_COLUMNS


def test_page_checkpoint_done__is_the_keyword_built_row_and_records_the_same(tmp_path):
    job, lease = _claimed(tmp_path)
    expected = _done(lease, 1, b"page one")
    built = page_checkpoint_done(
        lease=lease,
        page=1,
        attempts=1,
        artifact_key=expected.artifact_key,
        artifact_sha256=expected.artifact_sha256,
        artifact_size=expected.artifact_size,
        media_type=expected.media_type,
        content=b"page one",
    )
    names = [f.attname for f in PageCheckpoint._meta.concrete_fields]
    assert [getattr(built, n) for n in names] == [getattr(expected, n) for n in names]
    assert built._state.adding and built.pk is None
    page_checkpoints_record(lease=lease, checkpoints=[built])
    row = PageCheckpoint.objects.get(job_id=job.id, page_number=1)
    assert (row.state, bytes(row.content), row.generation) == (
        PageState.DONE,
        b"page one",
        lease.generation,
    )
