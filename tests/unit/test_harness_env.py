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
