"""Partial index ``job_leased`` (state running or cancelling) for the repair sweep
(``recovery.conversion_jobs_repair_if_leaseless``, docs/OPERABILITY.md), so its query reads the
leased jobs only, never the job table's history.

Built ``CONCURRENTLY`` on Postgres (``atomic = False``): the job table is large and takes
writes on every hot path (docs/MIGRATION_ROLLBACK.md §1). Reversible: dropping it loses no
data."""

from django.db import migrations, models


class AddIndexConcurrentlyOnPostgres(migrations.AddIndex):
    """``AddIndex`` whose Postgres build does not block writes; elsewhere a plain index."""

    def database_forwards(self, app_label, schema_editor, from_state, to_state):
        model = to_state.apps.get_model(app_label, self.model_name)
        if self.allow_migrate_model(schema_editor.connection.alias, model):
            if schema_editor.connection.vendor == "postgresql":
                schema_editor.add_index(model, self.index, concurrently=True)
            else:
                schema_editor.add_index(model, self.index)

    def database_backwards(self, app_label, schema_editor, from_state, to_state):
        model = from_state.apps.get_model(app_label, self.model_name)
        if self.allow_migrate_model(schema_editor.connection.alias, model):
            if schema_editor.connection.vendor == "postgresql":
                schema_editor.remove_index(model, self.index, concurrently=True)
            else:
                schema_editor.remove_index(model, self.index)


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("conversion_jobs", "0012_inline_source"),
    ]

    operations = [
        AddIndexConcurrentlyOnPostgres(
            model_name="conversionjob",
            index=models.Index(
                condition=models.Q(("state__in", ["cancelling", "running"])),
                fields=["id"],
                name="job_leased",
            ),
        ),
    ]
