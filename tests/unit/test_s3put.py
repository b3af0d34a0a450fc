"""``storage/s3put._SigV4`` signs exactly as botocore's ``S3SigV4Auth`` does (the signature
the boto3 client computes and S3 servers verify), whatever its signing-key cache holds."""

from __future__ import annotations

import datetime

import botocore.auth
import pytest
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

from conversion_jobs.storage.s3put import _SigV4

SHA = "5f70bf18a086007016e948b04aed3b82103a36bea41755b6cddfaf10ace3c6ef"


class _KnownPayload(botocore.auth.S3SigV4Auth):
    def payload(self, request: AWSRequest) -> str:
        return SHA


def _botocore(
    *,
    url: str,
    headers: dict[str, str],
    credentials: Credentials,
    region: str,
    now: datetime.datetime,
    monkeypatch: pytest.MonkeyPatch,
) -> dict[str, str]:
    monkeypatch.setattr(botocore.auth, "get_current_datetime", lambda: now)
    request = AWSRequest(method="PUT", url=url, headers=dict(headers))
    _KnownPayload(credentials, "s3", region).add_auth(request)
    return {k.lower(): v for k, v in request.headers.items()}


def _ours(
    signer: _SigV4,
    *,
    host: str,
    path: str,
    headers: dict[str, str],
    credentials: Credentials,
    now: datetime.datetime,
) -> dict[str, str]:
    signed = signer.sign(
        method="PUT",
        host=host,
        path=path,
        headers={**headers, "Host": host},
        payload_sha256=SHA,
        credentials=credentials,
        now=now,
    )
    return {k.lower(): v for k, v in signed.items() if k.lower() != "host"}


HEADERS = {
    "Content-Type": "application/pdf",
    "Content-Length": "10240",
    "If-None-Match": "*",
    "x-amz-checksum-sha256": "X3C/GKCGAHAW6UiwSu07ghA6Nr6kF1W2zd+vEKzjxu8=",
}


@pytest.mark.parametrize(
    ("scheme_host", "path", "region", "token", "extra"),
    [
        ("http://127.0.0.1:8333", "/quire/bench-1/sources/ab/cd/" + SHA, "us-east-1", None, {}),
        (
            "https://quire.s3.eu-west-1.amazonaws.com",
            "/p/sources/" + SHA,
            "eu-west-1",
            "tok/en+=",
            {},
        ),
        (
            "http://s3.local",
            "/bkt/a%20b/~x",
            "us-east-1",
            None,
            {"Cache-Control": "  no-store,   private "},
        ),
    ],
)
def test_sigv4__signs_as_botocore(monkeypatch, scheme_host, path, region, token, extra):
    credentials = Credentials("AKIDQUIRE", "secret/key+1", token).get_frozen_credentials()
    now = datetime.datetime(2026, 12, 1, 2, 50, 7, tzinfo=datetime.UTC)
    headers = {**HEADERS, **extra}
    host = scheme_host.split("//", 1)[1]
    expected = _botocore(
        url=scheme_host + path,
        headers=headers,
        credentials=credentials,
        region=region,
        now=now,
        monkeypatch=monkeypatch,
    )
    assert (
        _ours(
            _SigV4(region), host=host, path=path, headers=headers, credentials=credentials, now=now
        )
        == expected
    )


def test_sigv4__the_cached_signing_key_follows_the_day_and_the_secret(monkeypatch):
    """One signer across midnight and a credential rotation: every signature still equals
    botocore's (the key cached for one day and secret is never used for another)."""
    signer = _SigV4("us-east-1")
    path = "/quire/sources/" + SHA
    day1 = datetime.datetime(2026, 12, 1, 23, 59, 59, tzinfo=datetime.UTC)
    day2 = day1 + datetime.timedelta(seconds=2)
    for secret, now in [("s1", day1), ("s1", day1), ("s1", day2), ("s2", day2), ("s1", day2)]:
        credentials = Credentials("AKID", secret).get_frozen_credentials()
        expected = _botocore(
            url="http://127.0.0.1:8333" + path,
            headers=HEADERS,
            credentials=credentials,
            region="us-east-1",
            now=now,
            monkeypatch=monkeypatch,
        )
        assert (
            _ours(
                signer,
                host="127.0.0.1:8333",
                path=path,
                headers=HEADERS,
                credentials=credentials,
                now=now,
            )
            == expected
        )
