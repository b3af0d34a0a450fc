"""One error root. Each subclass's docstring is its default message; ``code`` is stable.

The API maps them to RFC 9457 problems in one place (``conversion_jobs.api.problems``).
"""

from __future__ import annotations

from typing import Any


class QuireError(Exception):
    """Something went wrong."""

    code = "internal_error"
    status = 500
    retryable = False

    def __init_subclass__(
        cls,
        *,
        code: str | None = None,
        status: int | None = None,
        retryable: bool | None = None,
        **kwargs: Any,
    ) -> None:
        """A subclass names its ``code``, ``status`` and ``retryable`` in its header; without
        them it has its base's."""
        super().__init_subclass__(**kwargs)
        if code is not None:
            cls.code = code
        if status is not None:
            cls.status = status
        if retryable is not None:
            cls.retryable = retryable

    def __init__(self, detail: str | None = None, **extra: object) -> None:
        self.detail = detail or (self.__doc__ or "").strip()
        self.extra = extra
        super().__init__(self.detail)


class InvalidRequest(QuireError, code="invalid_request", status=400):
    """The request is malformed."""


class InvalidOptions(InvalidRequest, code="invalid_options"):
    """The options are not valid for this output."""


class InvalidMetadata(InvalidRequest, code="invalid_metadata"):
    """metadata must be a JSON object of at most 2048 bytes."""


class InvalidWebhook(InvalidRequest, code="invalid_webhook"):
    """The webhook endpoint is not valid."""


class InvalidWebhookUrl(InvalidWebhook, code="invalid_webhook_url"):
    """The webhook URL is not acceptable (https or http, a host name or a global address, an
    allowed port, no credentials)."""


class InvalidWebhookEvents(InvalidWebhook, code="invalid_webhook_events"):
    """events must be a non-empty list of job.succeeded, job.partial, job.failed, job.cancelled."""


class InvalidCursor(InvalidRequest, code="invalid_cursor"):
    """The pagination cursor is not valid."""


class MalformedBody(InvalidRequest, code="malformed_body"):
    """The request body cannot be parsed (broken multipart or JSON)."""


class TooManyFields(InvalidRequest, code="too_many_fields"):
    """The form has more fields than the server accepts."""


class TooManyFiles(InvalidRequest, code="too_many_files"):
    """The form has more file parts than the server accepts."""


class UnexpectedFilePart(InvalidRequest, code="unexpected_file_part"):
    """Send exactly one file part, named ``file``."""


class RequestDataTooLarge(InvalidRequest, code="request_data_too_large"):
    """The form fields (everything but the file) are larger than the server accepts."""


class InvalidHost(InvalidRequest, code="invalid_host"):
    """The Host header names a host this service does not serve."""


class Forbidden(QuireError, code="forbidden", status=403):
    """You may not do this."""


class CsrfFailed(Forbidden, code="csrf_failed", status=403):
    """The CSRF check failed (admin forms only; the API uses bearer tokens)."""


class NotAuthenticated(QuireError, code="not_authenticated", status=401):
    """A valid bearer token is required."""


class InvalidToken(NotAuthenticated, code="invalid_token"):
    """The bearer token is invalid, expired, or carries a claim that does not fit."""


class PermissionDenied(QuireError, code="insufficient_scope", status=403):
    """The token does not carry the scope this operation needs."""


class NotFound(QuireError, code="not_found", status=404):
    """No such job."""


class NotReady(QuireError, code="not_ready", status=409):
    """The job has not finished; there is nothing to serve yet."""


class TooLate(QuireError, code="too_late", status=409):
    """The job already finished; the result stands."""


class NotRetryable(QuireError, code="not_retryable", status=409):
    """Only a failed or cancelled job can be retried."""


class PayloadTooLarge(QuireError, code="payload_too_large", status=413):
    """The upload exceeds the size limit."""


class UnsupportedMediaType(QuireError, code="unsupported_media_type", status=415):
    """The uploaded bytes are not a supported document type."""


class UnsupportedOutput(QuireError, code="unsupported_output", status=422):
    """This output cannot be produced from this kind of document on this installation."""


class IdempotencyKeyReused(QuireError, code="idempotency_key_reused", status=422):
    """This Idempotency-Key was used with a different request."""


class DocumentQuarantined(QuireError, code="document_quarantined", status=422):
    """This document crashed the converter on repeated attempts and is quarantined for this
    tenant: it is not converted again until the engine changes or an operator lifts the
    quarantine (nothing was written)."""


class RetryLater(QuireError):
    """Not now; retry after a while (the answer carries ``Retry-After``)."""

    def __init__(self, detail: str | None = None, *, retry_after: int) -> None:
        super().__init__(detail, retry_after=retry_after)
        self.retry_after = retry_after


class Rejected(RetryLater):
    """Admission control turned the job away; nothing was written. Retry after a while."""


class DatabaseUnavailable(RetryLater, code="database_unavailable", status=503):
    """The database is unavailable; nothing was written. Retry after a while."""


class TenantQuotaExceeded(Rejected, code="tenant_quota_exceeded", status=429):
    """The tenant has too many live jobs."""


class CapacityExceeded(Rejected, code="capacity_exceeded", status=503):
    """The service is at capacity."""


class IdentityProviderUnavailable(Rejected, code="identity_provider_unavailable", status=503):
    """The identity provider's keys cannot be fetched and none are cached: retry later."""


class StorageUnavailable(RetryLater, code="storage_unavailable", status=503):
    """The artifact store is unavailable (nothing was accepted or served): retry later."""

    def __init__(self, detail: str | None = None, *, retry_after: int = 5) -> None:
        super().__init__(detail, retry_after=retry_after)
