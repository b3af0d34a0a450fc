"""Content-free logging (docs/THREAT_MODEL.md §3): a filter that redacts what must never be logged.

Code never logs content, file names or tokens on purpose; this filter is the net under that
rule. It drops bearer tokens and JWTs, ``filename=`` parameters and multipart headers, and any
record attribute named like a secret, from every record before a handler formats it.
"""

from __future__ import annotations

import functools
import logging
import re

_PATTERNS = [
    (re.compile(r"(?i)bearer\s+[A-Za-z0-9\-_\.=]+"), "Bearer [redacted]"),
    (re.compile(r"eyJ[A-Za-z0-9_\-]+\.[A-Za-z0-9_\-]+\.[A-Za-z0-9_\-]*"), "[jwt redacted]"),
    (re.compile(r'(?i)filename\*?=("[^"]*"|[^;\s]+)'), "filename=[redacted]"),
    # Anything that looks like a document file name.
    (
        re.compile(
            r"(?i)[^\s\"'/\\]+\.(pdf|docx?|odt|ods|odp|rtf|pptx?|xlsx?|png|jpe?g|tiff?|txt|zip)\b"
        ),
        "[file redacted]",
    ),
    (re.compile(r"(?i)(password|passwd|secret|token)=([^&\s]+)"), r"\1=[redacted]"),
    (re.compile(r"(amqps?|postgres(?:ql)?)://([^:/@\s]+):([^@\s]+)@"), r"\1://\2:[redacted]@"),
]
_SECRET_ATTRS = re.compile(
    r"(?i)(token|password|secret|authorization|file|upload|content|text|tenant|subject)"
)
_STANDARD = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}


#: Any of ``_PATTERNS`` (each with its own flags): one scan finds that a message - an access
#: line, say - has nothing to redact, instead of one scan per pattern (ADR 0017, session 7).
_ANY = re.compile(
    "|".join(
        f"(?{'i' if p.flags & re.IGNORECASE else '-i'}:{p.pattern.removeprefix('(?i)')})"
        for p, _ in _PATTERNS
    )
)


def redact(text: str) -> str:
    if _ANY.search(text) is None:
        return text
    for pattern, replacement in _PATTERNS:
        text = pattern.sub(replacement, text)
    return text


class RedactFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a broken format string: keep the template only
            message = str(record.msg)
        record.msg, record.args = redact(message), None
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        for name in list(record.__dict__):
            if name not in _STANDARD and _secret_attr(name):
                setattr(record, name, "[redacted]")
        return True


@functools.lru_cache(maxsize=1024)
def _secret_attr(name: str) -> bool:
    """Whether a record attribute's name says it may hold a secret (memoised: the names come
    from the code, a handful per logger; every access-log line asked for six of them)."""
    return _SECRET_ATTRS.search(name) is not None
