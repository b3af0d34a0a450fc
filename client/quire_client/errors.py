"""Errors, typed from the problem+json ``code`` (the server's docs/API_CONTRACT.md §4).

One root, :class:`QuireError`. An HTTP answer becomes an :class:`APIError`: the class of its
``code`` when the code is known, else the class of its status family (:class:`RateLimited` for
429, :class:`ServiceUnavailable` for 503, :class:`ClientError` for other 4xx,
:class:`ServerError` for 5xx) with the unknown ``code`` kept on the instance. A 4xx is never a
:class:`ServerError` and a 5xx never a :class:`ClientError`, whatever its code says.
"""

from __future__ import annotations

from typing import Any, ClassVar

from quire_client.models import Problem


class QuireError(Exception):
    """A Quire client error."""

    #: the stable code (a problem's ``code``, or the client's own for non-HTTP errors)
    code: ClassVar[str] = "quire_error"

    def __init__(self, message: str | None = None, *, code: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip().splitlines()[0])
        if code is not None:
            self.code = code  # type: ignore[misc]  # an unknown code, kept on the instance


class ConnectionFailed(QuireError):
    """The server could not be reached (connection refused, reset or timed out)."""

    code = "connection_error"


class DigestMismatch(QuireError):
    """The downloaded bytes do not have the digest the server announced."""

    code = "digest_mismatch"


class APIError(QuireError):
    """The server answered with an error (an RFC 9457 problem)."""

    code = "http_error"
    #: the HTTP status family this class belongs to (for unknown codes)
    status_family: ClassVar[int] = 0

    def __init__(self, problem: Problem, *, retry_after: float | None = None) -> None:
        super().__init__(
            f"{problem.status} {problem.code}: {problem.detail or problem.title}", code=problem.code
        )
        self.problem = problem
        self.status = problem.status
        #: seconds from the ``Retry-After`` header (429 / 503), if any
        self.retry_after = retry_after

    @property
    def detail(self) -> str | None:
        """The problem's ``detail`` (absent on 404s)."""
        return self.problem.detail

    @property
    def extras(self) -> dict[str, Any]:
        """Members beyond the standard ones (``job_state``, ``limit``, …)."""
        return self.problem.extras


class ClientError(APIError):
    """The request was refused (4xx): retrying it unchanged will not help."""


class ServerError(APIError):
    """The server failed (5xx)."""


class BadRequest(ClientError):
    """400: the request is malformed."""

    code = "invalid_request"


class InvalidOptions(BadRequest):
    """400: the conversion options are invalid."""

    code = "invalid_options"


class InvalidCursor(BadRequest):
    """400: the list cursor is malformed."""

    code = "invalid_cursor"


class MalformedBody(BadRequest):
    """400: the multipart or JSON body could not be parsed."""

    code = "malformed_body"


class NotAuthenticated(ClientError):
    """401: no bearer token was sent."""

    code = "not_authenticated"


class InvalidToken(ClientError):
    """401: the token is invalid or expired."""

    code = "invalid_token"


class InsufficientScope(ClientError):
    """403: the token lacks the scope this call needs."""

    code = "insufficient_scope"


class NotFound(ClientError):
    """404: no such job (or one of another tenant)."""

    code = "not_found"


class Conflict(ClientError):
    """409: the job is not in a state that allows this."""

    code = "conflict"


class NotReady(Conflict):
    """409: the job has not finished yet."""

    code = "not_ready"


class NoResult(Conflict):
    """409: the job finished without a result (failed, cancelled or expired)."""

    code = "no_result"


class TooLate(Conflict):
    """409: the job already finished; the cancel did nothing."""

    code = "too_late"


class NotRetryable(Conflict):
    """409: the job cannot be retried from its state."""

    code = "not_retryable"


class ConflictingJob(Conflict):
    """409: an identical job is live or succeeded."""

    code = "conflicting_job"


class PayloadTooLarge(ClientError):
    """413: the document is larger than the server accepts."""

    code = "payload_too_large"


class UnsupportedMediaType(ClientError):
    """415: the document's type is not supported."""

    code = "unsupported_media_type"


class UnsupportedOutput(ClientError):
    """422: this document type cannot be converted to the requested output here."""

    code = "unsupported_output"


class IdempotencyKeyReused(ClientError):
    """422: the Idempotency-Key was used for another document, output or options."""

    code = "idempotency_key_reused"


class DocumentQuarantined(ClientError):
    """422: the converter crashed on this document repeatedly; it is quarantined for this
    tenant until the engine changes or an operator lifts it. Retrying does not help."""

    code = "document_quarantined"


class RateLimited(ClientError):
    """429: too many requests or live jobs; retry after ``retry_after`` seconds."""

    code = "throttled"


class TenantQuotaExceeded(RateLimited):
    """429: the tenant has as many live jobs as its quota allows."""

    code = "tenant_quota_exceeded"


class InternalError(ServerError):
    """500: the server failed."""

    code = "internal_error"


class ResultIncomplete(ServerError):
    """500: a page of the result is missing from the server's store."""

    code = "result_incomplete"


class ServiceUnavailable(ServerError):
    """503: the service cannot answer now; retry after ``retry_after`` seconds."""

    code = "service_unavailable"


class CapacityExceeded(ServiceUnavailable):
    """503: the service is at capacity."""

    code = "capacity_exceeded"


class StorageUnavailable(ServiceUnavailable):
    """503: the artifact store failed."""

    code = "storage_unavailable"


class DatabaseUnavailable(ServiceUnavailable):
    """503: the database is unreachable; nothing was written."""

    code = "database_unavailable"


class IdentityProviderUnavailable(ServiceUnavailable):
    """503: the identity provider's keys cannot be fetched."""

    code = "identity_provider_unavailable"


def _registry() -> dict[str, type[APIError]]:
    found: dict[str, type[APIError]] = {}
    stack: list[type[APIError]] = [APIError]
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        if "code" in cls.__dict__:
            found[cls.code] = cls
    return found


#: code -> class, for the codes this client knows
BY_CODE = _registry()
for _family in (APIError, ClientError, ServerError, Conflict):  # families, not codes
    BY_CODE.pop(_family.code, None)


def error_for(problem: Problem, *, retry_after: float | None = None) -> APIError:
    """The typed error of a problem: by its code when known and of the same status family,
    else by its status."""
    cls = BY_CODE.get(problem.code)
    client_side = 400 <= problem.status < 500
    if cls is not None and issubclass(cls, ClientError) != client_side:
        cls = None  # a code the server sent with another family's status: trust the status
    if cls is None:
        if problem.status == 429:
            cls = RateLimited
        elif problem.status == 503:
            cls = ServiceUnavailable
        elif problem.status == 409:
            cls = Conflict
        elif client_side:
            cls = ClientError
        else:
            cls = ServerError
    return cls(problem, retry_after=retry_after)
