"""Bearer JWT authentication (docs/API_CONTRACT.md §1). The tenant comes from the verified
token only.

Two key sources, never both at once:

* a shared secret (HS256), for development and the standalone profile;
* an identity provider's JWKS URL (``QUIRE_JWT_JWKS_URL``): RS256 / ES256 only, ``iss`` and
  ``aud`` required and checked, keys cached and refreshed on an unknown ``kid`` at a bounded
  rate (docs/adr/0014-web-hardening.md). While the IdP is unreachable the cached keys keep
  working; with no key cached at all the answer is 503 ``identity_provider_unavailable``.

A claim that does not fit what Quire stores (an over-long tenant, a control character) makes the
token invalid: it is never truncated or cleaned, so two tenants can never collapse into one.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Any

import jwt
from django.conf import settings
from rest_framework.authentication import BaseAuthentication, get_authorization_header
from rest_framework.permissions import BasePermission
from rest_framework.request import Request

from conversion_jobs.exceptions import (
    IdentityProviderUnavailable,
    InvalidToken,
    NotAuthenticated,
    PermissionDenied,
)
from conversion_jobs.pseudonym import actor_pseudonym

log = logging.getLogger(__name__)

#: ``tenants:erase`` is an operator's scope (POST /api/v1/erasures): never in a tenant's token.
SCOPES = (
    "jobs:submit",
    "jobs:read",
    "jobs:cancel",
    "jobs:admin",
    "webhooks:manage",
    "tenants:erase",
)
#: Asymmetric algorithms accepted from an identity provider's JWKS (never HS*: the public key
#: must not double as a shared secret).
JWKS_ALGORITHMS = ("RS256", "ES256")
#: What the columns and the pseudonym keys hold (conversion_job.tenant is varchar(64)).
TENANT_MAX = 64
SUBJECT_MAX = 255
SCOPE_MAX = 1024
#: A token is read at all only up to this size (a header line of a few kB at most).
TOKEN_MAX = 8192


@dataclass(frozen=True)
class Principal:
    subject: str
    tenant: str
    scopes: frozenset[str]

    is_authenticated = True

    @property
    def actor(self) -> str:
        return actor_pseudonym(tenant=self.tenant, subject=self.subject)


def _fits(value: Any, *, max_len: int, allow_empty: bool = False) -> bool:
    """A printable string of at most ``max_len`` characters (no control characters: NUL cannot
    be stored by Postgres, and newlines or escapes have no business in an identifier)."""
    return (
        isinstance(value, str)
        and (allow_empty or bool(value))
        and len(value) <= max_len
        and value.isprintable()
    )


#: RFC 7519 §2 NumericDate claims: JSON numbers only. PyJWT converts with ``int()``, so a
#: string ``"exp": "1999999999"`` or a boolean ``"iat": true`` would otherwise pass.
NUMERIC_DATE_CLAIMS = ("exp", "nbf", "iat")


def _is_numeric_date(value: Any) -> bool:
    """A JSON number (not a bool, which Python counts as an int) that is a finite float: an
    integer too large for one is no date either (and would overflow the cache's arithmetic)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def _numeric_dates(claims: dict[str, Any]) -> None:
    for claim in NUMERIC_DATE_CLAIMS:
        if claim in claims and not _is_numeric_date(claims[claim]):
            raise InvalidToken(f"the {claim} claim must be a number (RFC 7519 NumericDate)")


def _principal_from(claims: dict[str, Any]) -> Principal:
    tenant, subject, scope = claims["tenant"], claims["sub"], claims["scope"]
    if not _fits(tenant, max_len=TENANT_MAX):
        raise InvalidToken(f"the tenant claim must be 1-{TENANT_MAX} printable characters")
    if not _fits(subject, max_len=SUBJECT_MAX):
        raise InvalidToken(f"the sub claim must be 1-{SUBJECT_MAX} printable characters")
    if not _fits(scope, max_len=SCOPE_MAX, allow_empty=True):
        raise InvalidToken(f"the scope claim must be at most {SCOPE_MAX} printable characters")
    return Principal(subject=subject, tenant=tenant, scopes=frozenset(scope.split()))


class JwksKeys:
    """The signing keys of one JWKS URL, fetched with PyJWT's ``PyJWKClient``.

    Keys are refetched when older than ``lifespan_s`` or when a token names an unknown ``kid``
    (rotation), but never more often than every ``min_refresh_s``, so a flood of tokens with
    made-up ``kid``s cannot turn Quire into an amplifier against the IdP. A failed refresh keeps
    the keys already known (an IdP outage does not log everybody out); only with no key known
    at all is the IdP reported unavailable.
    """

    def __init__(
        self, url: str, *, lifespan_s: float, min_refresh_s: float, timeout_s: float
    ) -> None:
        self._client = jwt.PyJWKClient(
            url, cache_keys=False, cache_jwk_set=False, timeout=timeout_s
        )
        self.lifespan_s = lifespan_s
        self.min_refresh_s = min_refresh_s
        self.retry_after_s = max(1, round(min_refresh_s))
        self._keys: dict[str, jwt.PyJWK] = {}
        self._fetched_at = float("-inf")
        self._attempted_at = float("-inf")
        self._lock = threading.Lock()
        #: Bumped by every successful refresh (the token cache's entries die with it).
        self.generation = 0

    def key_for(self, kid: str) -> jwt.PyJWK:
        with self._lock:
            now = time.monotonic()
            wanted = kid not in self._keys or now - self._fetched_at > self.lifespan_s
            if wanted and now - self._attempted_at >= self.min_refresh_s:
                self._refresh(now)
            key = self._keys.get(kid)
            known = bool(self._keys)
        if key is not None:
            return key
        if not known:
            raise IdentityProviderUnavailable(retry_after=self.retry_after_s)
        raise InvalidToken("the token's signing key is not published by the identity provider")

    def _refresh(self, now: float) -> None:
        self._attempted_at = now
        try:
            keys = self._client.get_signing_keys(refresh=True)
        except (jwt.PyJWTError, ValueError) as exc:
            # PyJWKClientConnectionError (network, HTTP status), PyJWKSetError / PyJWKClientError
            # (a keyless or malformed set), ValueError (a body that is not JSON).
            log.warning(
                "jwks refresh failed; keeping %d cached key(s)",
                len(self._keys),
                extra={"error": type(exc).__name__},
            )
            return
        self._keys = {
            key.key_id: key for key in keys if key.key_id and key.algorithm_name in JWKS_ALGORITHMS
        }
        self._fetched_at = now
        self.generation += 1


@functools.lru_cache(maxsize=4)
def jwks_keys(url: str, lifespan_s: float, min_refresh_s: float, timeout_s: float) -> JwksKeys:
    """One key cache per configuration and process (settings are read on every call, so a test
    that points at another URL gets its own cache)."""
    return JwksKeys(url, lifespan_s=lifespan_s, min_refresh_s=min_refresh_s, timeout_s=timeout_s)


def _decode_jwks(token: str, config: dict[str, Any]) -> dict[str, Any]:
    try:
        header = jwt.get_unverified_header(token)
    except jwt.PyJWTError as exc:
        raise InvalidToken() from exc
    kid = header.get("kid")
    if (
        header.get("alg") not in JWKS_ALGORITHMS
        or not isinstance(kid, str)
        or not _fits(kid, max_len=256)
    ):
        raise InvalidToken("the token must be RS256 or ES256 and name its key (kid)")
    key = jwks_keys(
        config["JWT_JWKS_URL"],
        float(config["JWT_JWKS_LIFESPAN_S"]),
        float(config["JWT_JWKS_MIN_REFRESH_S"]),
        float(config["JWT_JWKS_TIMEOUT_S"]),
    ).key_for(kid)
    return jwt.decode(
        token,
        key,
        algorithms=list(JWKS_ALGORITHMS),
        issuer=config["JWT_ISSUER"],
        audience=config["JWT_AUDIENCE"],
        options={"require": ["sub", "tenant", "scope", "exp", "iss", "aud"]},
        leeway=float(config["JWT_LEEWAY_S"]),
    )


def _decode_shared_secret(token: str, config: dict[str, Any]) -> dict[str, Any]:
    required = ["sub", "tenant", "scope", "exp"]
    required += [
        claim
        for claim, name in (("iss", "JWT_ISSUER"), ("aud", "JWT_AUDIENCE"))
        if config.get(name)
    ]
    return jwt.decode(
        token,
        config["JWT_KEY"],
        algorithms=[str(config["JWT_ALGORITHM"])],
        issuer=config.get("JWT_ISSUER") or None,
        audience=config.get("JWT_AUDIENCE") or None,
        options={"require": required, "verify_aud": bool(config.get("JWT_AUDIENCE"))},
        leeway=float(config["JWT_LEEWAY_S"]),
    )


#: Verified tokens by the SHA-256 of the token (ADR 0017 addendum): a client sends the same
#: token on every request, and verifying it (base64, JSON, HMAC or RSA) was ~10 % of an
#: acceptance's web CPU. An entry is used until the token expires (``exp`` + leeway, exactly
#: when PyJWT would refuse it) and at most ``QUIRE_JWT_CACHE_S`` (so a JWKS key withdrawn by the
#: issuer stops being honoured within that bound). Only successes are cached; the cache is
#: per process and cleared when it reaches ``_VERIFIED_MAX`` entries.
_verified: dict[bytes, tuple[float, Principal]] = {}
_VERIFIED_MAX = 10_000


def _verifier(config: dict[str, Any]) -> str:
    """What a verification depends on besides the token, as part of the cache key: another
    key, issuer or audience is a miss, and so is every token after a JWKS refresh (a withdrawn
    key stops verifying the moment the new set is fetched, cached or not)."""
    common = f"{config.get('JWT_ISSUER')}\0{config.get('JWT_AUDIENCE')}\0"
    if config.get("JWT_JWKS_URL"):
        keys = jwks_keys(
            config["JWT_JWKS_URL"],
            float(config["JWT_JWKS_LIFESPAN_S"]),
            float(config["JWT_JWKS_MIN_REFRESH_S"]),
            float(config["JWT_JWKS_TIMEOUT_S"]),
        )
        return f"jwks\0{config['JWT_JWKS_URL']}\0{keys.generation}\0{common}"
    return f"secret\0{config['JWT_KEY']}\0{config.get('JWT_ALGORITHM')}\0{common}"


def token_decode(token: str) -> Principal:
    config = settings.QUIRE
    if len(token) > TOKEN_MAX:
        raise InvalidToken()
    cache_s = float(config.get("JWT_CACHE_S", 0))
    now = time.time()
    if cache_s > 0:
        digest = hashlib.sha256((_verifier(config) + token).encode()).digest()
        hit = _verified.get(digest)
        if hit is not None and now < hit[0]:
            return hit[1]
    try:
        if config.get("JWT_JWKS_URL"):
            claims = _decode_jwks(token, config)
        else:
            claims = _decode_shared_secret(token, config)
    except jwt.PyJWTError as exc:
        raise InvalidToken() from exc
    # On every verification (both key sources); only a token that passed is ever cached.
    _numeric_dates(claims)
    principal = _principal_from(claims)
    if cache_s > 0:
        until = min(float(claims["exp"]) + float(config["JWT_LEEWAY_S"]), now + cache_s)
        if len(_verified) >= _VERIFIED_MAX:
            _verified.clear()
        _verified[digest] = (until, principal)
    return principal


def token_mint(*, tenant: str, subject: str, scopes: list[str], ttl_s: int) -> str:
    """A development token signed with the shared secret (manage.py mint_token)."""
    config = settings.QUIRE
    now = int(time.time())
    claims: dict[str, Any] = {
        "sub": subject,
        "tenant": tenant,
        "scope": " ".join(scopes),
        "iat": now,
        "exp": now + ttl_s,
    }
    if config.get("JWT_ISSUER"):
        claims["iss"] = config["JWT_ISSUER"]
    if config.get("JWT_AUDIENCE"):
        claims["aud"] = config["JWT_AUDIENCE"]
    return jwt.encode(claims, config["JWT_KEY"], algorithm=str(config["JWT_ALGORITHM"]))


class BearerJWTAuthentication(BaseAuthentication):
    def authenticate(self, request: Request) -> tuple[Principal, str] | None:
        header = get_authorization_header(request).split()
        if not header or header[0].lower() != b"bearer":
            return None
        if len(header) != 2:
            raise InvalidToken("the Authorization header must be 'Bearer <token>'")
        token = header[1].decode("ascii", errors="replace")
        return token_decode(token), token

    def authenticate_header(self, request: Request) -> str:
        return 'Bearer realm="quire"'


class HasScope(BasePermission):
    """Requires the view's ``required_scopes[method]`` (authentication first: 401 before 403)."""

    def has_permission(self, request: Request, view: Any) -> bool:
        principal = request.user
        if not isinstance(principal, Principal):
            raise NotAuthenticated()
        scope = getattr(view, "required_scopes", {}).get(request.method)
        if scope and scope not in principal.scopes:
            raise PermissionDenied(f"this operation needs the {scope} scope")
        return True
