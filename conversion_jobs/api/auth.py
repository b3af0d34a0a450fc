"""Bearer JWT authentication (DESIGN.md §9). The tenant comes from the verified token only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jwt
from django.conf import settings
from rest_framework.authentication import BaseAuthentication, get_authorization_header
from rest_framework.permissions import BasePermission
from rest_framework.request import Request

from conversion_jobs.exceptions import NotAuthenticated, PermissionDenied
from conversion_jobs.pseudonym import actor_pseudonym

SCOPES = ("jobs:submit", "jobs:read", "jobs:cancel", "jobs:admin")


@dataclass(frozen=True)
class Principal:
    subject: str
    tenant: str
    scopes: frozenset[str]

    is_authenticated = True

    @property
    def actor(self) -> str:
        return actor_pseudonym(tenant=self.tenant, subject=self.subject)


def token_decode(token: str) -> Principal:
    try:
        claims = jwt.decode(
            token,
            settings.QUIRE["JWT_KEY"],
            algorithms=[str(settings.QUIRE["JWT_ALGORITHM"])],
            options={"require": ["sub", "tenant", "scope", "exp"]},
        )
    except jwt.PyJWTError as exc:
        raise NotAuthenticated("the bearer token is invalid or expired") from exc
    tenant, subject, scope = claims["tenant"], claims["sub"], claims["scope"]
    if not all(isinstance(v, str) and v for v in (tenant, subject)) or not isinstance(scope, str):
        raise NotAuthenticated("the bearer token is invalid or expired")
    return Principal(subject=subject, tenant=tenant[:64], scopes=frozenset(scope.split()))


def token_mint(*, tenant: str, subject: str, scopes: list[str], ttl_s: int) -> str:
    import time

    now = int(time.time())
    claims: dict[str, Any] = {
        "sub": subject,
        "tenant": tenant,
        "scope": " ".join(scopes),
        "iat": now,
        "exp": now + ttl_s,
    }
    return jwt.encode(
        claims, settings.QUIRE["JWT_KEY"], algorithm=str(settings.QUIRE["JWT_ALGORITHM"])
    )


class BearerJWTAuthentication(BaseAuthentication):
    def authenticate(self, request: Request) -> tuple[Principal, str] | None:
        header = get_authorization_header(request).split()
        if not header or header[0].lower() != b"bearer":
            return None
        if len(header) != 2:
            raise NotAuthenticated("the Authorization header must be 'Bearer <token>'")
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
