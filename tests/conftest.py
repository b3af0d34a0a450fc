"""Shared fixtures. Services come from DATABASE_URL / CELERY_BROKER_URL; under CI=true a suite
that needs a service fails (never skips) when the service is unreachable.

``QUIRE_STORAGE=s3`` runs every test against a real S3 server: the one ``QUIRE_S3_ENDPOINT_URL``
names (with ``AWS_*`` credentials), else a SeaweedFS started for the session. Each test gets its
own key prefix in the bucket, as it gets its own storage directory on the filesystem backend."""

from __future__ import annotations

import os
import sys
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


#: The converter layer alone (no database, broker or artifact store): what these tests check is
#: the same on every profile, so `.ci/run` runs them in the production pass only.
ENGINE_ONLY_DIR = Path(__file__).parent / "integration" / "converters"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marks every test under ``tests/integration/converters/`` ``engine`` (the modules that
    drive the engines through a job carry the marker themselves)."""
    for item in items:
        if item.path.is_relative_to(ENGINE_ONLY_DIR):
            item.add_marker(pytest.mark.engine)


@pytest.fixture(autouse=True)
def _fair_capacity(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process tests run no worker that would announce its slots, so the fair relay's
    credits (docs/ARCHITECTURE.md §2b) are a fixed 10,000 there: the fast path and the sweep
    publish through the fair pick as they would on an idle system. Tests of the credits
    themselves are marked ``fair_credits`` and set their own capacity."""
    if request.node.get_closest_marker("fair_credits"):
        return
    from django.conf import settings

    monkeypatch.setitem(settings.QUIRE, "FAIR_CAPACITY", 10_000)


@pytest.fixture(autouse=True)
def _slot_clock_fresh() -> None:
    """Each test's units start this thread's slot clock afresh (ADR 0021, "A range yields"):
    the previous test's last unit, of the same tenant a moment ago, does not count. (A module
    that never loaded the runner has no clock: it may run without Django.)"""
    runner = sys.modules.get("conversion_jobs.services.runner")
    if runner is not None:
        runner._slot.__dict__.clear()


def storage_kind() -> str:
    return os.environ.get("QUIRE_STORAGE", "filesystem")


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """The S3 server of this session, as the environment a Quire process needs to use it."""
    from tests import s3server, services

    plan = services.service_plan(
        {**os.environ, "QUIRE_STORAGE": "s3"}, docker_available=services.docker_available()
    )
    if plan.s3 == "env":
        yield {k: v for k, v in os.environ.items() if k.startswith(("QUIRE_S3_", "AWS_"))}
        return
    if plan.s3 == "container":
        container, env = services.s3_container(tmp_path_factory.mktemp("s3container"))
        os.environ.update({k: v for k, v in env.items() if k.startswith("AWS_")})
        yield env
        container.stop()
        return
    try:
        server = s3server.start(tmp_path_factory.mktemp("s3server"))
    except Exception as exc:  # a missing service is never a skip
        pytest.fail(f"QUIRE_STORAGE=s3 but no S3 server could be started: {exc}")
    # credentials for this process's clients and its children (not QUIRE_STORAGE: the profile
    # stays what the run chose)
    os.environ.update({k: v for k, v in server.env().items() if k.startswith("AWS_")})
    yield server.env()
    server.stop()


@pytest.fixture(autouse=True)
def _isolated_storage(
    settings: Any, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> None:
    base = tmp_path_factory.mktemp("quire")
    quire = {
        **settings.QUIRE,
        "STORAGE_DIR": base / "storage",
        "WORK_DIR": base / "work",
        "UPLOAD_DIR": base / "uploads",
    }
    if storage_kind() == "s3":
        env = request.getfixturevalue("s3_server")
        quire["STORAGE"] = "s3"
        quire["S3"] = {
            **quire["S3"],
            "BUCKET": env["QUIRE_S3_BUCKET"],
            "ENDPOINT_URL": env["QUIRE_S3_ENDPOINT_URL"],
            "ADDRESSING_STYLE": env.get("QUIRE_S3_ADDRESSING_STYLE", "path"),
            "PREFIX": f"test-{uuid.uuid4().hex}",
        }
    settings.QUIRE = quire


def storage_env(quire: dict[str, Any]) -> dict[str, str]:
    """The QUIRE_* variables that point a child process at this test's artifact store."""
    env = {
        "QUIRE_STORAGE": quire.get("STORAGE", "filesystem"),
        "QUIRE_STORAGE_DIR": str(quire["STORAGE_DIR"]),
        "QUIRE_WORK_DIR": str(quire["WORK_DIR"]),
        "QUIRE_UPLOAD_DIR": str(quire["UPLOAD_DIR"]),
    }
    if env["QUIRE_STORAGE"] == "s3":
        s3 = quire["S3"]
        env.update(
            QUIRE_S3_BUCKET=s3["BUCKET"],
            QUIRE_S3_ENDPOINT_URL=s3["ENDPOINT_URL"],
            QUIRE_S3_REGION=s3["REGION"],
            QUIRE_S3_ADDRESSING_STYLE=s3["ADDRESSING_STYLE"],
            QUIRE_S3_PREFIX=s3["PREFIX"],
            QUIRE_S3_PRESIGN_TTL_S=str(s3["PRESIGN_TTL_S"]),
        )
    return env


def token(
    *,
    tenant: str = "tenant-a",
    scopes: tuple[str, ...] = SCOPES,
    ttl: int = 600,
    subject: str = "tester",
) -> str:
    return token_mint(tenant=tenant, subject=subject, scopes=list(scopes), ttl_s=ttl)


def metrics_headers() -> dict[str, str]:
    """What a scrape of ``/metrics`` sends: the bearer ``QUIRE_METRICS_TOKEN`` of this run (the
    production profile requires one; the standalone profile has none and leaves it open)."""
    from django.conf import settings

    metrics_token = settings.QUIRE.get("METRICS_TOKEN")
    return {"Authorization": f"Bearer {metrics_token}"} if metrics_token else {}


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
    from tests import testdocs

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
def no_broker_publish(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[Any, ...]]]:
    """Record fast-path publishes instead of sending them (integration tests of the web side
    that must not leave messages in a broker no worker drains)."""
    sent: list[tuple[Any, ...]] = []
    from conversion_jobs.services import broker

    monkeypatch.setattr(
        broker,
        "publish_conversion",
        lambda *, job_id, generation, traceparent, page_range=None: sent.append(
            (str(job_id), generation)
            if page_range is None
            else (str(job_id), generation, page_range.first, page_range.generation)
        ),
    )
    yield sent
