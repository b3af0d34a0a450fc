"""Migration 0011 restates three state CHECKs of ``conversion_job`` on Postgres in a compact
form (ADR 0017, session 7): each must allow exactly the rows its model definition allows."""

from __future__ import annotations

import itertools
import uuid
from typing import Any

import pytest
from django.db import IntegrityError, connection, transaction
from django.db.models import Q, Value
from django.utils import timezone

from conversion_jobs.models import ConversionJob
from conversion_jobs.states import State

pytestmark = [pytest.mark.postgres, pytest.mark.django_db]

COMPACT = ("job_terminal_iff_finished", "job_leased_iff_token", "job_published_has_result")


def _definitions() -> dict[str, str]:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint"
            " WHERE conrelid = 'conversion_job'::regclass AND conname = ANY(%s)",
            [list(COMPACT)],
        )
        return dict(cursor.fetchall())


def test_state_checks__stored_compact() -> None:
    definitions = _definitions()
    assert set(definitions) == set(COMPACT)
    for name, definition in definitions.items():
        assert "= ANY ('{" in definition, name  # one array constant, not per-element casts
        assert "character varying" not in definition, name


def _model_allows(values: dict[str, Any]) -> bool:
    """What the model's own ``Meta.constraints`` (Django's rendering) say of these values."""
    checks = [c for c in ConversionJob._meta.constraints if c.name in COMPACT]
    assert len(checks) == len(COMPACT)
    against = {
        name: Value(value, output_field=ConversionJob._meta.get_field(name))
        for name, value in values.items()
    }
    return all(Q(c.condition).check(against) for c in checks)  # type: ignore[attr-defined]


def test_state_checks__same_rows_as_the_model(make_job: Any) -> None:
    job = make_job(State.QUEUED)
    now = timezone.now()
    tried = rejected = 0
    for state, finished, token, result in itertools.product(
        list(State), (None, now), (None, uuid.uuid4()), (False, True)
    ):
        values: dict[str, Any] = {
            "state": state.value,
            "finished_at": finished,
            "lease_token": token,
            "result_key": "results/x" if result else None,
            "result_sha256": "0" * 64 if result else None,
            # The other state CHECKs always satisfied: only the three restated ones decide.
            "next_attempt_at": now,
            "error_code": "invalid_input",
        }
        allowed = _model_allows(values)
        try:
            with transaction.atomic():
                ConversionJob.objects.filter(id=job.id).update(**values)
                raise _Accepted
        except _Accepted:
            accepted = True
        except IntegrityError as error:
            accepted = False
            assert any(name in str(error) for name in COMPACT), error
        assert accepted == allowed, (values, accepted)
        tried += 1
        rejected += not accepted
    assert tried == len(State) * 8
    assert 0 < rejected < tried


class _Accepted(Exception):
    """Raised inside the savepoint so an accepted UPDATE is rolled back too."""
