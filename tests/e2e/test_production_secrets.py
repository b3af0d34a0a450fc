"""e2e: the production profile refuses development and missing secrets (issue 22 points 5, 6).

Each Procfile line (``web``, ``worker``, ``sweeper``, ``beat``, ``release``, ``notifier``) is
started the way a Procfile runner starts it (``bash -c`` of the line) with one secret unset or
set to its published development value: it must exit 78 at once with one line naming the
variable. Its services point at closed ports, so a process that did not refuse would hang
retrying them (or serve) until the timeout, never exit 78. With proper values the same lines
start (the rest of the e2e suite); here the web's ``/metrics`` is checked from outside to need
its token.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
from pathlib import Path

import pytest
import requests

from conversion_jobs.secret_policy import DEVELOPMENT_VALUES, EXIT_CODE, SECRET_VARIABLES
from tests.conftest import metrics_headers, token
from tests.e2e import harness
from tests.e2e.conftest import role_env
from tests.e2e.webproc import start_web

KINDS = ("web", "worker", "sweeper", "beat", "release")
#: Every variable unset for one line, every development value (the metrics token has none) set
#: for another.
UNSET = dict(zip(KINDS, SECRET_VARIABLES, strict=True))
DEVELOPMENT = {
    "web": "QUIRE_JWT_KEY",
    "worker": "QUIRE_PSEUDONYM_KEY",
    "sweeper": "QUIRE_PASSWORD_KEY",
    "beat": "DJANGO_SECRET_KEY",
    "release": "QUIRE_JWT_KEY",
}


def procfile_line(kind: str) -> str:
    for line in harness.PROCFILE.read_text().splitlines():
        name, _, command = line.partition(":")
        if name.strip() == kind:
            return command.strip()
    raise KeyError(kind)


def production_env(tmp_path: Path) -> dict[str, str]:
    """The production profile, every secret proper, every service on a closed port."""
    return harness.process_env(
        DATABASE_URL=f"postgres://quire@127.0.0.1:{harness.free_port()}/quire",
        CELERY_BROKER_URL=f"amqp://quire:quire@127.0.0.1:{harness.free_port()}/quire",
        QUIRE_BIND=f"127.0.0.1:{harness.free_port()}",
        QUIRE_VAR_DIR=str(tmp_path / "var"),
        PROMETHEUS_MULTIPROC_DIR=str(tmp_path / "metrics"),
        **{name: secrets.token_urlsafe(48) for name in SECRET_VARIABLES},
    )


def run_line(kind: str, env: dict[str, str], *, timeout: float = 90) -> tuple[int, str]:
    """(exit status, stdout + stderr) of the Procfile line; its group is killed at the timeout
    (a line that did not refuse: it serves, or retries its closed ports, until then)."""
    proc = subprocess.Popen(
        ["bash", "-c", procfile_line(kind)],
        cwd=harness.REPO,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{kind} did not refuse within {timeout:g}s:\n{out.decode()[-3000:]}")
    return proc.returncode, out.decode(errors="replace")


def assert_refused(kind: str, env: dict[str, str], name: str, why: str) -> None:
    status, output = run_line(kind, env)
    lines = [line for line in output.splitlines() if line.strip()]
    assert status == EXIT_CODE, f"{kind} exited {status}:\n{output}"
    # nothing before it either: gunicorn logs "Starting gunicorn" before it binds, celery its
    # banner before it connects
    assert len(lines) == 1, f"{kind} said more than one line:\n{output}"
    assert lines[0].startswith("quire: refusing to start in the production profile: ")
    assert f"{name} {why}" in lines[0]
    assert "Traceback" not in output


@pytest.mark.parametrize("kind", KINDS)
def test_procfile_line__refuses_to_start_with_a_secret_unset(kind, tmp_path):
    env = production_env(tmp_path)
    del env[UNSET[kind]]
    assert_refused(kind, env, UNSET[kind], "is unset")


@pytest.mark.parametrize("kind", KINDS)
def test_procfile_line__refuses_to_start_with_a_development_secret(kind, tmp_path):
    name = DEVELOPMENT[kind]
    env = {**production_env(tmp_path), name: DEVELOPMENT_VALUES[name]}
    assert_refused(kind, env, name, "holds a published development value")


def test_procfile_line__notifier_refuses_an_unset_or_development_secret(tmp_path):
    """The webhook notifier (ADR 0020): it opens the sealed signing secrets with
    QUIRE_PASSWORD_KEY, and refuses like every other line."""
    env = production_env(tmp_path)
    del env["QUIRE_PASSWORD_KEY"]
    assert_refused("notifier", env, "QUIRE_PASSWORD_KEY", "is unset")
    env = {**production_env(tmp_path), "DJANGO_SECRET_KEY": DEVELOPMENT_VALUES["DJANGO_SECRET_KEY"]}
    assert_refused("notifier", env, "DJANGO_SECRET_KEY", "holds a published development value")


def test_release__refuses_a_weak_secret_before_migrating(tmp_path):
    env = {**production_env(tmp_path), "QUIRE_METRICS_TOKEN": "metrics"}
    assert_refused("release", env, "QUIRE_METRICS_TOKEN", "is shorter than 32 characters")


def test_standalone__starts_with_its_development_secrets_and_says_so_once(tmp_path):
    env = {
        k: v
        for k, v in harness.process_env(QUIRE_VAR_DIR=str(tmp_path / "var")).items()
        if k not in SECRET_VARIABLES
    }
    checked = subprocess.run(
        [str(harness.VENV_BIN / "python"), "manage.py", "check"],
        cwd=harness.REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert checked.returncode == 0, checked.stderr
    warnings = [line for line in checked.stderr.splitlines() if "standalone profile" in line]
    assert len(warnings) == 1, checked.stderr
    assert "published development secrets in use (DJANGO_SECRET_KEY, QUIRE_JWT_KEY" in warnings[0]


def test_metrics__from_outside_needs_the_metrics_token(cluster):
    """The production profile cannot start without ``QUIRE_METRICS_TOKEN``; with it, a scrape
    without the token, with another or with a tenant's API token is a 401 problem."""
    web = start_web(cluster, **role_env("web"), WEB_CONCURRENCY="1")
    assert metrics_headers(), "the production run has a metrics token"
    for headers in (
        {},
        {"Authorization": f"Bearer {secrets.token_urlsafe(48)}"},
        {"Authorization": f"Bearer {token()}"},
        {"Authorization": metrics_headers()["Authorization"].removeprefix("Bearer ")},
    ):
        refused = requests.get(f"{web.base}/metrics", headers=headers, timeout=10)
        assert refused.status_code == 401, headers
        assert refused.headers["Content-Type"] == "application/problem+json"
        assert refused.json()["code"] == "not_authenticated"
        assert refused.headers["WWW-Authenticate"].startswith("Bearer")
        assert "quire_" not in refused.text
    scraped = web.metrics()
    assert scraped.status_code == 200
    assert scraped.headers["Content-Type"].startswith("text/plain")
    assert "quire_admissions_total" in scraped.text
