"""Conversion errors. Each carries a stable ``code`` and whether retrying can help.

This module must stay importable without Django: the isolated child imports it.
"""

from __future__ import annotations

from conversion_jobs.exceptions import QuireError


class ConversionError(QuireError):
    """The conversion failed."""

    code: str = "conversion_failed"
    retryable: bool = False

    def __init__(self, detail: str | None = None, *, public: bool = False, **extra: object):
        super().__init__(detail, **extra)
        #: ``detail`` holds nothing of the document (no text, names or engine output), so it
        #: may be the job's ``error.detail``; otherwise that is the code (docs/API_CONTRACT.md §5)
        self.public = public


class EncryptedInput(ConversionError, code="encrypted_input"):
    """The document is encrypted and needs a password."""


class InvalidPassword(ConversionError, code="invalid_password"):
    """The document is encrypted and the password given does not open it."""


class PasswordRequired(ConversionError, code="password_required"):
    """The job's password can no longer be read (the service key changed); submit it again."""


class SourceMissing(ConversionError, code="source_missing"):
    """The job's inline source is gone (its row was deleted); submit the document again."""


class InvalidInput(ConversionError, code="invalid_input"):
    """The input is damaged or not what it claims to be."""


class InputTooLarge(ConversionError, code="input_too_large"):
    """The input exceeds a page, pixel, size or inflated-size limit."""


class ConversionLostContent(ConversionError, code="conversion_lost_content"):
    """The document has text, but the engine's PDF of it has none on any page."""


class ConversionTimeout(ConversionError, code="conversion_timeout"):
    """The converter did not finish within its time limit."""


class UnsupportedConversion(ConversionError, code="unsupported_conversion"):
    """This input type cannot be converted to the requested output here."""


class ConverterCrashed(ConversionError, code="converter_crashed", retryable=True):
    """The converter process crashed (signal, out of memory or unexpected exit)."""


class ConversionStarved(ConversionError, code="conversion_starved", retryable=True):
    """A conversion that stepped aside reached its wall clock cap with less CPU time than its
    limit: the load starved it. Not a crash: the attempt yields (ADR 0022, "Stepping aside")."""


class ConversionStopped(ConversionError, code="conversion_stopped"):
    """The conversion was stopped on request (cancellation, lost lease); not an input fault."""


#: code -> class, used to rebuild an error reported by the isolated child.
ERRORS_BY_CODE: dict[str, type[ConversionError]] = {
    cls.code: cls
    for cls in (
        EncryptedInput,
        InvalidPassword,
        PasswordRequired,
        InvalidInput,
        InputTooLarge,
        ConversionLostContent,
        ConversionTimeout,
        UnsupportedConversion,
        ConverterCrashed,
        ConversionStopped,
    )
}


def error_from_code(
    code: str, detail: str | None = None, *, public: bool = False
) -> ConversionError:
    """The error for a code reported by the child; unknown codes count as a crash."""
    cls = ERRORS_BY_CODE.get(code)
    if cls is None:
        return ConverterCrashed(f"unknown error code from converter: {code}: {detail}")
    return cls(detail, public=public)


def error_from_answer(answer: dict) -> ConversionError:
    """The error of a child's failed answer (``code``, ``detail``, ``public``; child.py)."""
    return error_from_code(
        answer["code"], answer.get("detail"), public=answer.get("public") is True
    )
