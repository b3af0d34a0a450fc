"""The log redaction filter (conversion_jobs/logging.py)."""

from __future__ import annotations

import logging
import sys

from conversion_jobs.api.auth import token_mint
from conversion_jobs.logging import RedactFilter, redact


def _record(msg: str, *args: object, exc_info: object = None, **extra: object) -> logging.LogRecord:
    record = logging.LogRecord("quire.test", logging.INFO, __file__, 1, msg, args or None, exc_info)
    for key, value in extra.items():
        setattr(record, key, value)
    return record


def _filtered(record: logging.LogRecord) -> logging.LogRecord:
    assert RedactFilter().filter(record) is True
    return record


def test_redact__bearer_token():
    out = redact("Authorization: Bearer abc.def-ghi_jkl=")
    assert "abc.def" not in out
    assert "Bearer [redacted]" in out


def test_redact__bare_jwt():
    jwt = token_mint(tenant="acme-secret-tenant", subject="alice", scopes=["jobs:read"], ttl_s=60)
    out = redact(f"decoded token {jwt} failed")
    assert jwt not in out
    assert jwt.split(".")[1] not in out
    assert "[jwt redacted]" in out


def test_redact__filenames():
    out = redact('Content-Disposition: form-data; name="file"; filename="Payroll 2026.pdf"')
    assert "Payroll" not in out
    out = redact("filename*=UTF-8''salaries.xlsx; size=3")
    assert "salaries" not in out


def test_redact__secrets_in_query_strings_and_urls():
    assert "hunter2" not in redact("GET /x?token=hunter2&x=1")
    assert "hunter2" not in redact("password=hunter2")
    out = redact("connecting to amqp://quire_worker:hunter2@rabbit:5672/quire")
    assert "hunter2" not in out
    assert "quire_worker" in out  # the user is not secret; the password is
    assert "hunter2" not in redact("postgres://postgres:hunter2@db/quire")


def test_redact__leaves_harmless_text_alone():
    text = "job 3f2a queued generation=1 code=broker_timeout"
    assert redact(text) == text


def test_redact_filter__formats_args_before_redacting():
    record = _filtered(_record("auth header %s for job %s", "Bearer sekrit.tok", "j1"))
    assert record.getMessage() == "auth header Bearer [redacted] for job j1"
    assert record.args is None


def test_redact_filter__secret_named_attributes():
    record = _filtered(
        _record(
            "x", token="t0k", upload_filename="a.pdf", content=b"%PDF", page_text="hello", code="ok"
        )
    )
    assert (
        record.token == record.upload_filename == record.content == record.page_text == "[redacted]"
    )
    assert record.code == "ok"


def test_redact_filter__exception_text():
    try:
        raise ValueError("bad token=hunter2")
    except ValueError:
        record = _record("failed", exc_info=sys.exc_info())
    record.exc_text = logging.Formatter().formatException(record.exc_info)
    _filtered(record)
    assert "hunter2" not in record.exc_text
    assert "hunter2" not in logging.Formatter().format(record)


def test_redact_filter__broken_format_string_keeps_template():
    record = _filtered(_record("value %d with Bearer abc", "not-a-number"))
    assert "abc" not in record.getMessage()


def test_redact_filter__end_to_end_through_a_handler(caplog):
    logger = logging.getLogger("quire.test.redact")
    caplog.handler.addFilter(RedactFilter())
    try:
        logger.warning("upload filename=%s by Bearer %s", "contract.pdf", "xyz.abc")
    finally:
        caplog.handler.removeFilter(caplog.handler.filters[-1])
    assert "contract" not in caplog.text
    assert "xyz.abc" not in caplog.text


def test_redact__one_scan_decides_as_every_pattern_would():
    """``_ANY`` (one scan) finds something exactly when one of the patterns would: a message it
    passes unchanged is one no pattern rewrites."""
    from conversion_jobs.logging import _ANY, _PATTERNS

    messages = [
        "POST /api/v1/jobs 202 12.3ms 1083B",
        "GET /api/v1/jobs?cursor&limit 200 3.1ms 20B",
        "GET /api/v1/jobs/report.PDF 404 1.0ms 90B",
        "authorization: BEARER abc",
        "eyJa.eyJb.c",
        "EYJa.eyJb.c",
        'Content-Disposition: form-data; FILENAME="x"',
        "PASSWORD=hunter2",
        "postgres://quire:pw@db/quire",
        "POSTGRES://quire:pw@db/quire",
        "AMQP://u:p@h/v",
        "plain text with a dot. and 1.5 numbers",
    ]
    for message in messages:
        rewritten = message
        for pattern, replacement in _PATTERNS:
            rewritten = pattern.sub(replacement, rewritten)
        assert (_ANY.search(message) is not None) == any(p.search(message) for p, _ in _PATTERNS)
        assert redact(message) == rewritten
