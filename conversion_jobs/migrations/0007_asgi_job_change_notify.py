"""NOTIFY quire_job_change '<job id>' whenever a job's state or page progress changes (ADR 0016).

Waiting clients (``?wait=`` long-polls, the SSE event stream) are woken by this notification
instead of polling. A trigger, not application code: every path that bumps ``state_version`` or
the page counters (transitions, sweeps, the admin, a hand-written UPDATE) notifies, and the
notification is delivered only when the transaction commits. Postgres only: the standalone
profile (SQLite) polls.
"""

from django.db import migrations

CHANNEL = "quire_job_change"

CREATE = f"""
CREATE OR REPLACE FUNCTION quire_job_change_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('{CHANNEL}', NEW.id::text);
    RETURN NULL;
END;
$$;
DROP TRIGGER IF EXISTS conversion_job_change_notify ON conversion_job;
CREATE TRIGGER conversion_job_change_notify
    AFTER UPDATE ON conversion_job
    FOR EACH ROW
    WHEN (
        OLD.state_version IS DISTINCT FROM NEW.state_version
        OR OLD.pages_done IS DISTINCT FROM NEW.pages_done
        OR OLD.pages_failed IS DISTINCT FROM NEW.pages_failed
        OR OLD.source_page_count IS DISTINCT FROM NEW.source_page_count
    )
    EXECUTE FUNCTION quire_job_change_notify();
"""

DROP = """
DROP TRIGGER IF EXISTS conversion_job_change_notify ON conversion_job;
DROP FUNCTION IF EXISTS quire_job_change_notify();
"""


def forwards(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(CREATE)


def backwards(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(DROP)


class Migration(migrations.Migration):
    dependencies = [("conversion_jobs", "0006_s3_source_index")]

    operations = [migrations.RunPython(forwards, backwards)]
