"""Every error answer is ``application/problem+json`` (docs/API_CONTRACT.md §4).

The API's own errors are problems already (``conversion_jobs.api.problems``); Django's handlers
(``project.urls``) answer 400/403/404/500 as problems too. This middleware is the net under both:
any other 4xx/5xx answer — a bare ``HttpResponse(status=401)``, a 405 from a plain view, the
readiness probe's 503 — is rewritten into a problem with the stable code of its status. A JSON
object body keeps its members (the readiness checks stay readable); headers other than the
body's own are kept.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.http import HttpRequest, HttpResponse
from django.http.response import HttpResponseBase

from conversion_jobs.api.problems import PROBLEM, TYPE_BASE

#: The stable code of a status when nothing more specific produced the answer.
STATUS_CODES = {
    400: "invalid_request",
    401: "not_authenticated",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    406: "not_acceptable",
    408: "request_timeout",
    409: "conflict",
    410: "gone",
    411: "length_required",
    413: "payload_too_large",
    414: "uri_too_long",
    415: "unsupported_media_type",
    429: "throttled",
    431: "request_header_fields_too_large",
    500: "internal_error",
    502: "bad_gateway",
    503: "service_unavailable",
    504: "gateway_timeout",
}
#: Headers that describe the original body and so are not carried over to the problem.
BODY_HEADERS = {"content-type", "content-length", "content-disposition", "content-encoding"}
RESERVED = {"type", "title", "status", "code", "detail"}


def status_code_name(status: int) -> str:
    return STATUS_CODES.get(status, f"http_{status}")


def as_problem(response: HttpResponseBase) -> HttpResponseBase:
    """``response`` itself when it is a success or already a problem; else its problem form."""
    if response.status_code < 400 or response.get("Content-Type", "").startswith(PROBLEM):
        return response
    if response.streaming:
        return response
    code = status_code_name(response.status_code)
    try:
        title = HTTPStatus(response.status_code).phrase
    except ValueError:
        title = "Error"
    body: dict[str, Any] = {
        "type": TYPE_BASE + code,
        "title": title,
        "status": response.status_code,
        "code": code,
    }
    if response.get("Content-Type", "").startswith("application/json"):
        assert isinstance(response, HttpResponse)  # noqa: S101 - not streaming (checked above)
        try:
            original = json.loads(response.content)
        except ValueError:
            original = None
        if isinstance(original, dict):
            body.update({k: v for k, v in original.items() if k not in RESERVED})
    problem = HttpResponse(json.dumps(body), status=response.status_code, content_type=PROBLEM)
    # Everything else stays: Allow, Retry-After, WWW-Authenticate, the security headers.
    for header, value in response.items():
        if header.lower() not in BODY_HEADERS:
            problem[header] = value
    return problem


class ProblemResponseMiddleware:
    """Outermost middleware; sync and async (the ASGI server must not need a thread for it)."""

    sync_capable = True
    async_capable = True

    def __init__(
        self,
        get_response: Callable[[HttpRequest], HttpResponseBase]
        | Callable[[HttpRequest], Awaitable[HttpResponseBase]],
    ) -> None:
        self.get_response = get_response
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)

    def __call__(self, request: HttpRequest) -> Any:
        if self.is_async:
            return self.__acall__(request)
        return as_problem(self.get_response(request))  # type: ignore[arg-type]

    async def __acall__(self, request: HttpRequest) -> HttpResponseBase:
        return as_problem(await self.get_response(request))  # type: ignore[misc]
