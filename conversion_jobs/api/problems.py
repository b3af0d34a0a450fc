"""RFC 9457 problem details: every error the API returns is built here."""

from __future__ import annotations

from types import UnionType
from typing import Any

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.conf import settings
from django.core import exceptions as dj
from django.db import InterfaceError, OperationalError, connections
from django.http import Http404, HttpRequest, JsonResponse
from django.http.multipartparser import MultiPartParserError
from rest_framework import exceptions as drf
from rest_framework.response import Response

from conversion_jobs.exceptions import (
    CsrfFailed,
    DatabaseUnavailable,
    Forbidden,
    InvalidHost,
    InvalidRequest,
    InvalidToken,
    MalformedBody,
    NotAuthenticated,
    NotFound,
    PermissionDenied,
    QuireError,
    RequestDataTooLarge,
    RetryLater,
    TooManyFields,
    TooManyFiles,
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
        response["WWW-Authenticate"] = www_authenticate(error)
    return response


def www_authenticate(error: NotAuthenticated) -> str:
    """RFC 6750 §3: a rejected token says so; a missing one gets the bare challenge."""
    if isinstance(error, InvalidToken):
        return 'Bearer realm="quire", error="invalid_token"'
    return 'Bearer realm="quire"'


#: (exception type or union, its problem), matched in order.
_ErrorTable = tuple[tuple[type[BaseException] | UnionType, type[QuireError]], ...]

#: DRF's exceptions that have a problem of their own.
_DRF_ERRORS: _ErrorTable = (
    (drf.NotAuthenticated | drf.AuthenticationFailed, NotAuthenticated),
    (drf.PermissionDenied, PermissionDenied),
    (drf.NotFound, NotFound),
    (drf.ParseError, MalformedBody),
)

#: The exceptions Django raises while reading a request, and their problems (in this order:
#: the SuspiciousOperation subclasses before it).
_DJANGO_ERRORS: _ErrorTable = (
    (Http404, NotFound),
    (dj.PermissionDenied, Forbidden),
    (dj.TooManyFieldsSent, TooManyFields),
    (dj.TooManyFilesSent, TooManyFiles),
    (dj.RequestDataTooBig, RequestDataTooLarge),
    (dj.DisallowedHost, InvalidHost),
    (MultiPartParserError | UnicodeDecodeError, MalformedBody),
    (dj.SuspiciousOperation | dj.BadRequest, InvalidRequest),
)


def _mapped(exc: BaseException, table: _ErrorTable) -> QuireError | None:
    return next((problem() for kind, problem in table if isinstance(exc, kind)), None)


def _from_drf(exc: drf.APIException) -> QuireError:
    mapped = _mapped(exc, _DRF_ERRORS)
    if mapped is not None:
        return mapped
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
    return isinstance(exc, OperationalError | InterfaceError)


def error_from_django(exc: BaseException) -> QuireError | None:
    """The problem for an exception Django raises while reading a request (or None)."""
    return _mapped(exc, _DJANGO_ERRORS)


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    if is_database_outage(exc):
        return problem_response(database_unavailable())
    if isinstance(exc, QuireError):
        return problem_response(exc)
    if isinstance(exc, drf.APIException):
        return problem_response(_from_drf(exc))
    error = error_from_django(exc)
    return problem_response(error) if error is not None else None


def json_problem(request: HttpRequest, error: QuireError) -> JsonResponse:
    """For plain Django views and handlers (outside DRF)."""
    response = JsonResponse(problem_body(error), status=error.status, content_type=PROBLEM)
    if isinstance(error, RetryLater):
        response["Retry-After"] = str(error.retry_after)
    return response


def csrf_failure(request: HttpRequest, reason: str = "") -> JsonResponse:
    """``CSRF_FAILURE_VIEW``: only the admin's forms carry CSRF tokens; the reason is not echoed."""
    return json_problem(request, CsrfFailed())


class DatabaseUnavailableMiddleware:
    """Any view (DRF or plain Django, under WSGI or ASGI) that loses the database answers
    ``503 database_unavailable`` with ``Retry-After`` instead of a 500 (DRF views get the same
    answer from :func:`exception_handler`). Django closes the broken connection at the end of
    the request and reconnects on the next one, so service resumes by itself."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response: Any) -> None:
        self.get_response = get_response
        if iscoroutinefunction(get_response):
            markcoroutinefunction(self)

    def __call__(self, request: HttpRequest) -> Any:
        if iscoroutinefunction(self):
            return self.__acall__(request)
        return self.get_response(request)

    async def __acall__(self, request: HttpRequest) -> Any:
        return await self.get_response(request)

    def process_exception(self, request: HttpRequest, exception: Exception) -> JsonResponse | None:
        if not is_database_outage(exception):
            return None
        for conn in connections.all(initialized_only=True):
            conn.close_if_unusable_or_obsolete()
        return json_problem(request, database_unavailable())
