"""Document passwords (``options.password``; ADR 0019): sealed at rest, keyed in the identity.

A password reaches the service in the submit request and must open the document on every
attempt, including a retry after a worker crash, so it is kept until the job is terminal —
sealed with Fernet (AES-128-CBC + HMAC-SHA256) under a key derived from ``QUIRE_PASSWORD_KEY``,
in ``conversion_job.password_sealed``, never in ``options``, a log, an audit event, the broker
message or an API answer. When the job is terminal the worker (or, for jobs that end without one,
the sweep) sets it to NULL. The content identity and the idempotency fingerprint carry a keyed
HMAC of it (``password_hmac``), so the same file with another password is another job and the
clear password is never hashed unkeyed.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import uuid

from cryptography.fernet import Fernet, InvalidToken
from django.conf import settings

from conversion_jobs.models import ConversionJob
from conversion_jobs.states import TERMINAL_STATES

#: The option key that replaces the password in the stored options and the identity.
IDENTITY_KEY = "password_hmac"


def _key(purpose: bytes) -> bytes:
    secret = settings.QUIRE["PASSWORD_KEY"].encode()
    return hmac.new(secret, b"quire-password:" + purpose, hashlib.sha256).digest()


def _fernet(purpose: bytes = b"seal") -> Fernet:
    return Fernet(base64.urlsafe_b64encode(_key(purpose)))


def seal_for(value: str, *, purpose: bytes) -> str:
    """``value`` sealed under the service key's ``purpose`` subkey (webhook signing secrets use
    ``b"webhook-secret"``: conversion_jobs/webhooks/signing.py)."""
    return _fernet(purpose).encrypt(value.encode()).decode()


def unseal_for(token: str, *, purpose: bytes) -> str | None:
    """The value sealed by ``seal_for``, or None (another key)."""
    try:
        return _fernet(purpose).decrypt(token.encode()).decode()
    except InvalidToken:
        return None


def seal(password: str) -> str:
    return _fernet().encrypt(password.encode()).decode()


def unseal(token: str) -> str | None:
    """The password, or None if the token cannot be opened (e.g. the key was rotated)."""
    try:
        return _fernet().decrypt(token.encode()).decode()
    except InvalidToken:
        return None


def identity(password: str) -> str:
    """A keyed HMAC of the password: stable for the content identity, useless without the key."""
    return hmac.new(_key(b"identity"), password.encode(), hashlib.sha256).hexdigest()


def sealed_passwords_wipe(*, job_id: uuid.UUID | None = None) -> int:
    """Set ``password_sealed`` to NULL for terminal jobs (one job, or all). The worker calls it
    for its job when the attempt ends the job; the work-directory sweep for everything else
    (a job cancelled while queued, dead-lettered by a sweep)."""
    rows = ConversionJob.objects.filter(
        password_sealed__isnull=False, state__in=list(TERMINAL_STATES)
    )
    if job_id is not None:
        rows = rows.filter(id=job_id)
    return rows.update(password_sealed=None)
