"""The publish's metrics (the attempt's duration, the terminal counter) are observed once its
transaction commits, both from one ``on_commit`` callback (ADR 0017, session 10), and not at
all when it rolls back."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from django.db import transaction

from conversion_jobs.models import ConversionJob
from conversion_jobs.observability import metrics
from conversion_jobs.services import transitions
from tests.integration.transitions.builders import text_result

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


def _observed() -> tuple[float, float]:
    """(attempt durations observed for "succeeded", jobs finished "succeeded")."""
    durations = metrics.ATTEMPT_DURATION.labels(outcome="succeeded")
    count = sum(
        sample.value
        for family in durations.collect()
        for sample in family.samples
        if sample.name.endswith("_count")
    )
    return count, metrics.TERMINAL.labels(state="succeeded")._value.get()


def test_publish__metrics_after_commit_only(make_job: Callable[..., ConversionJob]) -> None:
    job = make_job()
    claim = transitions.claim(job_id=job.id, generation=1, worker="w")
    assert claim is not None
    before = _observed()
    with transaction.atomic():
        assert transitions.publish_succeeded(lease=claim.lease, result=text_result()) is True
        assert _observed() == before  # nothing before the commit
        transaction.set_rollback(True)
    assert _observed() == before  # rolled back: never observed
    assert transitions.publish_succeeded(lease=claim.lease, result=text_result()) is True
    after = _observed()
    assert (after[0] - before[0], after[1] - before[1]) == (1, 1)
