"""The hot statements (claim, a batch of done pages, publish) are bound by the server and
prepared once per connection (store/prepared.py, ADR 0017 session 5): the same statement
serves every job, and a column added to the job table by a later migration does not break a
connection that prepared the claim before it."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from django.db import connection

from conversion_jobs.models import ConversionJob
from conversion_jobs.services import transitions
from conversion_jobs.store import checkpoints
from tests.integration.transitions.builders import done_page, text_result

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


def _prepared() -> dict[str, int]:
    """This connection's prepared statements by their first CTE's name, with how many."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement FROM pg_prepared_statements")
        out: dict[str, int] = {}
        for (statement,) in cursor.fetchall():
            head = " ".join(statement.split()[:3])
            out[head] = out.get(head, 0) + 1
    return out


def _run_one(job: ConversionJob, pages: int) -> None:
    claim = transitions.claim(job_id=job.id, generation=1, worker="w")
    assert claim is not None
    assert claim.job.id == job.id and claim.job.state == "running"
    if pages > 1:
        assert checkpoints.done_pages_record(
            claim.lease, [done_page(job.id, n) for n in range(1, pages)]
        )
    result = text_result(
        key=f"inline:results/{job.id}/result.g1.txt", size=pages, pages_done=pages, page_count=pages
    )
    assert transitions.publish_succeeded(
        lease=claim.lease, result=result, checkpoints=[done_page(job.id, pages)]
    )


def test_hot_statements__prepared_once_and_reused(make_job: Callable[..., ConversionJob]) -> None:
    connection.ensure_connection()
    with connection.cursor() as cursor:
        cursor.execute("DEALLOCATE ALL")
    connection.connection._prepared.clear()  # psycopg's side of the DEALLOCATE
    for _ in range(3):
        _run_one(make_job(), pages=1)
    _run_one(make_job(), pages=3)
    prepared = _prepared()
    # One claim, one publish (the same for every job), and the done-pages batch.
    assert prepared.get("WITH locked AS") == 2, prepared
    assert prepared.get("WITH moved AS") == 1, prepared
    done = ConversionJob.objects.filter(state="succeeded")
    assert done.count() == 4
    assert sorted(done.values_list("pages_done", flat=True)) == [1, 1, 1, 3]


def _ddl(sql: str) -> None:
    """DDL from another connection, as a migration run by another process would be (psycopg
    forgets its prepared statements when its own connection runs an ALTER)."""
    import psycopg

    settings = connection.settings_dict
    with psycopg.connect(
        dbname=settings["NAME"],
        user=settings["USER"],
        password=settings["PASSWORD"],
        host=settings["HOST"],
        port=settings["PORT"],
        autocommit=True,
    ) as other:
        other.execute(sql)


def test_claim__survives_a_column_added_after_it_was_prepared(
    make_job: Callable[..., ConversionJob],
) -> None:
    _run_one(make_job(), pages=1)
    assert _prepared().get("WITH locked AS") == 2
    _ddl("ALTER TABLE conversion_job ADD COLUMN session5_probe integer")
    try:
        _run_one(make_job(), pages=1)
    finally:
        _ddl("ALTER TABLE conversion_job DROP COLUMN session5_probe")
