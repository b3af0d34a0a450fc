"""The containers plugin's choice (tests/containers_plugin.py): a URL set is used, else a
Docker engine that answers gets a container, else the standalone profile stays. No Docker
needed: whether an engine answers is the argument."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.containers_plugin import broker_env, wanted

PG = "postgres://postgres@127.0.0.1:5432/quire"
AMQP = "amqp://u:p@127.0.0.1:5672/quire"


class Ping:
    """Whether a Docker engine answers, and whether anyone asked."""

    def __init__(self, answers: bool) -> None:
        self.answers, self.asked = answers, 0

    def __call__(self) -> bool:
        self.asked += 1
        return self.answers


@pytest.mark.parametrize(
    ("env", "docker", "want", "asks"),
    [
        # both URLs set (CI, these machines): the running services; Docker is not even asked
        ({"DATABASE_URL": PG, "CELERY_BROKER_URL": AMQP}, True, (False, False), 0),
        ({"DATABASE_URL": PG, "CELERY_BROKER_URL": AMQP}, False, (False, False), 0),
        # both unset: containers where Docker answers, the standalone profile where not
        ({}, True, (True, True), 1),
        ({}, False, (False, False), 1),
        # one set: only the other one comes from a container
        ({"DATABASE_URL": PG}, True, (False, True), 1),
        ({"CELERY_BROKER_URL": AMQP}, True, (True, False), 1),
        ({"DATABASE_URL": PG}, False, (False, False), 1),
        # an empty URL counts as unset
        ({"DATABASE_URL": "", "CELERY_BROKER_URL": ""}, True, (True, True), 1),
        # QUIRE_TEST_CONTAINERS=off keeps the standalone profile on a Docker machine
        ({"QUIRE_TEST_CONTAINERS": "off"}, True, (False, False), 0),
        ({"QUIRE_TEST_CONTAINERS": "on"}, True, (True, True), 1),
    ],
)
def test_wanted__url_then_docker_then_standalone(env, docker, want, asks):
    ping = Ping(docker)
    assert wanted(env, ping) == want
    assert ping.asked == asks


def test_broker_env__publisher_is_the_runs_broker_and_the_harness_finds_the_node(tmp_path: Path):
    env = broker_env(host="10.0.0.5", amqp_port=32801, mgmt_port=32802, ctl=tmp_path, vhost="q")
    assert env["CELERY_BROKER_URL"] == env["QUIRE_RMQ_PUBLISHER_URL"]
    assert env["CELERY_BROKER_URL"].startswith("amqp://quire_publisher:")
    assert env["CELERY_BROKER_URL"].endswith("@10.0.0.5:32801/q")
    assert env["QUIRE_RMQ_WORKER_URL"].startswith("amqp://quire_worker:")
    assert (env["QUIRE_RMQ_HOST"], env["QUIRE_RMQ_PORT"]) == ("10.0.0.5", "32801")
    assert env["QUIRE_RMQ_MGMT_URL"] == "http://10.0.0.5:32802"
    assert env["RABBITMQCTL"] == str(tmp_path / "rabbitmqctl")
    assert env["RABBITMQ_PLUGINS"] == str(tmp_path / "rabbitmq-plugins")


def test_bare_pytest_script__imports_the_plugin_without_the_checkout_on_sys_path(tmp_path: Path):
    """``-p tests.containers_plugin`` (addopts) is imported before any conftest: the bare
    ``pytest`` script, run from outside the checkout without PYTHONPATH, finds it through
    pyproject's ``pythonpath`` (``python -m pytest`` would put the working directory there)."""
    repo = Path(__file__).resolve().parents[2]
    unset = ("PYTHONPATH", "DATABASE_URL", "CELERY_BROKER_URL")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    env["QUIRE_TEST_CONTAINERS"] = "off"  # the standalone profile: nothing to start
    run = subprocess.run(
        [
            str(Path(sys.executable).parent / "pytest"),
            "--collect-only",
            "-q",
            "--trace-config",
            "-p",
            "no:cacheprovider",
            str(repo / "tests/unit/test_containers_plugin.py"),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"tests.containers_plugin' from '{repo / 'tests/containers_plugin.py'}'" in run.stdout
