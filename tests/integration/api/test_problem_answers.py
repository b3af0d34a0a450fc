"""Every answer of the service, Django's own included, is application/problem+json with a stable
code (docs/API_CONTRACT.md §4; issue 10 §4)."""

from __future__ import annotations

import pytest
from django.test import Client

from conversion_jobs import selectors
from conversion_jobs.api import health
from tests.integration.api.conftest import problem


@pytest.mark.django_db
def test_disallowed_host__is_problem_400(settings):
    settings.ALLOWED_HOSTS = ["quire.test"]
    problem(Client().get("/api/v1/capabilities", HTTP_HOST="evil.example"), 400, "invalid_host")
    problem(Client().get("/admin/", HTTP_HOST="evil.example"), 400, "invalid_host")
    assert Client().get("/api/v1/capabilities", HTTP_HOST="quire.test").status_code == 200


@pytest.mark.django_db
def test_too_many_query_parameters__is_problem_400(api):
    query = "&".join(f"p{i}=1" for i in range(1_100))
    problem(api().get(f"/api/v1/jobs?{query}"), 400, "too_many_fields")


@pytest.mark.django_db
def test_oversized_form_on_a_django_view__is_problem_400():
    """The admin's login form read by the CSRF middleware: Django's RequestDataTooBig."""
    response = Client().post(
        "/admin/login/", "a=" + "x" * 70_000, content_type="application/x-www-form-urlencoded"
    )
    problem(response, 400, "request_data_too_large")


@pytest.mark.django_db
def test_csrf_failure__is_problem_403():
    response = Client(enforce_csrf_checks=True).post(
        "/admin/login/", {"username": "u", "password": "p"}
    )
    problem(response, 403, "csrf_failed")


@pytest.mark.django_db
@pytest.mark.parametrize("path", ["/nope", "/api/v2/jobs", "/api/v1/nope", "/static/nope.css"])
def test_unknown_url__is_problem_404(path):
    problem(Client().get(path), 404, "not_found")


@pytest.mark.django_db
def test_unhandled_exception__is_problem_500(api, monkeypatch):
    def boom(**kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(selectors, "conversion_job_list", boom)
    client = api()
    client.raise_request_exception = False
    body = problem(client.get("/api/v1/jobs"), 500, "internal_error")
    assert "a bug" not in str(body)


@pytest.mark.django_db
def test_database_unreachable__is_problem_503_with_retry_after(api, monkeypatch):
    from django.db import OperationalError

    def unreachable(**kwargs):
        raise OperationalError("connection to server at 127.0.0.1 failed: Connection refused")

    monkeypatch.setattr(selectors, "conversion_job_list", unreachable)
    response = api().get("/api/v1/jobs")
    body = problem(response, 503, "database_unavailable")
    assert response["Retry-After"] == str(body["retry_after"]) == "5"
    assert "127.0.0.1" not in response.content.decode()


def test_metrics_without_its_token__is_problem_401(settings):
    settings.QUIRE = {**settings.QUIRE, "METRICS_TOKEN": "metrics-secret"}
    response = Client().get("/metrics")
    problem(response, 401, "not_authenticated")
    assert response["WWW-Authenticate"].startswith("Bearer")
    # Rewritten by the middleware: the security headers of the original answer stay.
    assert response["X-Frame-Options"] == "DENY"
    assert response["X-Content-Type-Options"] == "nosniff"


@pytest.mark.django_db
def test_readiness_failure__is_problem_503_that_keeps_its_checks(monkeypatch):
    monkeypatch.setattr(health, "_broker_ok", lambda: False)
    body = problem(Client().get("/health/ready"), 503, "service_unavailable")
    assert body["checks"]["broker"] is False
    assert body["checks"]["database"] is True
    assert "mode" in body["sandbox"]  # every member of the readiness body is kept
