"""The acceptance insert's parameters built directly (``store.jobs.job_insert_params``) are
the values Django's fields would give the driver (``Field.get_db_prep_save``), field by field."""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

import pytest
from django.db import connection
from django.utils import timezone
from django.utils.functional import lazystr

from conversion_jobs.models import ConversionJob
from conversion_jobs.states import State
from conversion_jobs.store.jobs import job_insert_params

#: The parameters are built only for Postgres's acceptance statement (SQLite's acceptance goes
#: through the ORM), and the equality they hold is with the Postgres backend's preparation.
pytestmark = pytest.mark.postgres


def _by_fields(job: ConversionJob) -> dict[str, Any]:
    return {
        f"j_{f.column}": f.get_db_prep_save(getattr(job, f.attname), connection)
        for f in ConversionJob._meta.concrete_fields
    }


def _comparable(value: Any) -> Any:
    """A JSON adapter (psycopg's ``Jsonb``) has no equality: compare what it wraps."""
    return (type(value), getattr(value, "obj", value))


def _job(**overrides: Any) -> ConversionJob:
    now = timezone.now()
    values: dict[str, Any] = dict(
        id=uuid.uuid4(),
        tenant="tenant-a",
        state=State.QUEUED,
        source_key="sources/ab/cd",
        source_sha256="a" * 64,
        source_size=10_240,
        source_media_type="application/pdf",
        output="text",
        options={"pages": "1-3", "nested": {"a": [1, 2]}},
        options_digest="b" * 64,
        policy_version=1,
        max_attempts=5,
        queued_at=now,
        traceparent="00-" + "1" * 32 + "-" + "2" * 16 + "-01",
        password_sealed=None,
        created_at=now,
        updated_at=now,
        audit_seq=1,
        audit_head="c" * 64,
    )
    values.update(overrides)
    return ConversionJob(**values)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"password_sealed": "sealed-value", "options": {}},
        {"options": None, "traceparent": ""},
        # Values a field converts: a lazy string, a bool in an integer column, a string id,
        # a naive datetime (Django makes it aware, with its warning), a numeric string.
        {"tenant": lazystr("tenant-b")},
        {"source_size": True},
        {"id": str(uuid.UUID(int=7))},
        {"source_size": "10240"},
    ],
)
def test_job_insert_params__equal_to_the_fields_preparation(overrides):
    job = _job(**overrides)
    direct = job_insert_params(job)
    prepared = _by_fields(job)
    assert direct.keys() == prepared.keys()
    for name in prepared:
        assert _comparable(direct[name]) == _comparable(prepared[name]), name


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_job_insert_params__a_naive_datetime_goes_through_its_field():
    job = _job(queued_at=dt.datetime(2026, 12, 1, 4, 0))
    assert job_insert_params(job)["j_queued_at"].tzinfo is not None
