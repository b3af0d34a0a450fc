"""Readiness and metrics tell whether the converter sandbox can be set up on this host, and
whether an operator turned it off (ADR 0013)."""

import pytest

from conversion_jobs.converters import sandbox, sessions
from tests.conftest import metrics_headers

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def fresh_probe():
    sandbox._probe_cache = None
    yield
    sandbox._probe_cache = None
    sessions.release_all()


def _metrics(client) -> str:
    response = client.get("/metrics", headers=metrics_headers())
    assert response.status_code == 200
    return response.content.decode()


def test_ready__sandbox_on_and_available(client):
    response = client.get("/health/ready")
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["checks"]["sandbox"] is True
    assert body["sandbox"] == {"mode": "on", "available": True, "reason": None}
    text = _metrics(client)
    assert "quire_sandbox_enabled 1.0" in text
    assert "quire_sandbox_available 1.0" in text


def test_ready__off_switch_is_ready_and_says_so(client, monkeypatch):
    monkeypatch.setenv(sandbox.MODE_ENV, "off")
    response = client.get("/health/ready")
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["checks"]["sandbox"] is True
    assert body["sandbox"]["mode"] == "off"
    assert "QUIRE_SANDBOX=off" in body["sandbox"]["reason"]
    text = _metrics(client)
    assert "quire_sandbox_enabled 0.0" in text
    assert "quire_sandbox_available 0.0" in text


def test_ready__unavailable_sandbox_is_not_ready_and_says_why(client, monkeypatch):
    monkeypatch.setenv(sandbox.UID_ENV, "0")
    response = client.get("/health/ready")
    assert response.status_code == 503
    body = response.json()
    assert body["checks"]["sandbox"] is False
    assert body["sandbox"]["mode"] == "on" and body["sandbox"]["available"] is False
    assert "uid" in body["sandbox"]["reason"]
    text = _metrics(client)
    assert "quire_sandbox_enabled 1.0" in text
    assert "quire_sandbox_available 0.0" in text
