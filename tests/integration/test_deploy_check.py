"""``manage.py check --deploy`` with the production environment docs/OPERABILITY.md documents
(§2 "Secrets" and "HTTPS"): no warning. Run as a process of its own with exactly that
environment, whatever the profile of this run."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from conversion_jobs.secret_policy import SECRET_VARIABLES

REPO = Path(__file__).resolve().parents[2]


def documented_production_env(tmp_path: Path, **overrides: str) -> dict[str, str]:
    """What OPERABILITY §2 tells an operator to set (service URLs are never contacted by
    ``check`` without ``--database``), on a bare environment: nothing of this run leaks in."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "DJANGO_SETTINGS_MODULE": "project.settings",
        "QUIRE_VAR_DIR": str(tmp_path / "var"),
        "DATABASE_URL": "postgres://quire:secret@db.internal:5432/quire",
        "CELERY_BROKER_URL": "amqp://quire_publisher:secret@mq.internal:5672/quire",
        "DJANGO_ALLOWED_HOSTS": "quire.example.com",
        **{name: secrets.token_urlsafe(48) for name in SECRET_VARIABLES},
    }
    env.update(overrides)
    return env


def check_deploy(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_check_deploy__documented_production_settings_have_no_warning(tmp_path):
    result = check_deploy(documented_production_env(tmp_path))
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "WARNINGS" not in output and "ERRORS" not in output
    assert "System check identified no issues" in result.stdout


@pytest.mark.parametrize(
    ("override", "warning"),
    [
        ({"DJANGO_SECURE_HSTS_SECONDS": "0"}, "security.W004"),
        ({"DJANGO_SESSION_COOKIE_SECURE": "false"}, "security.W012"),
        ({"DJANGO_CSRF_COOKIE_SECURE": "false"}, "security.W016"),
        ({"DJANGO_DEBUG": "true"}, "security.W018"),
    ],
    ids=["no_hsts", "session_cookie", "csrf_cookie", "debug"],
)
def test_check_deploy__each_documented_setting_is_what_silences_it(tmp_path, override, warning):
    """The control: the same check does warn once one of those settings is turned back."""
    result = check_deploy(documented_production_env(tmp_path, **override))
    assert result.returncode != 0
    assert warning in result.stdout + result.stderr
