"""The three state CHECKs of ``conversion_job`` that name sets of states, restated on Postgres
in a form the server reads faster; the same names, the same rows allowed (ADR 0017, "Session 7:
Postgres CPU per one-page job").

Postgres evaluates every CHECK of a table on every INSERT and UPDATE of a row, and it turns
each constraint's stored expression (``pg_constraint.conbin``, a node tree written as text)
back into a tree once per statement execution, prepared statements included. A profile of the
claim and publish statements (``perf`` on the backend) put ``ExecConstraints`` at ≈ 15 % of
the backend's CPU, two thirds of that the text's parsing. Django writes ``state IN ('a', 'b')``,
which Postgres stores as an array expression of per-element casts: 3,421, 2,723 and 1,591
characters for these three. ``state::text = ANY ('{a,b}'::text[])`` is one constant (1,006,
926 and 1,137), and "in the set ⇔ the column is set" is written as one equality of two
booleans (``state`` is NOT NULL, an ``IS [NOT] NULL`` is never NULL: the same rows pass).

Postgres only, and only the database's text: the model's ``Meta.constraints`` (Django's state,
SQLite's tables) are unchanged, and ``tests/integration/test_state_checks.py`` holds each
compact constraint to its model definition, state by state. Reversible: backwards restores the
definitions Django writes.
"""

from django.db import migrations

COMPACT = {
    "job_terminal_iff_finished": (
        "(state::text = ANY ('{cancelled,failed,partial,succeeded}'::text[]))"
        " = (finished_at IS NOT NULL)"
    ),
    "job_leased_iff_token": (
        "(state::text = ANY ('{cancelling,running}'::text[])) = (lease_token IS NOT NULL)"
    ),
    "job_published_has_result": (
        "NOT (state::text = ANY ('{succeeded,partial}'::text[]))"
        " OR (result_key IS NOT NULL AND result_sha256 IS NOT NULL)"
    ),
}

#: As Django's schema editor writes them from 0001's ``CheckConstraint``s.
DJANGO = {
    "job_terminal_iff_finished": (
        "(state IN ('cancelled', 'failed', 'partial', 'succeeded') AND finished_at IS NOT NULL)"
        " OR (NOT (state IN ('cancelled', 'failed', 'partial', 'succeeded'))"
        " AND finished_at IS NULL)"
    ),
    "job_leased_iff_token": (
        "(state IN ('cancelling', 'running') AND lease_token IS NOT NULL)"
        " OR (NOT (state IN ('cancelling', 'running')) AND lease_token IS NULL)"
    ),
    "job_published_has_result": (
        "NOT (state IN ('succeeded', 'partial'))"
        " OR (result_key IS NOT NULL AND result_sha256 IS NOT NULL)"
    ),
}


def _restate(schema_editor, definitions: dict[str, str]) -> None:
    if schema_editor.connection.vendor != "postgresql":
        return
    for name, check in definitions.items():
        # One ALTER TABLE: the table is never without the invariant, and the new CHECK is
        # validated against every existing row under the same lock.
        schema_editor.execute(
            f"ALTER TABLE conversion_job DROP CONSTRAINT {name}, "
            f"ADD CONSTRAINT {name} CHECK ({check})"
        )


def forwards(apps, schema_editor):
    _restate(schema_editor, COMPACT)


def backwards(apps, schema_editor):
    _restate(schema_editor, DJANGO)


class Migration(migrations.Migration):
    dependencies = [("conversion_jobs", "0010_page_content_lz4")]

    operations = [migrations.RunPython(forwards, backwards)]
