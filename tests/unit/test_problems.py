"""RFC 9457 problem bodies (conversion_jobs/api/problems.py)."""

from __future__ import annotations

import json

import pytest
from django.core import exceptions as dj
from django.http import Http404
from django.http.multipartparser import MultiPartParserError
from rest_framework import exceptions as drf

from conversion_jobs import exceptions as errors
from conversion_jobs.api.problems import (
    PROBLEM,
    TYPE_BASE,
    exception_handler,
    problem_body,
    problem_response,
)


def _leaf_errors() -> list[type[errors.QuireError]]:
    found, todo = [], [errors.QuireError]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return [c for c in found if c not in (errors.Rejected, errors.RetryLater)]


def _make(cls: type[errors.QuireError]) -> errors.QuireError:
    if issubclass(cls, errors.RetryLater):
        return cls(retry_after=7)
    return cls()


@pytest.mark.parametrize("cls", _leaf_errors(), ids=lambda c: c.__name__)
def test_problem_body__shape(cls):
    error = _make(cls)
    body = problem_body(error)
    assert body["type"] == TYPE_BASE + error.code
    assert body["status"] == error.status
    assert body["code"] == error.code
    assert body["title"] and "\n" not in body["title"]
    assert json.dumps(body)  # serialisable


def test_problem_body__codes_are_unique_per_status():
    seen: dict[str, int] = {}
    for cls in _leaf_errors():
        error = _make(cls)
        assert seen.setdefault(error.code, error.status) == error.status, error.code


def test_problem_body__not_found_has_no_detail():
    body = problem_body(errors.NotFound("job 1234 belongs to tenant-b"))
    assert "detail" not in body
    assert "tenant-b" not in json.dumps(body)
    assert problem_body(errors.NotFound()) == problem_body(errors.NotFound("x"))


def test_problem_body__detail_defaults_to_docstring():
    assert (
        problem_body(errors.TooLate())["detail"] == "The job already finished; the result stands."
    )
    assert problem_body(errors.TooLate("custom"))["detail"] == "custom"


@pytest.mark.parametrize(
    ("cls", "status", "code"),
    [
        (errors.TenantQuotaExceeded, 429, "tenant_quota_exceeded"),
        (errors.CapacityExceeded, 503, "capacity_exceeded"),
        (errors.DatabaseUnavailable, 503, "database_unavailable"),
    ],
)
def test_problem_response__rejection_carries_retry_after(cls, status, code):
    response = problem_response(cls(retry_after=42))
    assert response.status_code == status
    assert response["Retry-After"] == "42"
    assert response.data["retry_after"] == 42
    assert response.data["code"] == code
    assert response.content_type == PROBLEM


def test_problem_response__unauthenticated_challenges():
    response = problem_response(errors.NotAuthenticated())
    assert response.status_code == 401
    assert response["WWW-Authenticate"].startswith("Bearer")


def test_problem_body__extra_fields_are_kept_but_cannot_override():
    body = problem_body(errors.NotReady(job_state="running", status=999, code="x"))
    assert body["job_state"] == "running"
    assert body["status"] == 409
    assert body["code"] == "not_ready"


@pytest.mark.parametrize(
    ("exc", "status", "code"),
    [
        (drf.NotAuthenticated(), 401, "not_authenticated"),
        (drf.AuthenticationFailed(), 401, "not_authenticated"),
        (drf.PermissionDenied(), 403, "insufficient_scope"),
        (drf.NotFound(), 404, "not_found"),
        (drf.MethodNotAllowed("PUT"), 405, "method_not_allowed"),
        (drf.ParseError(), 400, "malformed_body"),
        (drf.UnsupportedMediaType("text/plain"), 415, "unsupported_media_type"),
    ],
)
def test_exception_handler__drf_errors_become_problems(exc, status, code):
    response = exception_handler(exc, {})
    assert response is not None
    assert response.status_code == status
    assert response.data["code"] == code
    assert response.content_type == PROBLEM


def test_exception_handler__unknown_exception_is_left_to_django():
    assert exception_handler(RuntimeError("boom"), {}) is None


@pytest.mark.parametrize(
    ("exc", "status", "code"),
    [
        (dj.BadRequest("bad"), 400, "invalid_request"),
        (dj.SuspiciousOperation("odd"), 400, "invalid_request"),
        (dj.DisallowedHost("evil"), 400, "invalid_host"),
        (dj.TooManyFieldsSent("many"), 400, "too_many_fields"),
        (dj.TooManyFilesSent("many"), 400, "too_many_files"),
        (dj.RequestDataTooBig("big"), 400, "request_data_too_large"),
        (MultiPartParserError("secret-boundary"), 400, "malformed_body"),
        (dj.PermissionDenied(), 403, "forbidden"),
        (Http404(), 404, "not_found"),
    ],
)
def test_exception_handler__django_request_errors_become_problems(exc, status, code):
    response = exception_handler(exc, {})
    assert response is not None
    assert (response.status_code, response.data["code"]) == (status, code)
    # Django's message (which may echo request data) is never passed on.
    assert "secret-boundary" not in str(response.data) and "evil" not in str(response.data)


def test_exception_handler__lost_database_is_503_database_unavailable_with_retry_after(settings):
    from django.db import InterfaceError, OperationalError

    settings.QUIRE = {**settings.QUIRE, "DB_UNAVAILABLE_RETRY_AFTER_S": 7}
    for exc in (OperationalError("connection refused"), InterfaceError("connection closed")):
        response = exception_handler(exc, {})
        assert response is not None
        assert response.status_code == 503
        assert response.data["code"] == "database_unavailable"
        assert response["Retry-After"] == "7"
        assert "connection" not in json.dumps(response.data)  # no driver detail leaks


def test_exception_handler__a_query_error_is_not_an_outage():
    from django.db import IntegrityError

    assert exception_handler(IntegrityError("duplicate key"), {}) is None
