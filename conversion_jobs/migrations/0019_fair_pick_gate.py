"""The fair pick says which of its units a gated message was refused for (ADR 0021, "Idle
latency: the gated fast path").

On an idle system the web's background publisher sends a fresh commit's unit at once, as a
*gated* message, and picks while it travels; the worker's claim of a gated message runs only if
a pick marked the unit sent. A gated claim that finds no mark waits for any pick in progress
(the pick's advisory lock, shared) and, still finding none, records ``last_error_code =
'gate_refused'`` on the unit's waiting row. ``quire_fair_pick`` now returns that as
``out_refused``: a publisher whose speculative message was refused before its pick chose the
unit sends it again. The return type changes, so the function is dropped and created again
(in one transaction with this migration); the order, the credits and the lock are unchanged.
"""

from django.db import migrations

#: ``quire_fair_pick`` of migration 0018 with ``out_refused`` (see the module's docstring).
FAIR_PICK_SQL = """
CREATE FUNCTION quire_fair_pick(
    p_limit integer, p_capacity integer, p_lost_s double precision, p_slot_ttl_s double precision
) RETURNS TABLE (out_id bigint, out_job uuid, out_generation integer, out_traceparent text,
                 out_tenant text, out_cost integer, out_range_first integer,
                 out_range_generation integer, out_refused boolean)
LANGUAGE plpgsql
-- one plan per connection, kept: planning this statement afresh cost ≈ 2 ms a call, the generic
-- plan ≈ 0.25 ms (docs/adr/0021-fair-dispatch.md)
SET plan_cache_mode = force_generic_plan
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
    ), units AS (
        SELECT o.id, o.job_id, o.generation, o.traceparent, j.tenant,
               GREATEST(COALESCE(o.cost, j.dispatch_cost), 1) AS cost,
               NULL::integer AS range_first, NULL::integer AS range_generation,
               o.last_error_code IS NOT DISTINCT FROM 'gate_refused' AS refused
        FROM conversion_outbox o
        JOIN conversion_job j ON j.id = o.job_id AND j.generation = o.generation
        WHERE o.published_at IS NULL AND o.range_first IS NULL AND j.state = 'queued'
        UNION ALL
        SELECT o.id, o.job_id, o.generation, o.traceparent, j.tenant,
               GREATEST(COALESCE(o.cost, j.dispatch_cost), 1) AS cost,
               o.range_first::integer, o.range_generation::integer, false AS refused
        FROM conversion_outbox o
        JOIN conversion_job j ON j.id = o.job_id AND j.generation = o.generation
        JOIN job_range r ON r.job_id = o.job_id AND r.first_page = o.range_first
             AND r.generation = o.range_generation AND r.job_generation = o.generation
        WHERE o.published_at IS NULL AND o.range_first IS NOT NULL AND j.state = 'running'
          AND r.state = 'queued'
    ), waiting AS (
        SELECT u.*, row_number() OVER (PARTITION BY u.tenant ORDER BY u.id) AS rn
        FROM units u
        WHERE (SELECT n FROM credit) > 0
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
           w.cost::integer, w.range_first, w.range_generation, w.refused
    FROM went w
    ORDER BY w.start_tag, w.id;
END
$fn$;
"""

DROP_PICK = (
    "DROP FUNCTION IF EXISTS quire_fair_pick(integer, integer, double precision, double precision)"
)


def _forwards(apps, schema_editor):  # type: ignore[no-untyped-def]
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(DROP_PICK)
        schema_editor.execute(FAIR_PICK_SQL)


def _backwards(apps, schema_editor):  # type: ignore[no-untyped-def]
    if schema_editor.connection.vendor == "postgresql":
        from importlib import import_module

        previous = import_module("conversion_jobs.migrations.0018_fair_pick_ranges")
        schema_editor.execute(DROP_PICK)
        schema_editor.execute(previous.FAIR_PICK_SQL)


class Migration(migrations.Migration):
    dependencies = [
        ("conversion_jobs", "0018_fair_pick_ranges"),
    ]

    operations = [migrations.RunPython(_forwards, _backwards)]
