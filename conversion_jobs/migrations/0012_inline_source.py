"""Small sources inline in Postgres (ADR 0017, "Session 10: small sources inline"): the table
``inline_source`` holds the bytes of a source up to ``QUIRE_INLINE_SOURCE_MAX_BYTES``, one row
per job, written in the acceptance's own statement.

On Postgres the foreign key is written here with ``ON DELETE CASCADE`` (Django cannot say it;
elsewhere the ORM's cascade does it), so any delete of a job row, not only the ORM's, takes its
source along; and the column is stored EXTERNAL (out of line, uncompressed: documents are
compressed formats already).

Reversing refuses while inline sources exist: ``manage.py inline_sources_store`` first writes
each one to the artifact store and repoints its job (docs/MIGRATION_ROLLBACK.md)."""

import django.db.models.deletion
from django.db import migrations, models


def _postgres_storage(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    schema_editor.execute(
        "ALTER TABLE inline_source ADD CONSTRAINT inline_source_job_fk "
        "FOREIGN KEY (job_id) REFERENCES conversion_job (id) ON DELETE CASCADE"
    )
    schema_editor.execute("ALTER TABLE inline_source ALTER COLUMN content SET STORAGE EXTERNAL")


def _refuse_while_inline(apps, schema_editor):
    inline = apps.get_model("conversion_jobs", "InlineSource")
    if inline.objects.exists():
        raise RuntimeError(
            "inline sources exist: run `manage.py inline_sources_store` before reversing 0012"
        )


class Migration(migrations.Migration):
    dependencies = [
        ("conversion_jobs", "0011_compact_state_checks"),
    ]

    operations = [
        migrations.CreateModel(
            name="InlineSource",
            fields=[
                (
                    "job",
                    models.OneToOneField(
                        on_delete=django.db.models.deletion.CASCADE,
                        db_constraint=False,
                        primary_key=True,
                        related_name="inline_source",
                        serialize=False,
                        to="conversion_jobs.conversionjob",
                    ),
                ),
                ("content", models.BinaryField()),
            ],
            options={
                "db_table": "inline_source",
            },
        ),
        migrations.RunPython(_postgres_storage, migrations.RunPython.noop, elidable=False),
        migrations.RunPython(migrations.RunPython.noop, _refuse_while_inline, elidable=False),
    ]
