"""execution_audit_event is append-only and hash-chained; verify_audit finds tampering."""

from __future__ import annotations

import io

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import DatabaseError, connection, transaction

from conversion_jobs.models import ExecutionAuditEvent
from conversion_jobs.services.audit import GENESIS, audit_chain_verify, audit_event_append

postgres = pytest.mark.postgres


def _needs_postgres() -> None:
    if connection.vendor != "postgresql":
        pytest.fail("this test needs the production profile (DATABASE_URL=postgres://…)")


def _chain(job_id, n: int = 3) -> list[ExecutionAuditEvent]:
    with transaction.atomic():
        for i in range(n):
            audit_event_append(job_id=job_id, event_type=f"e{i}", generation=1, details={"i": i})
    return list(ExecutionAuditEvent.objects.filter(job_id=job_id).order_by("seq"))


def _verify() -> tuple[str, str | None]:
    out = io.StringIO()
    try:
        call_command("verify_audit", stdout=out)
    except CommandError as exc:
        return out.getvalue(), str(exc)
    return out.getvalue(), None


@pytest.mark.django_db
def test_audit_event_append__chains_per_job(make_job):
    a, b = make_job(), make_job()
    events_a, events_b = _chain(a.id), _chain(b.id, 2)
    assert [e.seq for e in events_a] == [1, 2, 3]
    assert events_a[0].prev_hash == GENESIS == events_b[0].prev_hash
    assert [e.prev_hash for e in events_a[1:]] == [e.hash for e in events_a[:-1]]
    assert audit_chain_verify() == (5, [])


@pytest.mark.django_db(transaction=True)
def test_audit_event_append__outside_a_transaction_is_refused(make_job):
    job = make_job()
    with pytest.raises(RuntimeError):
        audit_event_append(job_id=job.id, event_type="x")
    assert not ExecutionAuditEvent.objects.exists()


@pytest.mark.django_db
def test_verify_audit__clean_chains_pass(make_job):
    for _ in range(3):
        _chain(make_job().id)
    out, error = _verify()
    assert error is None
    assert "ok: 9 event(s), no breaks" in out


@pytest.mark.django_db
def test_audit_event__update_is_rejected(make_job):
    """Postgres and SQLite both carry the UPDATE trigger."""
    event = _chain(make_job().id, 1)[0]
    with pytest.raises(DatabaseError), transaction.atomic():
        ExecutionAuditEvent.objects.filter(id=event.id).update(event_type="forged")
    assert ExecutionAuditEvent.objects.get(id=event.id).event_type == "e0"


@postgres
@pytest.mark.django_db
def test_audit_event__delete_is_rejected_on_postgres(make_job):
    _needs_postgres()
    event = _chain(make_job().id, 1)[0]
    with pytest.raises(DatabaseError, match="append-only"), transaction.atomic():
        ExecutionAuditEvent.objects.filter(id=event.id).delete()
    with (
        pytest.raises(DatabaseError, match="append-only"),
        transaction.atomic(),
        connection.cursor() as cursor,
    ):
        cursor.execute("UPDATE execution_audit_event SET details = '{}' WHERE id = %s", [event.id])
    assert ExecutionAuditEvent.objects.filter(id=event.id).exists()


@postgres
@pytest.mark.django_db
def test_audit_event__retention_purge_path_may_delete_on_postgres(make_job):
    _needs_postgres()
    event = _chain(make_job().id, 1)[0]
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SET LOCAL quire.audit_purge = 'on'")
        cursor.execute("DELETE FROM execution_audit_event WHERE id = %s", [event.id])
    assert not ExecutionAuditEvent.objects.filter(id=event.id).exists()


def _tamper(sql: str, params: list) -> None:
    """Bypass the append-only trigger inside the test's transaction (rolled back afterwards)."""
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SET LOCAL session_replication_role = replica")
            cursor.execute(sql, params)
            cursor.execute("SET LOCAL session_replication_role = origin")
        else:  # SQLite DDL is transactional: the dropped trigger returns with the rollback
            cursor.execute("DROP TRIGGER execution_audit_event_no_update")
            cursor.execute(sql, params)


@pytest.mark.django_db
def test_verify_audit__names_the_tampered_event(make_job):
    clean, tampered = make_job(), make_job()
    _chain(clean.id)
    events = _chain(tampered.id)
    _tamper(
        "UPDATE execution_audit_event SET details = %s WHERE id = %s", ['{"i": 99}', events[1].id]
    )
    out, error = _verify()
    assert error is not None and "break" in error
    assert f"BREAK job={tampered.id} event={events[1].id} seq=2: hash mismatch" in out
    assert str(clean.id) not in out


@pytest.mark.django_db
def test_verify_audit__detects_a_removed_event(make_job):
    job = make_job()
    events = _chain(job.id)
    if connection.vendor == "postgresql":
        _tamper("DELETE FROM execution_audit_event WHERE id = %s", [events[1].id])
    else:
        with connection.cursor() as cursor:
            cursor.execute("DELETE FROM execution_audit_event WHERE id = %s", [events[1].id])
    out, error = _verify()
    assert error is not None
    assert f"BREAK job={job.id} event={events[2].id} seq=3: sequence gap" in out


@pytest.mark.django_db
def test_verify_audit__one_job_option(make_job):
    a, b = make_job(), make_job()
    _chain(a.id)
    events = _chain(b.id)
    _tamper("UPDATE execution_audit_event SET actor = %s WHERE id = %s", ["mallory", events[0].id])
    out = io.StringIO()
    call_command("verify_audit", "--job", str(a.id), stdout=out)
    assert "ok: 3 event(s)" in out.getvalue()
    with pytest.raises(CommandError):
        call_command("verify_audit", "--job", str(b.id), stdout=io.StringIO())
