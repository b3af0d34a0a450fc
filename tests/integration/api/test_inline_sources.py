"""Small sources inline in Postgres (ADR 0017 session 10): which uploads are kept inline, the
acceptance's duplicate and replay answers without the pre-check read, the claim's bytes, the
retention purge and the rollback command. Runs on both profiles (SQLite: the pre-check path,
the inline row written by the ORM in the acceptance's transaction)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
from django.core.files.uploadhandler import StopFutureHandlers
from django.core.management import call_command
from django.db import connection, transaction

from conversion_jobs import storage
from conversion_jobs.models import ConversionJob, IdempotencyRecord, InlineSource
from conversion_jobs.services import retention, transitions
from tests import testdocs
from tests.conftest import token
from tests.integration.api.conftest import (
    problem,
    run_concurrently,
    staged_uploads,
    stored_objects,
    submit,
)


def _source_objects() -> list[str]:
    return [o.key for o in storage.list_objects("sources")]


@pytest.mark.django_db(transaction=True)
def test_accept__source_of_exactly_the_max_is_inline(
    api, pdf_file, settings_quire, no_broker_publish
):
    path = pdf_file()
    size = path.stat().st_size
    settings_quire(INLINE_SOURCE_MAX_BYTES=size)
    response = submit(api(), path)
    assert response.status_code == 202, response.content
    job = ConversionJob.objects.get()
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    assert job.source_key == storage.inline_source_key(sha) == f"inline:sources/{sha[:2]}/{sha}"
    assert job.source_sha256 == sha
    assert job.source_size == size
    assert bytes(InlineSource.objects.get(job=job).content) == path.read_bytes()
    assert _source_objects() == []
    assert staged_uploads() == []


@pytest.mark.django_db(transaction=True)
def test_accept__source_one_byte_over_the_max_is_stored(
    api, pdf_file, settings_quire, no_broker_publish
):
    path = pdf_file()
    settings_quire(INLINE_SOURCE_MAX_BYTES=path.stat().st_size - 1)
    assert submit(api(), path).status_code == 202
    job = ConversionJob.objects.get()
    assert not storage.is_inline_source(job.source_key)
    assert InlineSource.objects.count() == 0
    assert _source_objects() == [job.source_key]
    assert staged_uploads() == []


@pytest.mark.django_db(transaction=True)
def test_accept__max_zero_turns_inline_off(api, pdf_file, settings_quire, no_broker_publish):
    settings_quire(INLINE_SOURCE_MAX_BYTES=0)
    assert submit(api(), pdf_file()).status_code == 202
    assert InlineSource.objects.count() == 0
    assert len(_source_objects()) == 1


@pytest.mark.django_db(transaction=True)
def test_accept__inline_key_reused_for_another_document_is_422(api, pdf_file, no_broker_publish):
    client = api()
    assert submit(client, pdf_file(salt="a"), key="k1").status_code == 202
    problem(submit(client, pdf_file(salt="b"), key="k1"), 422, "idempotency_key_reused")
    assert ConversionJob.objects.count() == InlineSource.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_accept__inline_key_bound_to_another_job_wins_over_the_identity(
    api, pdf_file, no_broker_publish
):
    """The key's binding is read before the identity's job answers: a key bound to document A
    sent with document B (whose identity is taken by a job of its own) is a 422, not B's job."""
    client, a, b = api(), pdf_file(salt="a"), pdf_file(salt="b")
    assert submit(client, a, key="ka").status_code == 202
    assert submit(client, b).status_code == 202
    problem(submit(client, b, key="ka"), 422, "idempotency_key_reused")
    # and the same key with its own document is still its replay
    assert submit(client, a, key="ka")["Idempotent-Replayed"] == "true"
    assert ConversionJob.objects.count() == InlineSource.objects.count() == 2


@pytest.mark.django_db(transaction=True)
def test_accept__inline_duplicate_with_a_new_key_binds_it(api, pdf_file, no_broker_publish):
    client, path = api(), pdf_file()
    first = submit(client, path)
    second = submit(client, path, key="fresh")
    assert second.status_code == 200
    assert "Idempotent-Replayed" not in second
    assert second.json()["id"] == first.json()["id"]
    record = IdempotencyRecord.objects.get()
    assert str(record.job_id) == first.json()["id"]
    assert submit(client, path, key="fresh")["Idempotent-Replayed"] == "true"
    assert InlineSource.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_accept__inline_same_document_for_two_tenants_is_two_rows(api, pdf_file, no_broker_publish):
    path = pdf_file()
    assert submit(api(tenant="tenant-a"), path).status_code == 202
    assert submit(api(tenant="tenant-b"), path).status_code == 202
    assert InlineSource.objects.count() == 2


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("key", [None, "dup-key"])
def test_accept__concurrent_inline_duplicates_from_two_connections_make_one_job(
    pdf_file, no_broker_publish, key
):
    from rest_framework.test import APIClient

    def client() -> APIClient:
        c = APIClient()
        c.credentials(HTTP_AUTHORIZATION=f"Bearer {token(tenant='tenant-a')}")
        return c

    for n in range(1, 4):  # a few rounds: the two statements meet in different orders
        path = pdf_file(salt=str(n))
        round_key = None if key is None else f"{key}-{n}"
        responses = run_concurrently([lambda p=path, k=round_key: submit(client(), p, key=k)] * 2)
        assert sorted(r.status_code for r in responses) == [200, 202]
        assert len({r.json()["id"] for r in responses}) == 1
        assert ConversionJob.objects.count() == InlineSource.objects.count() == n
        assert IdempotencyRecord.objects.count() == (n if key else 0)


@pytest.mark.django_db(transaction=True)
def test_claim__returns_the_inline_bytes(api, pdf_file, no_broker_publish):
    path = pdf_file()
    assert submit(api(), path).status_code == 202
    job = ConversionJob.objects.get()
    claim = transitions.claim(job_id=job.id, generation=1, worker="w")
    assert claim is not None
    assert claim.source == path.read_bytes()


@pytest.mark.django_db(transaction=True)
def test_claim__stored_source_has_no_bytes(api, pdf_file, settings_quire, no_broker_publish):
    settings_quire(INLINE_SOURCE_MAX_BYTES=0)
    assert submit(api(), pdf_file()).status_code == 202
    claim = transitions.claim(job_id=ConversionJob.objects.get().id, generation=1, worker="w")
    assert claim is not None
    assert claim.source is None


@pytest.mark.django_db(transaction=True)
def test_retention__purge_deletes_the_inline_row(
    api, pdf_file, settings_quire, make_job, no_broker_publish
):
    assert submit(api(), pdf_file()).status_code == 202
    job = ConversionJob.objects.get()
    ConversionJob.objects.filter(id=job.id).update(
        state="cancelled", finished_at="2000-01-01T00:00:00Z"
    )
    settings_quire(RESULT_RETENTION_S=60, ORPHAN_GRACE_S=0)
    result = retention.retention_apply()
    assert result.jobs_expired == result.jobs_purged == 1
    assert InlineSource.objects.count() == 0
    assert ConversionJob.objects.get().purged_at is not None
    assert stored_objects() == []


@pytest.mark.postgres  # the database's own cascade (elsewhere the ORM's)
@pytest.mark.django_db(transaction=True)
def test_inline_row__goes_with_its_job_row(api, pdf_file, no_broker_publish):
    assert submit(api(), pdf_file()).status_code == 202
    job_id = ConversionJob.objects.get().id
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SET LOCAL quire.audit_purge = 'on'")
        cursor.execute("DELETE FROM execution_audit_event WHERE job_id = %s", [job_id])
        cursor.execute("DELETE FROM conversion_outbox WHERE job_id = %s", [job_id])
        cursor.execute("DELETE FROM conversion_job WHERE id = %s", [job_id])
    assert InlineSource.objects.count() == 0


@pytest.mark.django_db(transaction=True)
def test_inline_sources_store__moves_every_source_to_the_store(
    api, pdf_file, settings_quire, no_broker_publish
):
    client = api()
    a, b = pdf_file(salt="a"), pdf_file(salt="b")
    assert submit(client, a).status_code == 202
    assert submit(client, b).status_code == 202
    # b's bytes are in the store already (a stored job of another tenant): reused, not copied
    settings_quire(INLINE_SOURCE_MAX_BYTES=0)
    assert submit(api(tenant="tenant-b"), b).status_code == 202
    assert len(_source_objects()) == 1

    call_command("inline_sources_store", batch=1)

    assert InlineSource.objects.count() == 0
    for path in (a, b):
        sha = hashlib.sha256(path.read_bytes()).hexdigest()
        for job in ConversionJob.objects.filter(source_sha256=sha):
            assert job.source_key == storage.source_key(sha)
            with storage.open_object(job.source_key) as fh:
                assert fh.read() == path.read_bytes()
    assert len(_source_objects()) == 2
    call_command("inline_sources_store")  # nothing left: idempotent
    claim = transitions.claim(
        job_id=ConversionJob.objects.filter(tenant="tenant-a").first().id, generation=1, worker="w"
    )
    assert claim is not None and claim.source is None


def test_sniff_media_type_bytes__matches_the_file_sniff(tmp_path: Path, pdf_file):
    from conversion_jobs import converters

    made = [
        pdf_file(),
        testdocs.make_docx(tmp_path / "a.docx", paragraphs=["x"]),
        testdocs.make_odt(tmp_path / "a.odt", paragraphs=["x"]),
        testdocs.make_rtf(tmp_path / "a.rtf", paragraphs=["x"]),
        testdocs.make_png(tmp_path / "a.png"),
        testdocs.make_zip_as_pdf(tmp_path / "z.pdf"),
        testdocs.make_wrong_magic(tmp_path / "w.pdf"),
    ]
    for path in made:
        assert converters.sniff_media_type_bytes(path.read_bytes()) == (
            converters.sniff_media_type(path)
        ), path.name
    assert converters.sniff_media_type_bytes(b"") is None
    assert converters.sniff_media_type_bytes(b"PK\x03\x04broken") is None


@pytest.mark.django_db
def test_upload_handler__spills_to_a_staged_file_when_it_crosses_the_max(settings):
    """Chunks up to the max stay in memory; the chunk that crosses it stages what was kept
    first, then itself: the staged file and the digest are the whole upload."""
    from conversion_jobs.api.uploads import StagingUploadHandler

    def run(chunks: list[bytes]) -> Any:
        handler = StagingUploadHandler(max_bytes=10_000, inline_max=100)
        try:
            handler.new_file("file", "upload", "", None)
        except StopFutureHandlers:
            pass
        for chunk in chunks:
            handler.receive_data_chunk(chunk, 0)
        return handler, handler.file_complete(sum(map(len, chunks))).staged

    handler, kept = run([b"a" * 60, b"b" * 40])
    assert (kept.path, kept.content, kept.size) == (None, b"a" * 60 + b"b" * 40, 100)
    assert kept.sha256 == hashlib.sha256(kept.content).hexdigest()
    assert handler.staged == []

    handler, spilled = run([b"a" * 60, b"b" * 60, b"c" * 5])
    whole = b"a" * 60 + b"b" * 60 + b"c" * 5
    assert spilled.content is None and spilled.path.read_bytes() == whole
    assert (spilled.size, spilled.sha256) == (125, hashlib.sha256(whole).hexdigest())
    handler.cleanup()
    assert not spilled.path.exists()


@pytest.mark.django_db(transaction=True)
def test_accept__a_body_through_djangos_parser_is_inline_too(
    api, tmp_path, settings_quire, no_broker_publish
):
    """Larger than the small-form path takes (64 KiB body): Django's multipart parser feeds the
    handler, which keeps it in memory below a raised max."""
    path = tmp_path / "big.pdf"
    path.write_bytes(testdocs.pdf_bytes(pages=1) + b"%" * 90_000)
    settings_quire(INLINE_SOURCE_MAX_BYTES=100_000)
    assert submit(api(), path).status_code == 202
    assert bytes(InlineSource.objects.get().content) == path.read_bytes()
    assert _source_objects() == [] and staged_uploads() == []


@pytest.mark.django_db(transaction=True)
def test_accept__inline_replay_and_duplicate_answer_at_the_tenant_limit(
    api, pdf_file, settings_quire, no_broker_publish
):
    """Without the pre-check read, admission runs first: its refusal reads what the pre-check
    would have, so a replay or a duplicate (which adds no job) still answers 200."""
    settings_quire(TENANT_QUOTA=1, ADMISSION_SNAPSHOT_S=0)
    client, path = api(), pdf_file()
    first = submit(client, path, key="k1")
    assert first.status_code == 202
    assert submit(client, path, key="k1")["Idempotent-Replayed"] == "true"
    duplicate = submit(client, path)
    assert (duplicate.status_code, duplicate.json()["id"]) == (200, first.json()["id"])
    problem(submit(client, path, key="k2", output="png"), 429, "tenant_quota_exceeded")
    problem(submit(client, pdf_file(salt="other")), 429, "tenant_quota_exceeded")
    assert ConversionJob.objects.count() == InlineSource.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_migration_0012__reverse_refuses_inline_sources_then_goes_after_the_command(
    api, pdf_file, no_broker_publish
):
    from django.db.migrations.executor import MigrationExecutor

    assert submit(api(), pdf_file()).status_code == 202
    before = [("conversion_jobs", "0011_compact_state_checks")]
    # back to the app's latest migration afterwards (later ones depend on 0012 and are reversed
    # with it)
    leaf = MigrationExecutor(connection).loader.graph.leaf_nodes("conversion_jobs")
    try:
        with pytest.raises(RuntimeError, match="inline_sources_store"):
            MigrationExecutor(connection).migrate(before)
        assert InlineSource.objects.count() == 1  # the refusal changed nothing

        call_command("inline_sources_store")
        executor = MigrationExecutor(connection)
        executor.migrate(before)
        assert "inline_source" not in connection.introspection.table_names()
        # only the columns 0011 has (the model has later ones)
        job = ConversionJob.objects.values("source_key", "source_sha256").get()
        assert job["source_key"] == storage.source_key(job["source_sha256"])
    finally:
        executor = MigrationExecutor(connection)
        executor.loader.build_graph()
        executor.migrate(leaf)
    assert "inline_source" in connection.introspection.table_names()
