"""Stepping aside (ADR 0022): an attempt in a long LibreOffice conversion hands its slot back.

``conversion_job.aside_lease`` is the lease of an attempt that stepped aside; while it equals
the job's ``lease_token`` the fair pick's busy count skips the job, so the relay sends another
unit to the worker's spare pool process. A new claim's token ends it without a write. Only the
busy count's branch of running jobs changes (``CREATE OR REPLACE``, same signature and result).
"""

from importlib import import_module

from django.db import migrations, models

_PREVIOUS = import_module("conversion_jobs.migrations.0021_fair_pick_sent_in_index_order")

#: The busy count's branch of running jobs as migration 0021 has it, and now.
_RUNNING_0021 = """            SELECT j.tenant FROM conversion_job j WHERE j.state IN ('running', 'cancelling')
              AND NOT EXISTS"""
_RUNNING = """            SELECT j.tenant FROM conversion_job j WHERE j.state IN ('running', 'cancelling')
              -- an attempt that stepped aside has handed its slot back (migration 0022)
              AND j.aside_lease IS DISTINCT FROM j.lease_token
              AND NOT EXISTS"""
if _PREVIOUS.FAIR_PICK_SQL.count(_RUNNING_0021) != 1:
    raise LookupError("migration 0021's busy count is not where this migration expects it")

#: The fair relay's pick (docs/ARCHITECTURE.md §2b, ADR 0021): migration 0021's, with
#: ``_RUNNING``.
FAIR_PICK_SQL = _PREVIOUS.FAIR_PICK_SQL.replace(_RUNNING_0021, _RUNNING)


def _forwards(apps, schema_editor):  # type: ignore[no-untyped-def]
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(FAIR_PICK_SQL)


def _backwards(apps, schema_editor):  # type: ignore[no-untyped-def]
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(_PREVIOUS.FAIR_PICK_SQL)


class Migration(migrations.Migration):
    dependencies = [
        ("conversion_jobs", "0021_fair_pick_sent_in_index_order"),
    ]

    operations = [
        migrations.AddField(
            model_name="conversionjob",
            name="aside_lease",
            field=models.UUIDField(blank=True, null=True),
        ),
        migrations.RunPython(_forwards, _backwards),
    ]
