"""The acceptance's two statements are prepared once per connection
(``services/prepared.py::prepared_cursor``, the cursor of every hot statement): Postgres parses
and plans them once, then only binds and executes."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import pytest
from django.conf import settings
from django.db import IntegrityError, connection, transaction
from django.test.utils import CaptureQueriesContext

from conversion_jobs import storage
from conversion_jobs.db import violated_constraint
from conversion_jobs.models import ConversionJob
from conversion_jobs.services.acceptance import StagedUpload, conversion_job_accept
from conversion_jobs.services.prepared import prepared_cursor
from tests import testdocs

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


def _accept(tmp_path: Path, *, key: str | None = None) -> uuid.UUID:
    source = testdocs.make_pdf(tmp_path / "doc.pdf", pages=1, text_of=lambda n: uuid.uuid4().hex)
    staged = Path(settings.QUIRE["STORAGE_DIR"]) / "staging" / uuid.uuid4().hex
    staged.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, staged)
    sha, size = storage.sha256_file(staged)
    accepted = conversion_job_accept(
        tenant="tenant-a",
        actor="t",
        upload=StagedUpload(path=staged, sha256=sha, size=size),
        output="text",
        raw_options={},
        idempotency_key=key,
    )
    assert accepted.created
    return accepted.job.id


def _prepared() -> dict[str, int]:
    """This session's prepared statements: the first words of each and its executions."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement, generic_plans + custom_plans FROM pg_prepared_statements")
        return {" ".join(s.split())[:30]: n for s, n in cursor.fetchall()}


def test_prepared__the_precheck_and_the_insert_are_prepared_once_per_connection(
    tmp_path, no_broker_publish
):
    for n in range(3):
        _accept(tmp_path, key=f"k{n}" if n else None)  # with and without a key: one statement
    prepared = _prepared()
    assert prepared == {"SELECT (SELECT fingerprint FRO": 3, "WITH job AS ( INSERT INTO conv": 3}


def test_prepared__a_rollback_discards_them_and_the_next_acceptance_prepares_again(
    tmp_path, no_broker_publish
):
    """psycopg deallocates every prepared statement after a ROLLBACK (a DROP in it could have
    invalidated them); the statements are then prepared again, and a unique violation inside
    a prepared statement still becomes Django's IntegrityError with its constraint's name."""
    first = _accept(tmp_path, key="same")
    with pytest.raises(RuntimeError), transaction.atomic():
        ConversionJob.objects.filter(id=first).update(state="queued")
        raise RuntimeError("roll back")
    assert _prepared() == {}
    _accept(tmp_path)
    assert len(_prepared()) == 2

    with pytest.raises(IntegrityError) as conflict, transaction.atomic():
        with prepared_cursor() as cursor:
            cursor.execute(
                "INSERT INTO idempotency_record (tenant, key, fingerprint, job_id, created_at)"
                " VALUES (%(tenant)s, %(key)s, '', %(job)s, now())",
                {"tenant": "tenant-a", "key": "same", "job": first},
            )
    assert violated_constraint(conflict.value) == "idempotency_tenant_key"


def test_prepared__with_query_logging_on_the_statements_are_logged_with_their_parameters(
    tmp_path, no_broker_publish
):
    """Django's query log (DEBUG, CaptureQueriesContext) still sees both statements, each with
    its bound parameters (a server-side bound statement has no literal SQL to log)."""
    with CaptureQueriesContext(connection) as captured:
        _accept(tmp_path, key="logged")
    logged = [" ".join(str(q["sql"]).split()) for q in captured.captured_queries]
    assert any(q.startswith("SELECT (SELECT fingerprint FROM") for q in logged), logged
    assert any(q.startswith("WITH job AS ( INSERT INTO conv") for q in logged), logged
    assert any("logged" in q for q in logged), logged  # the key, with the statements' values
