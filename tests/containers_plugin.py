"""Postgres and RabbitMQ from testcontainers when no URL names them and a Docker engine answers
(docs/TEST_STRATEGY.md §2). Registered with ``-p tests.containers_plugin`` in
pyproject's pytest addopts.

``project/settings.py`` reads ``DATABASE_URL`` / ``CELERY_BROKER_URL`` when pytest-django
imports it in its own (``tryfirst``) ``pytest_load_initial_conftests``, before any conftest or
fixture runs; this plugin's hook is a *wrapper*, so it runs before that one and can export the
URLs of the containers it starts. The choice is ``tests/services.py:service_plan`` (a pure,
unit-tested function):

* a URL set: that service is used (CI and these machines: the running services);
* unset and a Docker engine answers: a container, stopped at the end of the session;
* unset and no Docker (or ``QUIRE_TEST_CONTAINERS=off``): the standalone profile (SQLite + the
  server-less broker), as before.

The RabbitMQ container is the management image with Quire's topology and least-privilege users
applied by ``deploy/rabbitmq/apply.sh`` through ``docker exec`` (``RABBITMQCTL`` /
``RABBITMQ_PLUGINS`` wrappers, which ``tests/e2e/harness.py`` uses too). What still needs the
broker *host* (a local ``rabbitmq-server``): the outage tests' private nodes
(``tests/e2e/private_services.py``) and the separate-hosts test's network links; they fail
with their own message there, they never skip.

Then, in the production profile, the secrets the settings require (``tests/services.py:
secrets_env``): random values for this run, exported before the settings load, so the test
process and the processes its tests start agree on them.
"""

from __future__ import annotations

import os
import stat
import subprocess
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest

POSTGRES_IMAGE = "postgres:16"
RABBITMQ_IMAGE = "rabbitmq:3-management"
#: set to ``off`` to keep the standalone profile on a machine whose Docker engine answers
OPT_OUT = "QUIRE_TEST_CONTAINERS"
REPO = Path(__file__).resolve().parents[1]


def wanted(env: Mapping[str, str], docker_ping: Callable[[], bool]) -> tuple[bool, bool]:
    """(start a Postgres container, start a RabbitMQ container). Docker is asked only when a
    URL is missing and containers are not turned off."""
    from tests.services import service_plan

    if env.get("DATABASE_URL") and env.get("CELERY_BROKER_URL"):
        return False, False
    if env.get(OPT_OUT, "").lower() in ("off", "0", "false", "no"):
        return False, False
    plan = service_plan(
        {k: v for k, v in env.items() if k in ("DATABASE_URL", "CELERY_BROKER_URL")},
        docker_available=docker_ping(),
    )
    return plan.database == "container", plan.broker == "container"


def broker_env(
    *, host: str, amqp_port: int, mgmt_port: int, ctl: Path, vhost: str
) -> dict[str, str]:
    """What the run needs to use a broker container with Quire's topology applied: the
    publisher as the run's broker, both role URLs, and where the harness finds the node."""

    def url(role: str) -> str:
        # the users apply.sh creates (the same variables and defaults as tests/e2e/harness.py)
        user = os.environ.get(f"QUIRE_RMQ_{role.upper()}_USER", f"quire_{role}")
        password = os.environ.get(f"QUIRE_RMQ_{role.upper()}_PASSWORD", f"quire-{role}-dev")
        return f"amqp://{user}:{password}@{host}:{amqp_port}/{vhost}"

    return {
        "CELERY_BROKER_URL": url("publisher"),
        "QUIRE_RMQ_PUBLISHER_URL": url("publisher"),
        "QUIRE_RMQ_WORKER_URL": url("worker"),
        "QUIRE_RMQ_HOST": host,
        "QUIRE_RMQ_PORT": str(amqp_port),
        "QUIRE_RMQ_MGMT_URL": f"http://{host}:{mgmt_port}",
        "QUIRE_RMQ_VHOST": vhost,
        "RABBITMQCTL": str(ctl / "rabbitmqctl"),
        "RABBITMQ_PLUGINS": str(ctl / "rabbitmq-plugins"),
    }


def _start_postgres() -> tuple[Any, dict[str, str]]:
    try:
        from testcontainers.community.postgres import PostgresContainer
    except ImportError:  # testcontainers < 4.13
        from testcontainers.postgres import PostgresContainer

    container = PostgresContainer(
        POSTGRES_IMAGE, username="postgres", password="quire-test", dbname="quire", driver=None
    )
    container.start()
    return container, {"DATABASE_URL": container.get_connection_url(driver=None)}


def _start_rabbitmq(workdir: Path) -> tuple[Any, dict[str, str]]:
    from testcontainers.core.container import DockerContainer
    from testcontainers.core.waiting_utils import wait_for_logs

    container = DockerContainer(RABBITMQ_IMAGE).with_exposed_ports(5672, 15672)
    container.start()
    try:
        wait_for_logs(container, "Server startup complete", timeout=120)
        cid = container.get_wrapped_container().id
        for tool in ("rabbitmqctl", "rabbitmq-plugins"):
            wrapper = workdir / tool
            wrapper.write_text(f'#!/bin/sh\nexec docker exec -i {cid} {tool} "$@"\n')
            wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
        env = broker_env(
            host=container.get_container_host_ip(),
            amqp_port=int(container.get_exposed_port(5672)),
            mgmt_port=int(container.get_exposed_port(15672)),
            ctl=workdir,
            vhost=os.environ.get("QUIRE_RMQ_VHOST", "quire"),
        )
        applied = subprocess.run(
            ["bash", str(REPO / "deploy" / "rabbitmq" / "apply.sh")],
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        if applied.returncode != 0:
            raise RuntimeError(f"apply.sh on the container failed:\n{applied.stderr[-3000:]}")
    except BaseException:
        container.stop()
        raise
    return container, env


@pytest.hookimpl(wrapper=True)
def pytest_load_initial_conftests(
    early_config: pytest.Config, parser: pytest.Parser, args: list[str]
) -> Any:
    from tests.services import docker_available, secrets_env

    want_db, want_broker = wanted(os.environ, docker_available)
    started: list[Any] = []

    def stop() -> None:
        for container in reversed(started):
            container.stop()

    early_config.add_cleanup(stop)
    try:
        if want_db:
            container, env = _start_postgres()
            started.append(container)
            os.environ.update(env)
        if want_broker:
            workdir = Path(tempfile.mkdtemp(prefix="quire-rmq-container-"))
            container, env = _start_rabbitmq(workdir)
            started.append(container)
            os.environ.update(env)
    except Exception as exc:  # a service that cannot start fails the run, never skips
        stop()
        raise pytest.UsageError(
            f"a Docker engine answers but a test service container did not start: {exc}"
        ) from exc
    # Once the profile is known: the production profile's secrets, random for this run.
    os.environ.update(secrets_env(os.environ))
    return (yield)
