"""The fair pick reads each tenant's first waiting units, not every waiting unit (ADR 0021,
"The pick's cost"; issue 24's flood).

``quire_fair_pick`` ordered every waiting unit (a window over the join of all unpublished outbox
rows with their jobs) on every call, so its cost grew with the backlog: ≈ 3 ms at 1,000 waiting
units on an idle machine, 13 ms and more under a flood's load, all of it while a freed slot
waited. Only each tenant's first ``credit`` units (in id order) can be chosen, so the pick now
reads just those:

* ``conversion_outbox.tenant``: the job's tenant, copied by the trigger
  ``conversion_outbox_tenant`` (``BEFORE INSERT``, function ``quire_outbox_tenant``) whatever
  path writes the row (the acceptance's bulk insert, the ORM's, a worker's range rows, a
  release that predates this column during a rolling deploy). Filled here for the rows of live
  jobs.
* ``outbox_waiting_tenant``: (tenant, id) of the unpublished rows.
* the function's ``units`` and ``waiting`` CTEs become ``keys`` (the tenants with unpublished rows,
  a skip scan of that index: one probe per tenant) and ``waiting`` (per tenant, a ``LATERAL``
  read of its rows in id order joined to the job, and to the range for a range's row, up to the
  credits). The credits, the busy count, the tags, the marks and the lock are unchanged, and so
  is the function's signature and result (``CREATE OR REPLACE``).

SQLite's twin (``store.fair._pick_orm``) keeps reading the job's tenant; the column stays NULL there.
"""

from django.db import migrations, models
from django.db.models import Q

#: The fair relay's pick (docs/ARCHITECTURE.md §2b, ADR 0021): as in migration 0018, except
#: that the waiting units are read per tenant (``keys``, ``waiting``).
FAIR_PICK_SQL = """
CREATE OR REPLACE FUNCTION quire_fair_pick(
    p_limit integer, p_capacity integer, p_lost_s double precision, p_slot_ttl_s double precision
) RETURNS TABLE (out_id bigint, out_job uuid, out_generation integer, out_traceparent text,
                 out_tenant text, out_cost integer, out_range_first integer,
                 out_range_generation integer)
LANGUAGE plpgsql
-- one plan per connection, kept: planning this statement afresh cost ≈ 2 ms a call, the generic
-- plan ≈ 0.25 ms (docs/adr/0021-fair-dispatch.md)
SET plan_cache_mode = force_generic_plan
-- never JIT-compiled: the per-tenant read's estimate (a probe per row of a tenant's whole
-- backlog, where the scan stops at the credits) passed jit_above_cost, and compiling cost
-- ≈ 100 ms a call (migration 0020)
SET jit = off
AS $fn$
BEGIN
    PERFORM pg_advisory_xact_lock(7102421);
    -- The pick's commit does not wait for its WAL flush (the units are published right after
    -- it): a pick lost with a Postgres crash leaves its units waiting, and one sent meanwhile
    -- is sent again, a duplicate the claim's CAS ignores. Local to this transaction.
    PERFORM set_config('synchronous_commit', 'off', true);
    RETURN QUERY
    WITH cap AS (
        SELECT CASE WHEN p_capacity > 0 THEN p_capacity::bigint ELSE (
            SELECT COALESCE(sum(w.slots), 0) FROM worker_slot w
            WHERE w.seen_at > now() - make_interval(secs => p_slot_ttl_s)) END AS slots
    ), busy AS (
        SELECT b.tenant, count(*) AS n FROM (
            -- a job's own slot: running, and not fanned out into ranges still to run
            SELECT j.tenant FROM conversion_job j WHERE j.state IN ('running', 'cancelling')
              AND NOT EXISTS (SELECT 1 FROM job_range r WHERE r.job_id = j.id
                              AND r.job_generation = j.generation
                              AND r.state IN ('queued', 'running'))
            UNION ALL
            SELECT j.tenant FROM conversion_job j
            WHERE j.state = 'queued' AND j.dispatched_at IS NOT NULL
              AND j.dispatched_generation = j.generation
              AND j.dispatched_at > now() - make_interval(secs => p_lost_s)
            UNION ALL
            -- a range's slot: running, or sent and not claimed yet
            SELECT j.tenant FROM job_range r
            JOIN conversion_job j ON j.id = r.job_id AND j.generation = r.job_generation
            WHERE j.state IN ('running', 'cancelling') AND r.state IN ('queued', 'running')
              AND (r.state = 'running'
                   OR (r.state = 'queued' AND r.dispatched_at IS NOT NULL
                       AND r.dispatched_at > now() - make_interval(secs => p_lost_s)))
        ) b GROUP BY b.tenant
    ), credit AS (
        SELECT GREATEST(LEAST(p_limit::bigint,
            (SELECT slots FROM cap) - COALESCE((SELECT sum(n) FROM busy), 0)), 0) AS n
    ), keys AS (
        -- the tenants with unpublished rows: one probe of outbox_waiting_tenant per tenant (a
        -- skip scan), where ordering every waiting unit cost a pick O(backlog) (migration 0020)
        WITH RECURSIVE k AS (
            (SELECT o.tenant FROM conversion_outbox o
             WHERE o.published_at IS NULL AND o.tenant IS NOT NULL
             ORDER BY o.tenant LIMIT 1)
            UNION ALL
            SELECT (SELECT o.tenant FROM conversion_outbox o
                    WHERE o.published_at IS NULL AND o.tenant > k.tenant
                    ORDER BY o.tenant LIMIT 1)
            FROM k WHERE k.tenant IS NOT NULL
        )
        SELECT k.tenant FROM k WHERE k.tenant IS NOT NULL AND (SELECT n FROM credit) > 0
    ), waiting AS (
        -- each tenant's first units in id order, at most the credits: a whole job queued in the
        -- row's generation, or a range queued in its range generation while its job runs in the
        -- row's (rows of superseded generations are passed over)
        SELECT u.*, row_number() OVER (PARTITION BY u.tenant ORDER BY u.id) AS rn
        FROM keys k CROSS JOIN LATERAL (
            -- the tenant's rows in the index's order, each checked by a probe of its job (a
            -- subplan per row, not a join: the scan stops at the credits whatever the backlog)
            SELECT h.id, h.job_id, h.generation, h.traceparent, h.tenant,
                   GREATEST(COALESCE(h.cost, h.job_cost), 1) AS cost,
                   h.range_first::integer AS range_first,
                   h.range_generation::integer AS range_generation
            FROM (
                SELECT o.*, (
                    SELECT CASE WHEN (o.range_first IS NULL AND j.state = 'queued')
                                  OR (o.range_first IS NOT NULL AND j.state = 'running'
                                      AND EXISTS (
                                          SELECT 1 FROM job_range r WHERE r.job_id = o.job_id
                                          AND r.first_page = o.range_first
                                          AND r.generation = o.range_generation
                                          AND r.job_generation = o.generation
                                          AND r.state = 'queued'))
                                THEN j.dispatch_cost END
                    FROM conversion_job j WHERE j.id = o.job_id AND j.generation = o.generation
                ) AS job_cost
                FROM conversion_outbox o
                WHERE o.published_at IS NULL AND o.tenant = k.tenant
                ORDER BY o.tenant, o.id
            ) h
            WHERE h.job_cost IS NOT NULL
            LIMIT (SELECT n FROM credit)
        ) u
    ), tagged AS (
        SELECT w.*, COALESCE(s.weight, 1) AS weight,
               GREATEST(COALESCE(s.vtime, 0), (SELECT c.vclock FROM dispatch_clock c WHERE c.id = 1))
                   AS base,
               sum(w.cost) OVER (PARTITION BY w.tenant ORDER BY w.id) AS upto,
               COALESCE(b.n, 0) AS busy_n, s.running_cap
        FROM waiting w
        LEFT JOIN tenant_share s ON s.tenant = w.tenant
        LEFT JOIN busy b ON b.tenant = w.tenant
        WHERE w.rn <= (SELECT n FROM credit)
    ), chosen AS (
        SELECT t.*, t.base + (t.upto - t.cost)::float8 / t.weight AS start_tag,
               t.base + t.upto::float8 / t.weight AS finish_tag
        FROM tagged t
        WHERE t.running_cap IS NULL OR t.rn <= t.running_cap - t.busy_n
        ORDER BY t.base + (t.upto - t.cost)::float8 / t.weight, t.id
        LIMIT (SELECT n FROM credit)
    ), marked AS (
        -- a unit another transaction holds (a sweep mid-way, an operator) is skipped, never
        -- waited for: it stays waiting for the next pick
        UPDATE conversion_outbox o SET published_at = now(), publish_attempts = o.publish_attempts + 1
        WHERE o.id IN (
            SELECT l.id FROM conversion_outbox l WHERE l.id IN (SELECT c.id FROM chosen c)
            AND l.published_at IS NULL FOR UPDATE SKIP LOCKED)
        RETURNING o.id
    ), went AS (
        SELECT c.* FROM chosen c JOIN marked m ON m.id = c.id
    ), sent AS (
        UPDATE conversion_job j SET dispatched_at = now(), dispatched_generation = w.generation
        FROM went w WHERE j.id = w.job_id AND w.range_first IS NULL
    ), sent_ranges AS (
        UPDATE job_range r SET dispatched_at = now()
        FROM went w WHERE r.job_id = w.job_id AND r.first_page = w.range_first
          AND r.generation = w.range_generation AND r.state = 'queued'
    ), tenants AS (
        INSERT INTO tenant_share AS s (tenant, weight, vtime, updated_at)
        SELECT w.tenant, 1, max(w.finish_tag), now() FROM went w GROUP BY w.tenant
        ON CONFLICT (tenant) DO UPDATE SET vtime = GREATEST(s.vtime, EXCLUDED.vtime),
            updated_at = EXCLUDED.updated_at
    ), ticked AS (
        UPDATE dispatch_clock k SET vclock = GREATEST(k.vclock, m.start_tag)
        FROM (SELECT max(w.start_tag) AS start_tag FROM went w) m
        WHERE k.id = 1 AND m.start_tag IS NOT NULL
    )
    SELECT w.id, w.job_id, w.generation::integer, w.traceparent::text, w.tenant::text,
           w.cost::integer, w.range_first, w.range_generation
    FROM went w
    ORDER BY w.start_tag, w.id;
END
$fn$;
"""

OUTBOX_TENANT_SQL = """
CREATE FUNCTION quire_outbox_tenant() RETURNS trigger LANGUAGE plpgsql AS $fn$
BEGIN
    NEW.tenant := (SELECT j.tenant FROM conversion_job j WHERE j.id = NEW.job_id);
    RETURN NEW;
END
$fn$;
CREATE TRIGGER conversion_outbox_tenant BEFORE INSERT ON conversion_outbox
    FOR EACH ROW EXECUTE FUNCTION quire_outbox_tenant();
"""

#: Rows that may still be (or become again) dispatch units: those of jobs not finished.
BACKFILL_SQL = """
UPDATE conversion_outbox o SET tenant = j.tenant FROM conversion_job j
WHERE j.id = o.job_id AND o.tenant IS NULL AND j.finished_at IS NULL
"""

DROP_OUTBOX_TENANT_SQL = """
DROP TRIGGER IF EXISTS conversion_outbox_tenant ON conversion_outbox;
DROP FUNCTION IF EXISTS quire_outbox_tenant();
"""


def _forwards(apps, schema_editor):  # type: ignore[no-untyped-def]
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(OUTBOX_TENANT_SQL)
        schema_editor.execute(BACKFILL_SQL)
        schema_editor.execute(FAIR_PICK_SQL)


def _backwards(apps, schema_editor):  # type: ignore[no-untyped-def]
    if schema_editor.connection.vendor == "postgresql":
        from importlib import import_module

        previous = import_module("conversion_jobs.migrations.0018_fair_pick_ranges")
        schema_editor.execute(previous.DROP_PICK)
        schema_editor.execute(previous.FAIR_PICK_SQL)
        schema_editor.execute(DROP_OUTBOX_TENANT_SQL)


class Migration(migrations.Migration):
    dependencies = [
        ("conversion_jobs", "0018_fair_pick_ranges"),
    ]

    operations = [
        migrations.AddField(
            model_name="conversionoutbox",
            name="tenant",
            field=models.CharField(blank=True, editable=False, max_length=64, null=True),
        ),
        migrations.AddIndex(
            model_name="conversionoutbox",
            index=models.Index(
                condition=Q(("published_at__isnull", True)),
                fields=["tenant", "id"],
                name="outbox_waiting_tenant",
            ),
        ),
        migrations.RunPython(_forwards, _backwards),
    ]
