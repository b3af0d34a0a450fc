"""Inline page texts (``page_checkpoint.content``) compressed with lz4 instead of pglz on
Postgres builds that have it (ADR 0017, "Session 5: 200-page text"): a batch of 100 text pages
is written ≈ 3 ms faster, on the publish's critical path. Rows already written keep their
compression (Postgres reads both). Elsewhere (SQLite, a Postgres without lz4) nothing changes."""

from django.db import migrations

_HAS_LZ4 = """
    SELECT 1 FROM pg_settings
    WHERE name = 'default_toast_compression' AND 'lz4' = ANY(enumvals)
"""


def _compression(method: str):
    def apply(apps, schema_editor):
        if schema_editor.connection.vendor != "postgresql":
            return
        with schema_editor.connection.cursor() as cursor:
            cursor.execute(_HAS_LZ4)
            if cursor.fetchone() is None:
                return
        schema_editor.execute(
            f"ALTER TABLE page_checkpoint ALTER COLUMN content SET COMPRESSION {method}"
        )

    return apply


class Migration(migrations.Migration):
    dependencies = [
        ("conversion_jobs", "0009_transitions_audit_head_inline_pages"),
    ]

    operations = [
        migrations.RunPython(_compression("lz4"), _compression("pglz"), elidable=False),
    ]
