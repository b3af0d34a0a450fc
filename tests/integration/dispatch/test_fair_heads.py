"""The fair pick reads each tenant's first waiting units, not the whole backlog (migration 0020,
ADR 0021 "The pick's cost"): the outbox row's tenant comes from its job on every insert path, a
tenant's superseded rows in front of its live ones are passed over, a long backlog of one tenant
hides no other tenant's unit, and the rows the pick reads do not grow with the backlog."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection, transaction

from conversion_jobs.models import ConversionJob, ConversionOutbox
from conversion_jobs.services import fair, transitions
from tests import testdocs
from tests.integration.execution.jobkit import submit, unique_text

pytestmark = [pytest.mark.fair_credits, pytest.mark.django_db]


def _needs_postgres() -> None:
    if connection.vendor != "postgresql":
        pytest.fail("this test needs the production profile (the trigger and the index)")


def _waiting(tenant: str, n: int, *, cost: int = 10) -> list[ConversionJob]:
    """``n`` queued jobs of ``tenant`` with one waiting unit each, in two statements (the
    backlog of a flood; one ORM create per job would make the setup the test's cost)."""
    jobs = ConversionJob.objects.bulk_create(
        [_job(tenant, cost, i) for i in range(n)], batch_size=500
    )
    ConversionOutbox.objects.bulk_create(
        [ConversionOutbox(job=j, generation=1) for j in jobs], batch_size=500
    )
    return jobs


def _job(tenant: str, cost: int, i: int) -> ConversionJob:
    import uuid

    sha = uuid.uuid4().hex * 2
    return ConversionJob(
        tenant=tenant,
        state="queued",
        source_key=f"sources/{sha[:2]}/{sha}",
        source_sha256=sha,
        source_size=10,
        source_media_type="application/pdf",
        output="text",
        options={"dpi": None, "pages": None, "allow_partial": True},
        options_digest=uuid.uuid4().hex,
        dispatch_cost=cost,
    )


@pytest.mark.postgres
def test_outbox_tenant__is_the_jobs_on_every_insert_path(
    unit: Any, tmp_path: Any, no_broker_publish: Any
) -> None:
    _needs_postgres()
    # the acceptance's one statement (the job and its outbox row in data-modifying CTEs of one
    # INSERT), staged and inline: the trigger's lookup sees the job row the statement wrote
    for inline in (False, True):
        source = testdocs.make_pdf(tmp_path / f"a{inline}.pdf", pages=1, text_of=unique_text())
        submit(source, output="text", tenant="tenant-accepted", inline=inline)
    orm = unit("tenant-orm")  # ConversionOutbox.objects.create
    bulk = _waiting("tenant-bulk", 2)  # bulk_create (the planner's range rows)
    with connection.cursor() as cursor:  # a raw insert naming no tenant (store/jobs.py's)
        cursor.execute(
            "INSERT INTO conversion_outbox (job_id, generation, traceparent, created_at,"
            " publish_attempts) VALUES (%s, 2, '', now(), 0)",
            [orm.id],
        )
        # a row that names another tenant is corrected: the job's is the truth
        cursor.execute(
            "INSERT INTO conversion_outbox (job_id, generation, traceparent, created_at,"
            " publish_attempts, tenant) VALUES (%s, 3, '', now(), 0, 'someone-else')",
            [bulk[0].id],
        )
    rows = dict(ConversionOutbox.objects.values_list("id", "tenant"))
    expected = {o.id: o.job.tenant for o in ConversionOutbox.objects.select_related("job").all()}
    assert rows == expected
    assert set(rows.values()) == {"tenant-accepted", "tenant-orm", "tenant-bulk"}


def test_pick__a_long_backlog_hides_no_other_tenants_unit(capacity: Any, unit: Any) -> None:
    capacity(2)
    _waiting("a", 600)
    b = unit("b", cost=1)
    picked = fair.pick(limit=10)
    # B's first unit starts at the clock, as A's first does: both are sent, A's (lower id) first
    assert [u.tenant for u in picked] == ["a", "b"]
    assert picked[1].job_id == b.id


def test_pick__a_tenants_superseded_rows_in_front_are_passed_over(capacity: Any, unit: Any) -> None:
    capacity(3)
    gone = [unit("a") for _ in range(4)]
    for job in gone:
        assert transitions.cancel_queued(job_id=job.id, tenant="a", actor="x") is not None
    live = [unit("a") for _ in range(2)]
    other = unit("b")
    picked = fair.pick(limit=10)
    assert sorted(u.job_id for u in picked) == sorted([live[0].id, live[1].id, other.id])


def test_pick__each_tenants_units_leave_in_id_order(capacity: Any, unit: Any) -> None:
    capacity(100)
    a = [unit("a", cost=1) for _ in range(5)]
    b = [unit("b", cost=1) for _ in range(5)]
    picked = fair.pick(limit=100)
    assert [u.job_id for u in picked if u.tenant == "a"] == [j.id for j in a]
    assert [u.job_id for u in picked if u.tenant == "b"] == [j.id for j in b]


@pytest.mark.postgres
def test_pick__reads_the_same_rows_whatever_the_backlog(capacity: Any, unit: Any) -> None:
    """The rows of ``conversion_job`` one pick reads (``pg_stat_xact_user_tables``: this
    transaction's own counts) with 20 and with 2,000 waiting units of A: the same few probes,
    where ordering every unit read every waiting job."""
    _needs_postgres()
    capacity(1)

    def job_rows_read_by_one_pick() -> int:
        with connection.cursor() as cursor:
            cursor.execute("ANALYZE conversion_job")
            cursor.execute("ANALYZE conversion_outbox")
        with transaction.atomic():
            with connection.cursor() as cursor:
                sql = (
                    "SELECT COALESCE(seq_tup_read, 0) + COALESCE(idx_tup_fetch, 0)"
                    " FROM pg_stat_xact_user_tables WHERE relname = 'conversion_job'"
                )
                cursor.execute(sql)
                before = cursor.fetchone()[0]
                units = fair.pick(limit=1)
                cursor.execute(sql)
                after = cursor.fetchone()[0]
            transaction.set_rollback(True)  # the next round picks from the same backlog
        assert [u.tenant for u in units] == ["b"]
        return int(after - before)

    unit("b", cost=1)  # B's unit, first: the lowest id, so the tie at the clock goes to it
    _waiting("a", 20)
    small = job_rows_read_by_one_pick()
    _waiting("a", 1980)
    large = job_rows_read_by_one_pick()
    assert large <= small + 5, (small, large)
    assert large < 100
