"""execution_audit_event is append-only: the database rejects UPDATE and DELETE.

The one exception is the retention purge of whole chains past their retention
(conversion_jobs/services/retention.py), which sets the transaction-local setting
``quire.audit_purge = 'on'`` (Postgres) and logs the purge (chains and events counted).
SQLite gets the same triggers so the standalone profile keeps the guarantee for UPDATE.
"""

from django.db import migrations

PG_FORWARD = """
CREATE OR REPLACE FUNCTION quire_audit_append_only() RETURNS trigger AS $$
BEGIN
    IF TG_OP = 'DELETE' AND current_setting('quire.audit_purge', true) = 'on' THEN
        RETURN OLD;
    END IF;
    RAISE EXCEPTION 'execution_audit_event is append-only (%% rejected)', TG_OP
        USING ERRCODE = 'insufficient_privilege';
END;
$$ LANGUAGE plpgsql;

CREATE TRIGGER execution_audit_event_append_only
    BEFORE UPDATE OR DELETE ON execution_audit_event
    FOR EACH ROW EXECUTE FUNCTION quire_audit_append_only();
"""
PG_REVERSE = """
DROP TRIGGER IF EXISTS execution_audit_event_append_only ON execution_audit_event;
DROP FUNCTION IF EXISTS quire_audit_append_only();
"""
SQLITE_FORWARD = [
    """CREATE TRIGGER execution_audit_event_no_update BEFORE UPDATE ON execution_audit_event
       BEGIN SELECT RAISE(ABORT, 'execution_audit_event is append-only'); END;""",
]
SQLITE_REVERSE = ["DROP TRIGGER IF EXISTS execution_audit_event_no_update;"]


def forward(apps, schema_editor):
    statements = {"postgresql": [PG_FORWARD], "sqlite": SQLITE_FORWARD}.get(schema_editor.connection.vendor, [])
    for sql in statements:
        schema_editor.execute(sql)


def reverse(apps, schema_editor):
    statements = {"postgresql": [PG_REVERSE], "sqlite": SQLITE_REVERSE}.get(schema_editor.connection.vendor, [])
    for sql in statements:
        schema_editor.execute(sql)


class Migration(migrations.Migration):
    dependencies = [("conversion_jobs", "0001_initial")]
    operations = [migrations.RunPython(forward, reverse)]
