"""RFC 9457 problem details: every error the API returns is built here."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.http import HttpRequest, JsonResponse
from rest_framework import exceptions as drf
from rest_framework.response import Response

from conversion_jobs.exceptions import (
    DatabaseUnavailable,
    NotAuthenticated,
    NotFound,
    PermissionDenied,
    QuireError,
    RetryLater,
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
    if isinstance(error, RetryLater):
        body["retry_after"] = error.retry_after
    for key, value in error.extra.items():
        if key not in body and key != "retry_after":
            body[key] = value
    return body


def problem_response(error: QuireError) -> Response:
    response = Response(problem_body(error), status=error.status, content_type=PROBLEM)
    if isinstance(error, RetryLater):
        response["Retry-After"] = str(error.retry_after)
    if isinstance(error, NotAuthenticated):
        response["WWW-Authenticate"] = 'Bearer realm="quire"'
    return response


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


def database_unavailable() -> DatabaseUnavailable:
    return DatabaseUnavailable(retry_after=settings.QUIRE["DB_UNAVAILABLE_RETRY_AFTER_S"])


def is_database_outage(exc: BaseException) -> bool:
    """A lost or refused database connection (not a query error such as a constraint)."""
    from django.db import InterfaceError, OperationalError

    return isinstance(exc, OperationalError | InterfaceError)


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    from django.http import Http404

    if is_database_outage(exc):
        return problem_response(database_unavailable())
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
    if isinstance(error, RetryLater):
        response["Retry-After"] = str(error.retry_after)
    return response


class DatabaseUnavailableMiddleware:
    """Any view (DRF or plain Django, under WSGI or ASGI) that loses the database answers
    ``503 database_unavailable`` with ``Retry-After`` instead of a 500 (DRF views get the same
    answer from :func:`exception_handler`). Django closes the broken connection at the end of
    the request and reconnects on the next one, so service resumes by itself."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response: Any) -> None:
        from asgiref.sync import iscoroutinefunction, markcoroutinefunction

        self.get_response = get_response
        if iscoroutinefunction(get_response):
            markcoroutinefunction(self)

    def __call__(self, request: HttpRequest) -> Any:
        from asgiref.sync import iscoroutinefunction

        if iscoroutinefunction(self):
            return self.__acall__(request)
        return self.get_response(request)

    async def __acall__(self, request: HttpRequest) -> Any:
        return await self.get_response(request)

    def process_exception(self, request: HttpRequest, exception: Exception) -> JsonResponse | None:
        if not is_database_outage(exception):
            return None
        from django.db import connections

        for conn in connections.all(initialized_only=True):
            conn.close_if_unusable_or_obsolete()
        return json_problem(request, database_unavailable())
