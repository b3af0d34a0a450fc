"""``backend``: the test runs once per artifact-store backend (the filesystem, and a real S3
server), whichever profile the suite runs in."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from tests.integration.execution.jobkit import fast_quire  # noqa: F401


def _use_s3(request: pytest.FixtureRequest, settings: Any) -> None:
    env = request.getfixturevalue("s3_server")
    settings.QUIRE = {
        **settings.QUIRE,
        "STORAGE": "s3",
        "S3": {
            **settings.QUIRE["S3"],
            "BUCKET": env["QUIRE_S3_BUCKET"],
            "ENDPOINT_URL": env["QUIRE_S3_ENDPOINT_URL"],
            "ADDRESSING_STYLE": env.get("QUIRE_S3_ADDRESSING_STYLE", "path"),
            "PREFIX": f"test-{uuid.uuid4().hex}",
        },
    }


@pytest.fixture(params=["filesystem", "s3"])
def backend(request: pytest.FixtureRequest, settings: Any) -> str:
    if request.param == "s3":
        _use_s3(request, settings)
    else:
        settings.QUIRE = {**settings.QUIRE, "STORAGE": "filesystem"}
    return str(request.param)


@pytest.fixture
def s3_store(request: pytest.FixtureRequest, settings: Any) -> None:
    """The S3 backend only (behaviour the filesystem has no counterpart of)."""
    _use_s3(request, settings)
