"""Shared fixtures. Services come from DATABASE_URL / CELERY_BROKER_URL; under CI=true a suite
that needs a service fails (never skips) when the service is unreachable."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from django.utils import timezone

from conversion_jobs.api.auth import SCOPES, token_mint


def pytest_configure(config: pytest.Config) -> None:
    url = os.environ.get("DATABASE_URL", "")
    if url.startswith("postgres"):
        import psycopg

        try:
            psycopg.connect(url.rsplit("/", 1)[0] + "/postgres", connect_timeout=5).close()
        except Exception as exc:  # fail loudly: a missing service is never a skip
            raise pytest.UsageError(
                f"DATABASE_URL is set but Postgres is unreachable: {exc}"
            ) from exc


@pytest.fixture(autouse=True)
def _isolated_storage(settings: Any, tmp_path_factory: pytest.TempPathFactory) -> None:
    base = tmp_path_factory.mktemp("quire")
    settings.QUIRE = {**settings.QUIRE, "STORAGE_DIR": base / "storage", "WORK_DIR": base / "work"}


def token(
    *,
    tenant: str = "tenant-a",
    scopes: tuple[str, ...] = SCOPES,
    ttl: int = 600,
    subject: str = "tester",
) -> str:
    return token_mint(tenant=tenant, subject=subject, scopes=list(scopes), ttl_s=ttl)


@pytest.fixture
def api() -> Callable[..., Any]:
    """``api(tenant=…, scopes=…)`` -> a DRF APIClient with a bearer token."""
    from rest_framework.test import APIClient

    def make(**kwargs: Any) -> APIClient:
        client = APIClient()
        client.credentials(HTTP_AUTHORIZATION=f"Bearer {token(**kwargs)}")
        return client

    return make


@pytest.fixture
def pdf_file(tmp_path: Path) -> Callable[..., Path]:
    from conversion_jobs.converters import testdocs

    def make(pages: int = 2, name: str = "doc.pdf", salt: str = "") -> Path:
        path = tmp_path / f"{uuid.uuid4().hex}-{name}"
        testdocs.make_pdf(path, pages=pages, text_of=lambda n: f"Page {n} {salt}")
        return path

    return make


@pytest.fixture
def make_job() -> Callable[..., Any]:
    """Factory: insert a job in any state, with the columns its state's constraints need."""
    from conversion_jobs.models import ConversionJob
    from conversion_jobs.states import LEASED_STATES, TERMINAL_STATES, State

    def make(state: str = State.QUEUED, tenant: str = "tenant-a", **fields: Any) -> ConversionJob:
        sha = fields.pop("source_sha256", uuid.uuid4().hex * 2)
        defaults: dict[str, Any] = {
            "tenant": tenant,
            "state": state,
            "source_key": f"sources/{sha[:2]}/{sha}",
            "source_sha256": sha,
            "source_size": 10,
            "source_media_type": "application/pdf",
            "output": "text",
            "options": {"dpi": None, "pages": None, "allow_partial": True},
            "options_digest": uuid.uuid4().hex,
            "queued_at": timezone.now(),
        }
        if state in TERMINAL_STATES:
            defaults["finished_at"] = timezone.now()
        if state in LEASED_STATES:
            defaults["lease_token"] = uuid.uuid4()
        if state == State.RETRY_WAIT:
            defaults["next_attempt_at"] = timezone.now()
        if state in (State.SUCCEEDED, State.PARTIAL):
            defaults.update(result_key="results/x", result_sha256="0" * 64)
        if state == State.FAILED:
            defaults["error_code"] = "invalid_input"
        defaults.update(fields)
        return ConversionJob.objects.create(**defaults)

    return make


@pytest.fixture
def no_broker_publish(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, int]]]:
    """Record fast-path publishes instead of sending them (integration tests of the web side
    that must not leave messages in a broker no worker drains)."""
    sent: list[tuple[str, int]] = []
    from conversion_jobs.services import dispatch

    monkeypatch.setattr(
        dispatch,
        "publish_conversion",
        lambda *, job_id, generation, traceparent: sent.append((str(job_id), generation)),
    )
    yield sent
