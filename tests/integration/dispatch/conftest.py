"""Fixtures of the fair-dispatch suites (test_fair.py, test_fair_ranges.py)."""

from __future__ import annotations

from typing import Any

import pytest

from conversion_jobs.models import ConversionJob, ConversionOutbox


@pytest.fixture
def capacity(settings: Any) -> Any:
    def set_to(n: int) -> None:
        settings.QUIRE = {**settings.QUIRE, "FAIR_CAPACITY": n}

    set_to(0)
    return set_to


@pytest.fixture
def unit(make_job: Any) -> Any:
    """A queued job of ``tenant`` with one waiting dispatch unit of ``cost`` page units."""

    def make(tenant: str, cost: int = 1) -> ConversionJob:
        job = make_job(tenant=tenant, dispatch_cost=cost)
        ConversionOutbox.objects.create(job=job, generation=1)
        return job

    return make
