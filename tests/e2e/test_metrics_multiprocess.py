"""e2e: metrics from the first scrape, aggregated across real processes (docs/OPERABILITY.md §8).

Two web processes (the Procfile's ``web`` with WEB_CONCURRENCY=2) and a worker share one
PROMETHEUS_MULTIPROC_DIR, emptied by the release's ``metrics_reset`` first, as in a deploy. The
first scrape shows every documented counter and histogram at zero; after jobs ran, one scrape
adds up both web processes and the worker; a ``release`` while they run keeps every series.
"""

from __future__ import annotations

import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conversion_jobs.models import ConversionJob
from tests.e2e import harness
from tests.e2e.conftest import role_env
from tests.e2e.webproc import Web, start_web

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

#: docs/OPERABILITY.md §8's list, by metric family (counters and histograms per process, gauges from
#: the DB).
DOCUMENTED = [
    "quire_admissions_total",
    "quire_jobs",
    "quire_queue_depth",
    "quire_queue_oldest_age_seconds",
    "quire_outbox_backlog",
    "quire_outbox_oldest_age_seconds",
    "quire_leases",
    "quire_attempt_duration_seconds_count",
    "quire_retry_delay_seconds_count",
    "quire_idempotent_replays_total",
    "quire_duplicate_deliveries_total",
    "quire_cancellations_total",
    "quire_cancellation_latency_seconds_count",
    "quire_recoveries_total",
    "quire_dead_letters_total",
    "quire_capacity_utilisation_ratio",
    "quire_sweep_last_success_timestamp_seconds",
]
SAMPLE = re.compile(r"^(?P<name>[a-z_]+)(?:\{(?P<labels>[^}]*)\})? (?P<value>\S+)$")


def scrape(web: Web) -> dict[str, float]:
    """``{'name{labels}': value}`` of one scrape (labels as exposed)."""
    response = web.metrics()
    assert response.status_code == 200, response.text[:300]
    out = {}
    for line in response.text.splitlines():
        match = SAMPLE.match(line)
        if match and not line.startswith("#"):
            out[f"{match['name']}{{{match['labels'] or ''}}}"] = float(match["value"])
    return out


def families(values: dict[str, float]) -> set[str]:
    return {key.split("{", 1)[0] for key in values}


def writer_pids(metrics_dir: Path) -> set[int]:
    return {int(p.stem.rsplit("_", 1)[1]) for p in metrics_dir.glob("*.db")}


def release(env: dict[str, str]) -> str:
    return subprocess.run(
        [str(harness.VENV_BIN / "python"), "manage.py", "metrics_reset"],
        cwd=harness.REPO,
        env=env,
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout


def test_metrics__every_series_from_the_first_scrape_and_aggregated_across_processes(
    cluster, tmp_path
):
    metrics_dir = tmp_path / "metrics"
    metrics_dir.mkdir()
    (metrics_dir / "counter_999999999.db").write_bytes(b"")  # a dead process of the last deploy
    env = {"PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)}
    release({**cluster.env, **env})
    assert not (metrics_dir / "counter_999999999.db").exists()

    web = start_web(cluster, **role_env("web"), WEB_CONCURRENCY="2", **env)
    worker = cluster.ready(cluster.worker(**role_env("worker"), **env))
    first = scrape(web)
    assert not set(DOCUMENTED) - families(first), set(DOCUMENTED) - families(first)
    assert first['quire_admissions_total{reason="",result="accepted"}'] == 0
    assert first['quire_attempt_duration_seconds_count{outcome="succeeded"}'] == 0
    assert first['quire_jobs_finished_total{state="succeeded"}'] == 0

    # Submissions in parallel until both web processes have served some (the kernel spreads
    # accepted connections; each process writes its own file).
    web_pids = set(web.proc.tree()) - {web.proc.pid}
    accepted: list[str] = []
    with ThreadPoolExecutor(6) as pool:
        for _ in range(8):
            for response in pool.map(lambda _: web.submit(), range(6)):
                assert response.status_code == 202, response.text
                accepted.append(response.json()["id"])
            if len(writer_pids(metrics_dir) & web_pids) >= 2:
                break
    assert len(writer_pids(metrics_dir) & web_pids) >= 2, (writer_pids(metrics_dir), web_pids)
    assert set(worker.tree()) & writer_pids(metrics_dir), "the worker's pool writes its own file"
    harness.wait_until(
        lambda: (
            ConversionJob.objects.filter(id__in=accepted, state="succeeded").count()
            == len(accepted)
        ),
        timeout=120,
        interval=0.5,
        what="every job succeeded",
    )
    after = scrape(web)
    assert after['quire_admissions_total{reason="",result="accepted"}'] == len(accepted)
    assert after['quire_attempt_duration_seconds_count{outcome="succeeded"}'] == len(accepted)
    assert after['quire_jobs_finished_total{state="succeeded"}'] == len(accepted)

    # A release while the processes run keeps their files, so nothing vanishes or resets.
    assert "of live processes kept" in release({**cluster.env, **env})
    again = scrape(web)
    assert not set(DOCUMENTED) - families(again)
    assert again['quire_admissions_total{reason="",result="accepted"}'] == len(accepted)
    assert again['quire_attempt_duration_seconds_count{outcome="succeeded"}'] == len(accepted)
