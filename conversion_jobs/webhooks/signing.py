"""Standard Webhooks signatures (https://www.standardwebhooks.com/, docs/API_CONTRACT.md §9).

A secret is ``whsec_`` + base64 of 32 random bytes, made here, shown to the tenant once and kept
sealed (``passwords.seal_for``, the service key's ``webhook-secret`` subkey). The signature of
a delivery is ``v1,<base64 HMAC-SHA256(secret bytes, "{id}.{timestamp}.{body}")>``; during a
rotation's grace the previous secret signs too, the two space separated."""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets

from conversion_jobs import passwords

PREFIX = "whsec_"
SECRET_BYTES = 32
_PURPOSE = b"webhook-secret"


def secret_new() -> str:
    return PREFIX + base64.b64encode(secrets.token_bytes(SECRET_BYTES)).decode()


def secret_seal(secret: str) -> str:
    return passwords.seal_for(secret, purpose=_PURPOSE)


def secret_unseal(sealed: str) -> str | None:
    """The secret, or None (sealed under another key: the endpoint cannot sign)."""
    return passwords.unseal_for(sealed, purpose=_PURPOSE)


def signature(*, secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    key = base64.b64decode(secret.removeprefix(PREFIX))
    signed = f"{msg_id}.{timestamp}.".encode() + body
    return "v1," + base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()


def headers(*, secrets_: list[str], msg_id: str, timestamp: int, body: bytes) -> dict[str, str]:
    """The three Standard Webhooks headers, signed with every secret in ``secrets_``."""
    return {
        "webhook-id": msg_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": " ".join(
            signature(secret=s, msg_id=msg_id, timestamp=timestamp, body=body) for s in secrets_
        ),
        "Content-Type": "application/json",
    }
