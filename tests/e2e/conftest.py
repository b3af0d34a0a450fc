"""e2e fixtures: the RabbitMQ topology (applied once per session), empty business queues before
each test, and a :class:`~tests.e2e.harness.Cluster` of real Procfile processes pointed at the
pytest-django test database and the test's storage directories.

A missing broker or database fails the test; it never skips.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import storage_env
from tests.e2e import harness
from tests.e2e.private_services import PrivatePostgres, PrivateRabbitMQ


def _missing(reason: str) -> None:
    """A missing broker or database fails the test, never skips it (docs/TEST_STRATEGY.md §2)."""
    pytest.fail(f"e2e service missing: {reason}")


@pytest.fixture(scope="session")
def rabbitmq_topology() -> str:
    try:
        return harness.topology_ensure()
    except Exception as exc:
        _missing(f"RabbitMQ topology unavailable: {exc}")
        raise


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[Any]:
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report


@pytest.fixture
def e2e_settings(settings: Any, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Short timings and test faults in this process too (acceptance validates ``_test_fault``,
    install_beat_schedule reads the sweep interval)."""
    monkeypatch.setenv("QUIRE_ENABLE_TEST_FAULTS", "1")
    settings.QUIRE = {
        **settings.QUIRE,
        "LEASE_S": float(harness.TEST_TIMINGS["QUIRE_LEASE_S"]),
        "HEARTBEAT_S": float(harness.TEST_TIMINGS["QUIRE_HEARTBEAT_S"]),
        "SWEEP_INTERVAL_S": float(harness.TEST_TIMINGS["QUIRE_SWEEP_INTERVAL_S"]),
        "BACKOFF_BASE_S": float(harness.TEST_TIMINGS["QUIRE_BACKOFF_BASE_S"]),
        "DISPATCH_TIMEOUT_S": float(harness.TEST_TIMINGS["QUIRE_DISPATCH_TIMEOUT_S"]),
        "PAGE_MAX_ATTEMPTS": int(harness.TEST_TIMINGS["QUIRE_PAGE_MAX_ATTEMPTS"]),
    }
    return dict(harness.TEST_TIMINGS)


@pytest.fixture
def cluster(
    request: pytest.FixtureRequest,
    transactional_db: None,
    rabbitmq_topology: str,
    e2e_settings: dict[str, str],
    settings: Any,
    tmp_path: Path,
) -> Iterator[harness.Cluster]:
    """Real worker / sweeper / beat processes (start them with ``cluster.worker()`` …) on the
    test database, least-privilege broker users, shared storage; all stopped at teardown."""
    from django.core.management import call_command
    from django.db import connection

    base_url = os.environ.get("DATABASE_URL", "")
    if not base_url.startswith("postgres") or not os.environ.get(
        "CELERY_BROKER_URL", ""
    ).startswith("amqp"):
        _missing(
            "the production e2e tests need DATABASE_URL=postgres://… and CELERY_BROKER_URL=amqp://…"
        )
    harness.queues_purge()
    call_command("install_beat_schedule", stdout=open(os.devnull, "w"))

    env = harness.process_env(
        DATABASE_URL=harness.database_url_for(connection.settings_dict["NAME"], base_url),
        **storage_env(settings.QUIRE),
        QUIRE_VAR_DIR=str(tmp_path / "var"),
    )
    logs = tmp_path / "logs"
    logs.mkdir()
    c = harness.Cluster(log_dir=logs, env=env)
    yield c
    c.stop_all()
    refused = [p.name for p in c.procs if "ACCESS_REFUSED" in p.log.read_text(errors="replace")]
    failed = any(
        getattr(getattr(request.node, f"rep_{w}", None), "failed", False) for w in ("setup", "call")
    )
    if failed:
        print(c.tails())
    connection.close()
    # Least privilege holds only if no process ever needed a permission it lacks.
    assert not refused, f"the broker refused an operation to {refused}:\n{c.tails()}"


def role_env(kind: str) -> dict[str, str]:
    """Broker credentials per process role, passed the way production passes them: the
    Procfile maps QUIRE_BROKER_{PUBLISHER,WORKER}_URL onto Celery's read/write URLs per line
    (the conversion worker reads and writes as the worker user; the sweeper consumes as the
    worker and publishes outbox rows as the publisher; beat only publishes)."""
    return {
        "CELERY_BROKER_URL": harness.broker_url(
            "worker" if kind in ("worker", "sweeper") else "publisher"
        ),
        "QUIRE_BROKER_PUBLISHER_URL": harness.broker_url("publisher"),
        "QUIRE_BROKER_WORKER_URL": harness.broker_url("worker"),
    }


@pytest.fixture
def start(cluster: harness.Cluster) -> Callable[..., harness.Proc]:
    """``start("worker")`` / ``start("sweeper")`` / ``start("beat")``, each as its role's
    broker user."""

    def run(kind: str, *, ready: bool = True, **env: str) -> harness.Proc:
        proc = getattr(cluster, kind)(**{**role_env(kind), **env})
        if ready and kind == "worker":
            cluster.ready(proc)
        return proc

    return run


@pytest.fixture
def submit(settings: Any, tmp_path: Path) -> Callable[..., Any]:
    """``submit(pages=…, options=…)`` -> a new job accepted through the service layer (its
    on_commit fast path publishes as the publisher user)."""
    from tests import testdocs

    def make(
        *,
        pages: int = 4,
        output: str = "text",
        options: dict[str, Any] | None = None,
        tenant: str = "tenant-a",
        metadata: dict[str, Any] | None = None,
    ) -> Any:
        src = tmp_path / f"{uuid.uuid4().hex}.pdf"
        salt = uuid.uuid4().hex
        testdocs.make_pdf(src, pages=pages, text_of=lambda n: f"Page {n} {salt}")
        accepted = harness.accept_path(
            src, tenant=tenant, output=output, options=options, metadata=metadata
        )
        assert accepted.created
        return accepted.job

    return make


def _private(service: Any, *steps: Callable[[], object]) -> Iterator[Any]:
    """``service`` (tests/e2e/private_services.py) after ``steps``, destroyed after use; a step
    that fails destroys it and fails the test (a missing service is never a skip)."""
    try:
        for step in steps:
            step()
    except Exception as exc:
        service.destroy()
        pytest.fail(f"the private {type(service).__name__} could not start: {exc}")
    yield service
    service.destroy()


@pytest.fixture(scope="session")
def private_rabbitmq() -> Iterator[PrivateRabbitMQ]:
    """One private RabbitMQ node for the session's tests that stop and start a broker: its
    boot and topology cost 40-50 s on a 2-core runner, once."""
    node = PrivateRabbitMQ()
    yield from _private(node, node.start)


@pytest.fixture
def rabbitmq_node(private_rabbitmq: PrivateRabbitMQ) -> PrivateRabbitMQ:
    """The private node, running, its queues empty (an earlier test may have left it stopped or
    left messages that name its own database's jobs)."""
    node = private_rabbitmq
    if not node.accepts_connections():
        node.start_app()
    harness.queues_purge(node=node.node, port=node.port)
    return node


@pytest.fixture
def private_postgres() -> Iterator[PrivatePostgres]:
    """A private Postgres cluster with an empty database ``quire``, for a test that stops and
    starts it (initdb + start: a few seconds, so each test gets a fresh one)."""
    pg = PrivatePostgres()
    yield from _private(pg, pg.start, lambda: pg.create_database("quire"))
