"""The acceptance's source PUT without the boto3 client machinery (ADR 0018, session 5).

``put_object`` through botocore costs about 1.8 ms of web CPU per 10 KB source: the event
hooks, parameter validation, the request serializer, the endpoint ruleset and the retry handler
run on every call. The source PUT is the one S3 call on the acceptance's hot path, so it is made
here with botocore's own SigV4 signer (``botocore.auth.S3SigV4Auth``, the same signature the
client computes) on a pooled urllib3 connection; django-storages / boto3 keep everything else
(configuration, multipart uploads, reads, deletes, listings, presigned URLs).

What the request carries is what the client sent: the object parameters django-storages adds
(content type; anything this module does not know sends the call back to boto3), the SHA-256
the caller already computed as ``x-amz-checksum-sha256`` (the server refuses a body that does
not match it) and, signed, as ``x-amz-content-sha256`` (so the payload is not hashed a second
time for the signature, also over http), and ``If-None-Match: *`` (the server answers 412 when
the key exists). The endpoint and addressing (path or virtual host) come from the client once,
through a presigned URL it builds; credentials are read from the client's signer on every call
(frozen, so refreshing credentials such as an instance role's keep working).
"""

from __future__ import annotations

import base64
import urllib.parse
from pathlib import Path
from typing import Any

import urllib3
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest

from .base import StorageError

#: django-storages' write parameters this module sends as headers; any other makes the store
#: use boto3 for the call.
_HEADERS = {
    "ContentType": "Content-Type",
    "ContentEncoding": "Content-Encoding",
    "ContentDisposition": "Content-Disposition",
    "CacheControl": "Cache-Control",
    "ServerSideEncryption": "x-amz-server-side-encryption",
    "StorageClass": "x-amz-storage-class",
    "ACL": "x-amz-acl",
}


class HTTPStatusError(StorageError):
    """The server answered with an error status (``status``)."""

    def __init__(self, status: int) -> None:
        super().__init__(f"object store: {status}")
        self.status = status


class _KnownPayloadAuth(S3SigV4Auth):
    """SigV4 for S3 with the payload's SHA-256 the caller already has (no second hash)."""

    def payload(self, request: Any) -> str:
        return str(request.context["payload_sha256"])


class SignedPut:
    """Conditional single PUTs of small files, signed like the client signs them."""

    def __init__(self, client: Any, *, bucket: str, connect_timeout: float, read_timeout: float):
        self._client = client
        self._region = client.meta.region_name or "us-east-1"
        probe = "quire-endpoint-probe"
        url = client.generate_presigned_url(
            "put_object", Params={"Bucket": bucket, "Key": probe}, ExpiresIn=60
        )
        base = url.split("?", 1)[0]
        if not base.endswith("/" + probe):
            raise StorageError("object store: cannot derive the object URL")
        self._base = base[: -len(probe)]
        self._pool = urllib3.PoolManager(
            maxsize=16,
            block=False,
            retries=urllib3.Retry(
                total=2,
                connect=2,
                # Retrying is safe: a PUT that had landed answers the retry with 412, which the
                # caller takes as "the object exists" (the reuse path, under the source's lock).
                read=2,
                status=2,
                status_forcelist=(500, 502, 503, 504),
                allowed_methods={"PUT"},
                backoff_factor=0.05,
                raise_on_status=False,
            ),
            timeout=urllib3.Timeout(connect=connect_timeout, read=read_timeout),
        )

    @staticmethod
    def supports(params: dict[str, Any]) -> bool:
        return all(name in _HEADERS for name in params)

    def put_if_none_match(
        self, name: str, path: Path, *, sha256: str, params: dict[str, Any]
    ) -> None:
        """PUT ``path`` as ``name`` unless the key exists. Raises HTTPStatusError (412: the
        key exists) or StorageError."""
        url = self._base + urllib.parse.quote(name, safe="/~")
        size = path.stat().st_size
        headers = {_HEADERS[k]: str(v) for k, v in params.items()}
        headers.update(
            {
                "Content-Length": str(size),
                "If-None-Match": "*",
                "x-amz-checksum-sha256": base64.b64encode(bytes.fromhex(sha256)).decode(),
            }
        )
        request = AWSRequest(method="PUT", url=url, headers=headers)
        request.context["payload_sha256"] = sha256
        credentials = self._client._request_signer._credentials
        if credentials is None:
            raise StorageError("object store: no credentials")
        _KnownPayloadAuth(credentials.get_frozen_credentials(), "s3", self._region).add_auth(
            request
        )
        try:
            with open(path, "rb") as body:
                response = self._pool.request(
                    "PUT", url, body=body, headers=dict(request.headers.items())
                )
        except urllib3.exceptions.HTTPError as exc:
            raise StorageError(f"object store: {type(exc).__name__}") from exc
        if response.status >= 300:
            raise HTTPStatusError(response.status)
