"""Tokens from an identity provider's JWKS (docs/API_CONTRACT.md §1, issue 10 §5): a real JWKS
served over HTTP by the test, keys generated and rotated here, the server stopped for an outage."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from rest_framework.test import APIClient

from conversion_jobs.api import auth
from tests.conftest import token as shared_secret_token
from tests.integration.api.conftest import problem
from tests.jwks_server import AUDIENCE, ISSUER, JwksServer, SigningKey

MIN_REFRESH_S = 0.5


@pytest.fixture
def idp(settings: Any) -> Iterator[JwksServer]:
    server = JwksServer()
    server.keys = [SigningKey("RS256"), SigningKey("ES256")]
    auth.jwks_keys.cache_clear()
    settings.QUIRE = {
        **settings.QUIRE,
        "JWT_JWKS_URL": server.url,
        "JWT_ISSUER": ISSUER,
        "JWT_AUDIENCE": AUDIENCE,
        "JWT_JWKS_LIFESPAN_S": 300.0,
        "JWT_JWKS_MIN_REFRESH_S": MIN_REFRESH_S,
        "JWT_JWKS_TIMEOUT_S": 2.0,
    }
    yield server
    server.stop()
    auth.jwks_keys.cache_clear()


def _get(bearer: str) -> Any:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {bearer}")
    return client.get("/api/v1/jobs")


@pytest.mark.django_db
@pytest.mark.parametrize("index", [0, 1], ids=["RS256", "ES256"])
def test_jwks__token_signed_by_a_published_key_is_accepted(idp, index, make_job):
    job = make_job(tenant="tenant-a")
    response = _get(idp.keys[index].sign())
    assert response.status_code == 200, response.content
    assert [j["id"] for j in response.json()["jobs"]] == [str(job.id)]
    assert idp.requests == 1


@pytest.mark.django_db
@pytest.mark.parametrize(
    "claims",
    [
        {"iss": "https://evil.example/"},
        {"iss": None},
        {"aud": "another-api"},
        {"aud": None},
        {"exp": int(time.time()) - 60},
        {"tenant": "t" * 65},
        {"exp": str(int(time.time()) + 600)},
        {"iat": True},
        {"nbf": "0"},
    ],
    ids=[
        "wrong_iss",
        "no_iss",
        "wrong_aud",
        "no_aud",
        "expired",
        "long_tenant",
        "string_exp",
        "bool_iat",
        "string_nbf",
    ],
)
def test_jwks__bad_claims_are_401(idp, claims):
    response = _get(idp.keys[0].sign(**claims))
    problem(response, 401, "invalid_token")


@pytest.mark.django_db
def test_jwks__shared_secret_and_algorithm_confusion_are_refused(idp):
    """With an IdP configured the development secret signs nothing, and the RSA public key
    cannot be used as an HMAC secret."""
    problem(_get(shared_secret_token()), 401, "invalid_token")
    pem = (
        idp.keys[0]
        .private.public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    claims = {
        "sub": "x",
        "tenant": "tenant-a",
        "scope": "jobs:read",
        "iss": ISSUER,
        "aud": AUDIENCE,
        "exp": int(time.time()) + 60,
    }
    kid = {"kid": idp.keys[0].kid}
    problem(_get(_hmac_with_pem(claims, pem, {**kid, "alg": "HS256"})), 401, "invalid_token")
    unsigned = jwt.encode(claims, None, algorithm="none", headers=kid)
    problem(_get(unsigned), 401, "invalid_token")


def _hmac_with_pem(claims: dict, pem: bytes, header: dict) -> str:
    import base64
    import hashlib
    import hmac
    import json

    def b64(data: bytes) -> bytes:
        return base64.urlsafe_b64encode(data).rstrip(b"=")

    signing_input = (
        b64(json.dumps({**header, "typ": "JWT"}).encode()) + b"." + b64(json.dumps(claims).encode())
    )
    signature = hmac.new(pem, signing_input, hashlib.sha256).digest()
    return (signing_input + b"." + b64(signature)).decode()


@pytest.mark.django_db
def test_jwks__key_signed_by_an_unpublished_key_is_401(idp):
    stranger = SigningKey("RS256")
    problem(_get(stranger.sign()), 401, "invalid_token")
    # Same kid as a published key, another private key: the signature fails.
    problem(_get(stranger.sign(kid=idp.keys[0].kid)), 401, "invalid_token")


@pytest.mark.django_db
def test_jwks__rotation_is_picked_up_on_an_unknown_kid(idp):
    old = idp.keys[0]
    assert _get(old.sign()).status_code == 200
    new = SigningKey("RS256")
    idp.keys = [new]  # the IdP rotates: the old key is withdrawn
    time.sleep(MIN_REFRESH_S)
    assert _get(new.sign()).status_code == 200
    assert idp.requests == 2
    # The withdrawn key is gone from the cache after the refresh.
    problem(_get(old.sign()), 401, "invalid_token")


@pytest.mark.django_db
def test_jwks__unknown_kids_refresh_at_a_bounded_rate(idp):
    assert _get(idp.keys[0].sign()).status_code == 200
    stranger = SigningKey("ES256")
    started = time.monotonic()
    for _ in range(25):
        problem(_get(stranger.sign(kid=uuid.uuid4().hex)), 401, "invalid_token")
    elapsed = time.monotonic() - started
    # One refresh per MIN_REFRESH_S at most, however many made-up kids arrive.
    assert idp.requests <= 2 + elapsed / MIN_REFRESH_S, (idp.requests, elapsed)


@pytest.mark.django_db
def test_jwks__outage_with_keys_cached_keeps_working(idp):
    assert _get(idp.keys[0].sign()).status_code == 200
    idp.stop()
    time.sleep(MIN_REFRESH_S)
    # An unknown kid makes a refresh attempt that fails; the cached keys still verify.
    problem(_get(SigningKey("RS256").sign()), 401, "invalid_token")
    assert _get(idp.keys[0].sign()).status_code == 200


@pytest.mark.django_db
def test_jwks__outage_with_an_empty_cache_is_503_with_retry_after(idp):
    idp.stop()
    response = _get(idp.keys[0].sign())
    body = problem(response, 503, "identity_provider_unavailable")
    assert int(response["Retry-After"]) >= 1
    assert body["retry_after"] == int(response["Retry-After"])
    # Within the refresh interval no new fetch is tried: still 503, not 401.
    problem(_get(idp.keys[0].sign()), 503, "identity_provider_unavailable")


@pytest.mark.django_db
def test_jwks__recovers_after_the_outage(idp):
    idp.stop()
    problem(_get(idp.keys[0].sign()), 503, "identity_provider_unavailable")
    revived = JwksServer()
    revived.keys = idp.keys
    try:
        # Same configuration, new port: point the settings at the revived server.
        from django.conf import settings

        settings.QUIRE = {**settings.QUIRE, "JWT_JWKS_URL": revived.url}
        assert _get(idp.keys[0].sign()).status_code == 200
    finally:
        revived.stop()


@pytest.mark.django_db
def test_jwks__token_without_kid_or_with_hs_alg_is_401(idp):
    key = idp.keys[0]
    no_kid = jwt.encode(
        {
            "sub": "x",
            "tenant": "t",
            "scope": "",
            "iss": ISSUER,
            "aud": AUDIENCE,
            "exp": int(time.time()) + 60,
        },
        key.private,
        algorithm="RS256",
    )
    problem(_get(no_kid), 401, "invalid_token")
    assert idp.requests == 0


@pytest.mark.django_db
@pytest.mark.parametrize(
    "answer",
    [(500, b"oops"), (200, b"<html>not json</html>"), (200, b'{"keys": []}'), (200, b"[]")],
    ids=["http_500", "not_json", "no_keys", "not_an_object"],
)
def test_jwks__broken_identity_provider_with_an_empty_cache_is_503(idp, answer):
    idp.answer = answer
    problem(_get(idp.keys[0].sign()), 503, "identity_provider_unavailable")
    assert idp.requests == 1
