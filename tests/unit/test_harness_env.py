"""The e2e harness refuses to start a production-profile process without a broker URL: it
would fall back to the standalone filesystem broker, which nothing reads in that profile, and
its publishes would vanish (the S3 profile's flaky test_result__streams_back_through_the_web)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e import harness


@pytest.mark.parametrize("kind", ["web", "worker", "sweeper", "beat"])
def test_cluster_start__production_process_without_broker_url_is_refused(
    kind: str, tmp_path: Path
) -> None:
    cluster = harness.Cluster(
        log_dir=tmp_path, env=harness.process_env(DATABASE_URL="postgres://u@127.0.0.1/x")
    )
    with pytest.raises(ValueError, match="CELERY_BROKER_URL"):
        cluster.start(kind)
    assert cluster.procs == []


def test_process_env__passes_the_runs_secrets_on_and_no_other_quire_setting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The children must verify the tokens this process mints and scrape with its metrics
    token (tests/services.py secrets_env), while its own QUIRE_* settings stay behind."""
    from conversion_jobs.secret_policy import SECRET_VARIABLES

    for name in SECRET_VARIABLES:
        monkeypatch.setenv(name, f"{name}-of-this-run")
    monkeypatch.setenv("QUIRE_STORAGE", "s3")
    env = harness.process_env()
    assert {name: env[name] for name in SECRET_VARIABLES} == {
        name: f"{name}-of-this-run" for name in SECRET_VARIABLES
    }
    assert "QUIRE_STORAGE" not in env
