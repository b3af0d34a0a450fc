"""One error root. Each subclass's docstring is its default message; ``code`` is stable.

The API maps them to RFC 9457 problems in one place (``conversion_jobs.api.problems``).
"""

from __future__ import annotations


class QuireError(Exception):
    """Something went wrong."""

    code = "internal_error"
    status = 500
    retryable = False

    def __init__(self, detail: str | None = None, **extra: object) -> None:
        self.detail = detail or (self.__doc__ or "").strip()
        self.extra = extra
        super().__init__(self.detail)


class InvalidRequest(QuireError):
    """The request is malformed."""

    code = "invalid_request"
    status = 400


class InvalidOptions(InvalidRequest):
    """The options are not valid for this output."""

    code = "invalid_options"


class InvalidMetadata(InvalidRequest):
    """metadata must be a JSON object of at most 2048 bytes."""

    code = "invalid_metadata"


class InvalidWebhook(InvalidRequest):
    """The webhook endpoint is not valid."""

    code = "invalid_webhook"


class InvalidWebhookUrl(InvalidWebhook):
    """The webhook URL is not acceptable (https or http, a host name or a global address, an
    allowed port, no credentials)."""

    code = "invalid_webhook_url"


class InvalidWebhookEvents(InvalidWebhook):
    """events must be a non-empty list of job.succeeded, job.partial, job.failed, job.cancelled."""

    code = "invalid_webhook_events"


class InvalidCursor(InvalidRequest):
    """The pagination cursor is not valid."""

    code = "invalid_cursor"


class MalformedBody(InvalidRequest):
    """The request body cannot be parsed (broken multipart or JSON)."""

    code = "malformed_body"


class TooManyFields(InvalidRequest):
    """The form has more fields than the server accepts."""

    code = "too_many_fields"


class TooManyFiles(InvalidRequest):
    """The form has more file parts than the server accepts."""

    code = "too_many_files"


class UnexpectedFilePart(InvalidRequest):
    """Send exactly one file part, named ``file``."""

    code = "unexpected_file_part"


class RequestDataTooLarge(InvalidRequest):
    """The form fields (everything but the file) are larger than the server accepts."""

    code = "request_data_too_large"


class InvalidHost(InvalidRequest):
    """The Host header names a host this service does not serve."""

    code = "invalid_host"


class Forbidden(QuireError):
    """You may not do this."""

    code = "forbidden"
    status = 403


class CsrfFailed(Forbidden):
    """The CSRF check failed (admin forms only; the API uses bearer tokens)."""

    code = "csrf_failed"
    status = 403


class NotAuthenticated(QuireError):
    """A valid bearer token is required."""

    code = "not_authenticated"
    status = 401


class InvalidToken(NotAuthenticated):
    """The bearer token is invalid, expired, or carries a claim that does not fit."""

    code = "invalid_token"


class PermissionDenied(QuireError):
    """The token does not carry the scope this operation needs."""

    code = "insufficient_scope"
    status = 403


class NotFound(QuireError):
    """No such job."""

    code = "not_found"
    status = 404


class NotReady(QuireError):
    """The job has not finished; there is nothing to serve yet."""

    code = "not_ready"
    status = 409


class TooLate(QuireError):
    """The job already finished; the result stands."""

    code = "too_late"
    status = 409


class NotRetryable(QuireError):
    """Only a failed or cancelled job can be retried."""

    code = "not_retryable"
    status = 409


class PayloadTooLarge(QuireError):
    """The upload exceeds the size limit."""

    code = "payload_too_large"
    status = 413


class UnsupportedMediaType(QuireError):
    """The uploaded bytes are not a supported document type."""

    code = "unsupported_media_type"
    status = 415


class UnsupportedOutput(QuireError):
    """This output cannot be produced from this kind of document on this installation."""

    code = "unsupported_output"
    status = 422


class IdempotencyKeyReused(QuireError):
    """This Idempotency-Key was used with a different request."""

    code = "idempotency_key_reused"
    status = 422


class DocumentQuarantined(QuireError):
    """This document crashed the converter on repeated attempts and is quarantined for this
    tenant: it is not converted again until the engine changes or an operator lifts the
    quarantine (nothing was written)."""

    code = "document_quarantined"
    status = 422


class RetryLater(QuireError):
    """Not now; retry after a while (the answer carries ``Retry-After``)."""

    def __init__(self, detail: str | None = None, *, retry_after: int) -> None:
        super().__init__(detail, retry_after=retry_after)
        self.retry_after = retry_after


class Rejected(RetryLater):
    """Admission control turned the job away; nothing was written. Retry after a while."""


class DatabaseUnavailable(RetryLater):
    """The database is unavailable; nothing was written. Retry after a while."""

    code = "database_unavailable"
    status = 503


class TenantQuotaExceeded(Rejected):
    """The tenant has too many live jobs."""

    code = "tenant_quota_exceeded"
    status = 429


class CapacityExceeded(Rejected):
    """The service is at capacity."""

    code = "capacity_exceeded"
    status = 503


class IdentityProviderUnavailable(Rejected):
    """The identity provider's keys cannot be fetched and none are cached: retry later."""

    code = "identity_provider_unavailable"
    status = 503


class StorageUnavailable(RetryLater):
    """The artifact store is unavailable (nothing was accepted or served): retry later."""

    code = "storage_unavailable"
    status = 503

    def __init__(self, detail: str | None = None, *, retry_after: int = 5) -> None:
        super().__init__(detail, retry_after=retry_after)
