"""JWT decoding (conversion_jobs/api/auth.py): expired, tampered, missing claims."""

from __future__ import annotations

import base64
import json
import time

import jwt
import pytest
from django.conf import settings

from conversion_jobs.api.auth import Principal, token_decode, token_mint
from conversion_jobs.exceptions import InvalidToken, NotAuthenticated


def _encode(claims: dict, key: str | None = None, algorithm: str = "HS256") -> str:
    return jwt.encode(claims, key or settings.QUIRE["JWT_KEY"], algorithm=algorithm)


def _claims(**overrides: object) -> dict:
    claims = {
        "sub": "alice",
        "tenant": "acme",
        "scope": "jobs:read jobs:submit",
        "exp": int(time.time()) + 60,
    }
    claims.update(overrides)
    return {k: v for k, v in claims.items() if v is not None}


def test_token_decode__valid():
    principal = token_decode(
        token_mint(tenant="acme", subject="alice", scopes=["jobs:read"], ttl_s=60)
    )
    assert principal == Principal(subject="alice", tenant="acme", scopes=frozenset({"jobs:read"}))
    assert principal.is_authenticated


def test_token_decode__scopes_split_on_spaces():
    assert token_decode(_encode(_claims())).scopes == {"jobs:read", "jobs:submit"}
    assert token_decode(_encode(_claims(scope=""))).scopes == frozenset()


def test_token_decode__expired():
    with pytest.raises(NotAuthenticated):
        token_decode(token_mint(tenant="acme", subject="alice", scopes=["jobs:read"], ttl_s=-1))


def test_token_decode__tampered_payload():
    token = _encode(_claims())
    header, payload, signature = token.split(".")
    claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    claims["tenant"] = "victim"
    forged = base64.urlsafe_b64encode(json.dumps(claims).encode()).decode().rstrip("=")
    with pytest.raises(NotAuthenticated):
        token_decode(f"{header}.{forged}.{signature}")


def test_token_decode__wrong_key():
    with pytest.raises(NotAuthenticated):
        token_decode(_encode(_claims(), key="another-key-of-sufficient-length-0123456789"))


def test_token_decode__alg_none_rejected():
    with pytest.raises(NotAuthenticated):
        token_decode(jwt.encode(_claims(), key=None, algorithm="none"))


@pytest.mark.parametrize("missing", ["sub", "tenant", "scope", "exp"])
def test_token_decode__missing_claim(missing):
    claims = _claims()
    del claims[missing]
    with pytest.raises(NotAuthenticated):
        token_decode(_encode(claims))


@pytest.mark.parametrize(
    "overrides",
    [{"tenant": ""}, {"sub": ""}, {"tenant": 7}, {"sub": ["a"]}, {"scope": ["jobs:read"]}],
)
def test_token_decode__malformed_claims(overrides):
    with pytest.raises(NotAuthenticated):
        token_decode(_encode(_claims(**overrides)))


@pytest.mark.parametrize("garbage", ["", "abc", "a.b.c", "Bearer x"])
def test_token_decode__garbage(garbage):
    with pytest.raises(NotAuthenticated):
        token_decode(garbage)


@pytest.mark.parametrize(
    "overrides",
    [
        {"tenant": "t" * 65},
        {"tenant": "t" * 1000},
        {"tenant": "acme\x00"},
        {"tenant": "acme\nbeta"},
        {"sub": "s" * 256},
        {"sub": "alice\x00"},
        {"scope": "jobs:read " * 200},
        {"scope": "jobs:read\x00"},
    ],
    ids=lambda o: f"{next(iter(o))}:{len(next(iter(o.values())))}",
)
def test_token_decode__claim_that_does_not_fit_is_invalid_token(overrides):
    """Never truncated or cleaned: a claim Quire cannot store as it is makes the token invalid."""
    with pytest.raises(InvalidToken):
        token_decode(_encode(_claims(**overrides)))


def test_token_decode__tenant_at_the_column_limit_is_kept_whole():
    tenant = "t" * 63 + "x"
    assert token_decode(_encode(_claims(tenant=tenant))).tenant == tenant


def test_token_decode__over_long_token_is_rejected_before_parsing():
    with pytest.raises(InvalidToken):
        token_decode("a" * 10_000)


#: Far enough ahead for a parametrized case collected long before it runs.
_LATER = int(time.time()) + 3600


@pytest.mark.parametrize(
    "overrides",
    [
        {"exp": str(_LATER)},
        {"exp": f"{_LATER}.5"},
        {"exp": True},
        {"exp": [_LATER]},
        {"exp": {"at": _LATER}},
        {"exp": 10**400},
        {"iat": "0"},
        {"iat": True},
        {"iat": False},
        {"nbf": "0"},
        {"nbf": True},
        {"nbf": [0]},
    ],
    ids=lambda o: f"{next(iter(o))}:{type(next(iter(o.values()))).__name__}",
)
def test_token_decode__numeric_date_that_is_not_a_number_is_invalid_token(overrides):
    """RFC 7519 §2 NumericDate is a JSON number: PyJWT's int() would take "1999999999" or
    true (an ``iat`` / ``nbf`` of true is 1, long past, so accepted)."""
    with pytest.raises(InvalidToken) as refused:
        token_decode(_encode(_claims(**overrides)))
    assert refused.value.code == "invalid_token"


@pytest.mark.parametrize(
    "overrides",
    [
        {"exp": _LATER + 0.5},
        {"exp": _LATER, "iat": time.time() - 60.25, "nbf": time.time() - 60},
        {"exp": float(_LATER), "iat": 0, "nbf": 0.0},
    ],
    ids=["float_exp", "float_iat", "all_numbers"],
)
def test_token_decode__numeric_dates_int_or_float_are_accepted(overrides):
    assert token_decode(_encode(_claims(**overrides))).tenant == "acme"


def test_token_decode__numeric_date_is_checked_with_the_verified_cache_on(settings):
    """A refused token is never cached, so the check runs on every presentation; a cached valid
    token does not vouch for another one with the same claims but a string exp."""
    settings.QUIRE = {**settings.QUIRE, "JWT_CACHE_S": 60.0}
    good = _encode(_claims())
    assert token_decode(good).tenant == "acme"
    assert token_decode(good).tenant == "acme"  # from the cache
    stringy = _encode(_claims(exp=str(_LATER)))
    for _ in range(2):
        with pytest.raises(InvalidToken):
            token_decode(stringy)


@pytest.mark.parametrize("missing", ["QUIRE_JWT_ISSUER", "QUIRE_JWT_AUDIENCE"])
def test_settings__jwks_without_issuer_or_audience_refuses_to_load(missing):
    import os
    import subprocess
    import sys

    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "project.settings",
        "QUIRE_JWT_JWKS_URL": "https://idp.example/jwks.json",
        "QUIRE_JWT_ISSUER": "https://idp.example/",
        "QUIRE_JWT_AUDIENCE": "quire-api",
    }
    del env[missing]
    result = subprocess.run(
        [sys.executable, "-c", "import django; django.setup()"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert "QUIRE_JWT_JWKS_URL needs QUIRE_JWT_ISSUER and QUIRE_JWT_AUDIENCE" in result.stderr
