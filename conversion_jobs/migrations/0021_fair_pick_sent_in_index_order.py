"""The fair pick counts sent, unclaimed jobs in ``job_dispatched_queued``'s order (ADR 0021,
"Sent at acceptance": a plan made before the table had statistics).

``quire_fair_pick`` runs a generic plan (``plan_cache_mode = force_generic_plan``), kept for
the connection. Planned while ``conversion_job`` had never been analyzed (a new deployment),
its busy count of sent, unclaimed jobs chose ``job_queued_since`` (every queued job, the
dispatch predicate as a filter) over ``job_dispatched_queued`` (only the sent ones): both cost
the same on an empty table. Each pick then read the whole queued backlog until autovacuum's
first analyze. Read as a sorted subquery, only ``job_dispatched_queued`` gives that order for
free, whatever the statistics. Nothing else changes (``CREATE OR REPLACE``, same signature and
result); ``store.fair.ADMIT`` counts the same jobs the same way.
"""

from importlib import import_module

from django.db import migrations

_PREVIOUS = import_module("conversion_jobs.migrations.0020_fair_pick_tenant_heads")

#: The busy count's branch of sent, unclaimed jobs as migration 0020 wrote it, and now.
_SENT_0020 = """            SELECT j.tenant FROM conversion_job j
            WHERE j.state = 'queued' AND j.dispatched_at IS NOT NULL
              AND j.dispatched_generation = j.generation
              AND j.dispatched_at > now() - make_interval(secs => p_lost_s)
"""
_SENT = """            -- sent, not claimed: in job_dispatched_queued's order, so that a plan made before
            -- the table had statistics reads that index, not every queued job (migration 0021)
            SELECT s.tenant FROM (
                SELECT j.tenant, j.dispatched_at FROM conversion_job j
                WHERE j.state = 'queued' AND j.dispatched_generation = j.generation
                  AND j.dispatched_at > now() - make_interval(secs => p_lost_s)
                ORDER BY j.dispatched_at) s
"""
if _PREVIOUS.FAIR_PICK_SQL.count(_SENT_0020) != 1:
    raise LookupError("migration 0020's busy count is not where this migration expects it")

#: The fair relay's pick (docs/ARCHITECTURE.md §2b, ADR 0021): migration 0020's, with ``_SENT``.
FAIR_PICK_SQL = _PREVIOUS.FAIR_PICK_SQL.replace(_SENT_0020, _SENT)


def _forwards(apps, schema_editor):  # type: ignore[no-untyped-def]
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(FAIR_PICK_SQL)


def _backwards(apps, schema_editor):  # type: ignore[no-untyped-def]
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(_PREVIOUS.FAIR_PICK_SQL)


class Migration(migrations.Migration):
    dependencies = [
        ("conversion_jobs", "0020_fair_pick_tenant_heads"),
    ]

    operations = [
        migrations.RunPython(_forwards, _backwards),
    ]
