"""A child's setup carries the limits as ``asdict`` would give them (built without its deep
copies: ADR 0017, session 10)."""

from __future__ import annotations

from dataclasses import asdict, fields

from conversion_jobs.converters.base import Limits
from conversion_jobs.converters.isolation import _limits_setup


def test_limits_setup__every_field_as_asdict() -> None:
    for limits in (Limits(), Limits(max_pages=3, page_timeout_s=1.5, memory_bytes=10**9)):
        setup = _limits_setup(limits)
        assert setup == asdict(limits)
        assert list(setup) == [f.name for f in fields(Limits)]
        assert all(type(setup[k]) is type(v) for k, v in asdict(limits).items())
    assert _limits_setup(Limits()) is not _limits_setup(Limits())  # a new dict each time
