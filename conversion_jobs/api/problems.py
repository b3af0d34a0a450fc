"""RFC 9457 problem details: every error the API returns is built here."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest, JsonResponse
from rest_framework import exceptions as drf
from rest_framework.response import Response

from conversion_jobs.exceptions import (
    InvalidToken,
    NotAuthenticated,
    NotFound,
    PermissionDenied,
    QuireError,
    Rejected,
)

PROBLEM = "application/problem+json"
TYPE_BASE = "https://quire.dev/problems/"


def problem_body(error: QuireError) -> dict[str, Any]:
    body: dict[str, Any] = {
        "type": TYPE_BASE + error.code,
        "title": (type(error).__doc__ or error.code).strip().splitlines()[0],
        "status": error.status,
        "code": error.code,
    }
    # A 404 must be byte-identical whatever the cause: it carries no detail of its own.
    if not isinstance(error, NotFound):
        body["detail"] = error.detail
    if isinstance(error, Rejected):
        body["retry_after"] = error.retry_after
    for key, value in error.extra.items():
        if key not in body and key != "retry_after":
            body[key] = value
    return body


def problem_response(error: QuireError) -> Response:
    response = Response(problem_body(error), status=error.status, content_type=PROBLEM)
    if isinstance(error, Rejected):
        response["Retry-After"] = str(error.retry_after)
    if isinstance(error, NotAuthenticated):
        response["WWW-Authenticate"] = www_authenticate(error)
    return response


def www_authenticate(error: NotAuthenticated) -> str:
    """RFC 6750 §3: a rejected token says so; a missing one gets the bare challenge."""
    if isinstance(error, InvalidToken):
        return 'Bearer realm="quire", error="invalid_token"'
    return 'Bearer realm="quire"'


def _from_drf(exc: drf.APIException) -> QuireError:
    if isinstance(exc, drf.NotAuthenticated | drf.AuthenticationFailed):
        return NotAuthenticated()
    if isinstance(exc, drf.PermissionDenied):
        return PermissionDenied()
    if isinstance(exc, drf.NotFound):
        return NotFound()
    error = QuireError(str(exc.detail))
    error.status = exc.status_code
    error.code = {
        400: "invalid_request",
        405: "method_not_allowed",
        406: "not_acceptable",
        413: "payload_too_large",
        415: "unsupported_media_type",
        429: "throttled",
    }.get(exc.status_code, "error")
    return error


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    from django.http import Http404

    if isinstance(exc, QuireError):
        return problem_response(exc)
    if isinstance(exc, Http404):
        return problem_response(NotFound())
    if isinstance(exc, drf.APIException):
        return problem_response(_from_drf(exc))
    return None


def json_problem(request: HttpRequest, error: QuireError) -> JsonResponse:
    """For plain Django views and handlers (outside DRF)."""
    response = JsonResponse(problem_body(error), status=error.status, content_type=PROBLEM)
    if isinstance(error, Rejected):
        response["Retry-After"] = str(error.retry_after)
    return response
