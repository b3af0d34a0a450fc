"""Where the test services come from: a pure function of the environment and Docker."""

from __future__ import annotations

import pytest

from tests.services import ServicePlan, service_plan

PG = "postgres://postgres@127.0.0.1:5432/quire"
AMQP = "amqp://u:p@127.0.0.1:5672/quire"


@pytest.mark.parametrize(
    ("env", "docker", "plan"),
    [
        # the URLs given (these machines): the running services, whatever Docker says
        ({"DATABASE_URL": PG, "CELERY_BROKER_URL": AMQP}, False, ("env", "env", "unused")),
        ({"DATABASE_URL": PG, "CELERY_BROKER_URL": AMQP}, True, ("env", "env", "unused")),
        # nothing given: containers where Docker answers, the standalone profile where not
        ({}, True, ("container", "container", "unused")),
        ({}, False, ("standalone", "standalone", "unused")),
        # S3: an endpoint given is used; else a container, else a local SeaweedFS process
        ({"QUIRE_STORAGE": "s3"}, True, ("container", "container", "container")),
        ({"QUIRE_STORAGE": "s3"}, False, ("standalone", "standalone", "process")),
        (
            {
                "QUIRE_STORAGE": "s3",
                "QUIRE_S3_ENDPOINT_URL": "http://127.0.0.1:1",
                "DATABASE_URL": PG,
            },
            True,
            ("env", "container", "env"),
        ),
        (
            {"QUIRE_STORAGE": "filesystem", "QUIRE_S3_ENDPOINT_URL": "http://x"},
            True,
            ("container", "container", "unused"),
        ),
    ],
)
def test_service_plan__follows_env_then_docker(env, docker, plan):
    assert service_plan(env, docker_available=docker) == ServicePlan(*plan)
