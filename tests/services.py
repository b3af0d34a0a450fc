"""Where the test services come from (docs/TEST_STRATEGY.md §2): a URL in the environment wins;
otherwise a Docker engine that answers gets a container (testcontainers); otherwise the local
fallback — the standalone profile for Postgres and RabbitMQ, a SeaweedFS process for S3."""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SEAWEEDFS_IMAGE = "chrislusf/seaweedfs:latest"


@dataclass(frozen=True)
class ServicePlan:
    database: str  # "env" | "container" | "standalone"
    broker: str  # "env" | "container" | "standalone"
    s3: str  # "env" | "container" | "process" | "unused"


def service_plan(env: Mapping[str, str], *, docker_available: bool) -> ServicePlan:
    """A pure function of the environment and whether a Docker engine answers."""

    def pick(var: str) -> str:
        if env.get(var):
            return "env"
        return "container" if docker_available else "standalone"

    if env.get("QUIRE_STORAGE", "filesystem") != "s3":
        s3 = "unused"
    elif env.get("QUIRE_S3_ENDPOINT_URL"):
        s3 = "env"
    else:
        s3 = "container" if docker_available else "process"
    return ServicePlan(database=pick("DATABASE_URL"), broker=pick("CELERY_BROKER_URL"), s3=s3)


def docker_available() -> bool:
    try:
        import docker

        docker.from_env(timeout=2).ping()
        return True
    except Exception:
        return False


def s3_container(workdir: Path) -> tuple[Any, dict[str, str]]:
    """SeaweedFS in a container with one identity (private bucket); returns the container (stop
    it) and the environment a Quire process needs."""
    from testcontainers.core.container import DockerContainer
    from testcontainers.core.waiting_utils import wait_for_logs

    access, secret = "quire" + secrets.token_hex(6), secrets.token_urlsafe(24)
    config = workdir / "s3.json"
    config.write_text(
        json.dumps(
            {
                "identities": [
                    {
                        "name": "quire",
                        "credentials": [{"accessKey": access, "secretKey": secret}],
                        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                    }
                ]
            }
        )
    )
    container = (
        DockerContainer(SEAWEEDFS_IMAGE)
        .with_command("mini -dir=/data -s3.config=/etc/quire-s3.json -bucket=quire")
        .with_volume_mapping(str(config), "/etc/quire-s3.json", "ro")
        .with_exposed_ports(8333)
    )
    container.start()
    wait_for_logs(container, "S3", timeout=60)
    host, port = container.get_container_host_ip(), container.get_exposed_port(8333)
    return container, {
        "QUIRE_STORAGE": "s3",
        "QUIRE_S3_ENDPOINT_URL": f"http://{host}:{port}",
        "QUIRE_S3_BUCKET": "quire",
        "QUIRE_S3_REGION": "us-east-1",
        "QUIRE_S3_ADDRESSING_STYLE": "path",
        "AWS_ACCESS_KEY_ID": access,
        "AWS_SECRET_ACCESS_KEY": secret,
    }


def secrets_env(env: Mapping[str, str]) -> dict[str, str]:
    """Fresh random values, for this run only, for every secret the production profile requires
    and ``env`` lacks (conversion_jobs/secret_policy.py refuses development values there).
    Exported by tests/containers_plugin.py before the settings load, so this process and every
    process a test starts share them; nothing in the standalone profile (its development values
    stay)."""
    from conversion_jobs.secret_policy import generated, production_profile

    if not production_profile(env):
        return {}
    return {name: value for name, value in generated().items() if not env.get(name)}
