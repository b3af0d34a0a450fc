"""The acceptance's source PUT and the worker's source GET without the boto3 client machinery
(ADR 0018, sessions 5, 6 and 10).

``put_object`` through botocore costs about 1.8 ms of web CPU per 10 KB source: the event
hooks, parameter validation, the request serializer, the endpoint ruleset and the retry handler
run on every call. The source PUT is the one S3 call on the acceptance's hot path, so it is made
here, signed with AWS Signature Version 4 (``_SigV4``: botocore's ``S3SigV4Auth`` algorithm,
which a unit test holds it to, with the derived signing key cached per day instead of four
HMACs per request) and sent on a kept-alive ``http.client`` connection; django-storages / boto3
keep everything else (configuration, multipart uploads, reads, deletes, listings, presigned
URLs). The worker's whole-object GET of a stored source (``download``) is the other per-job
call (session 10): the same signer and connections, the body streamed to the attempt's file.

The connections are this module's own (ADR 0018, session 6): at most ``KEEP`` idle ones, reused
last-in first-out, each used by one thread at a time. A body up to ``INLINE_BODY`` bytes is read
once and sent in the same write as the request head (one ``send`` instead of two); a larger
one is streamed from its file in ``BLOCK``-sized reads, never held whole. Measured per 10 KB
PUT: urllib3's pool cost ≈ 0.2 ms more of web CPU (its URL parsing, retry and response
machinery), botocore's signer ≈ 0.13 ms more than ``_SigV4``.

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
import datetime
import hashlib
import hmac
import http.client
import os
import shutil
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

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

#: Idle connections kept per process (boto3's pool for the other calls is as large).
KEEP = 16
#: A body up to this size is read into memory and written with the request head.
INLINE_BODY = 64 * 1024
#: Read size when a larger body is streamed from its file.
BLOCK = 64 * 1024
#: Retries after a connection error or a 5xx answer; the first at once (a kept-alive
#: connection the server had closed), the next after ``RETRY_PAUSE_S``.
RETRIES = 2
RETRY_PAUSE_S = 0.1
RETRY_STATUSES = frozenset({500, 502, 503, 504})
#: The SHA-256 of an empty payload, signed for a GET.
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


class HTTPStatusError(StorageError):
    """The server answered with an error status (``status``)."""

    def __init__(self, status: int) -> None:
        super().__init__(f"object store: {status}")
        self.status = status


class _SigV4:
    """AWS Signature Version 4 of one S3 request whose payload's SHA-256 the caller already has
    (signed as ``x-amz-content-sha256``; the body is not hashed again): botocore's
    ``S3SigV4Auth`` (no path normalisation, every header signed, ``host`` added), with the
    signing key (``AWS4<secret>`` -> date -> region -> ``s3`` -> ``aws4_request``) derived once
    per secret and day rather than on every request."""

    def __init__(self, region: str) -> None:
        self._region = region
        self._key: tuple[str, str, bytes] = ("", "", b"")  # (secret, day, signing key)

    def _signing_key(self, secret: str, day: str) -> bytes:
        cached = self._key  # one tuple read: another thread may replace it meanwhile
        if cached[0] == secret and cached[1] == day:
            return cached[2]
        key = ("AWS4" + secret).encode()
        for part in (day, self._region, "s3", "aws4_request"):
            key = hmac.new(key, part.encode(), hashlib.sha256).digest()
        self._key = (secret, day, key)
        return key

    def sign(
        self,
        *,
        method: str,
        host: str,
        path: str,
        headers: dict[str, str],
        payload_sha256: str,
        credentials: Any,
        now: datetime.datetime,
    ) -> dict[str, str]:
        """``headers`` plus ``X-Amz-Date``, ``X-Amz-Content-SHA256``, the session token if
        any, and ``Authorization``. ``path`` is sent as it is (already quoted); ``host`` is the
        ``Host`` header the request carries."""
        stamp = now.strftime("%Y%m%dT%H%M%SZ")
        day = stamp[:8]
        out = {**headers, "X-Amz-Date": stamp, "X-Amz-Content-SHA256": payload_sha256}
        if credentials.token:
            out["X-Amz-Security-Token"] = credentials.token
        canonical = {name.lower(): " ".join(value.split()) for name, value in out.items()}
        canonical["host"] = host
        names = sorted(canonical)
        signed_headers = ";".join(names)
        request = "\n".join(
            [
                method,
                path,
                "",  # no query string
                *(f"{name}:{canonical[name]}" for name in names),
                "",
                signed_headers,
                payload_sha256,
            ]
        )
        scope = f"{day}/{self._region}/s3/aws4_request"
        string_to_sign = "\n".join(
            ["AWS4-HMAC-SHA256", stamp, scope, hashlib.sha256(request.encode()).hexdigest()]
        )
        signature = hmac.new(
            self._signing_key(credentials.secret_key, day),
            string_to_sign.encode(),
            hashlib.sha256,
        ).hexdigest()
        out["Authorization"] = (
            f"AWS4-HMAC-SHA256 Credential={credentials.access_key}/{scope}, "
            f"SignedHeaders={signed_headers}, Signature={signature}"
        )
        return out


class SignedPut:
    """Conditional single PUTs of small files and whole-object GETs, signed like the client
    signs them."""

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
        parts = urllib.parse.urlsplit(self._base)
        self._path = parts.path  # "/bucket/" or "/" (virtual host)
        default_port = 443 if parts.scheme == "https" else 80
        self._host = parts.hostname if parts.port in (None, default_port) else parts.netloc
        if parts.hostname and ":" in parts.hostname and self._host == parts.hostname:
            self._host = f"[{parts.hostname}]"  # an IPv6 literal, as a Host header writes it
        self._signer = _SigV4(self._region)
        self._connections = _Connections(
            self._base, connect_timeout=connect_timeout, read_timeout=read_timeout
        )

    def _sign(
        self, method: str, target: str, headers: dict[str, str], *, payload_sha256: str
    ) -> dict[str, str]:
        """``headers`` signed with the client's current (frozen) credentials."""
        credentials = self._client._request_signer._credentials
        if credentials is None:
            raise StorageError("object store: no credentials")
        return self._signer.sign(
            method=method,
            host=str(self._host),
            path=target,
            headers=headers,
            payload_sha256=payload_sha256,
            credentials=credentials.get_frozen_credentials(),
            now=datetime.datetime.now(datetime.UTC),
        )

    @staticmethod
    def supports(params: dict[str, Any]) -> bool:
        return all(name in _HEADERS for name in params)

    def put_if_none_match(
        self, name: str, path: Path, *, sha256: str, params: dict[str, Any]
    ) -> None:
        """PUT ``path`` as ``name`` unless the key exists. Raises HTTPStatusError (412: the
        key exists) or StorageError."""
        target = self._path + urllib.parse.quote(name, safe="/~")
        size = path.stat().st_size
        headers = {_HEADERS[k]: str(v) for k, v in params.items()}
        headers.update(
            {
                "Host": str(self._host),
                "Content-Length": str(size),
                "If-None-Match": "*",
                "x-amz-checksum-sha256": base64.b64encode(bytes.fromhex(sha256)).decode(),
            }
        )
        signed = self._sign("PUT", target, headers, payload_sha256=sha256)
        status = self._connections.put(target, signed, path, size)
        if status >= 300:
            raise HTTPStatusError(status)

    def get_into(self, name: str, dest: Path, *, mode: int) -> None:
        """GET ``name`` whole into ``dest`` (created with ``mode``, truncated first). Raises
        FileNotFoundError (404: no such object), HTTPStatusError or StorageError."""
        target = self._path + urllib.parse.quote(name, safe="/~")
        signed = self._sign("GET", target, {"Host": str(self._host)}, payload_sha256=EMPTY_SHA256)
        status = self._connections.get(target, signed, dest, mode)
        if status == 404:
            raise FileNotFoundError("no such object")
        if status >= 300:
            raise HTTPStatusError(status)


class _Connections:
    """Kept-alive connections to the store's endpoint: at most ``KEEP`` idle, last in first
    out; a connection is used by one thread at a time."""

    def __init__(self, base: str, *, connect_timeout: float, read_timeout: float) -> None:
        parts = urllib.parse.urlsplit(base)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise StorageError("object store: cannot derive the object URL")
        self._https = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port
        self._connect_timeout = connect_timeout
        self._read_timeout = read_timeout
        self._ssl = ssl.create_default_context() if self._https else None
        self._idle: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()

    def _take(self) -> http.client.HTTPConnection:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        if self._https:
            return http.client.HTTPSConnection(
                self._host,
                self._port,
                timeout=self._connect_timeout,
                context=self._ssl,
                blocksize=BLOCK,
            )
        return http.client.HTTPConnection(
            self._host, self._port, timeout=self._connect_timeout, blocksize=BLOCK
        )

    def _give_back(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            if len(self._idle) < KEEP:
                self._idle.append(conn)
                return
        conn.close()

    def put(self, target: str, headers: dict[str, str], path: Path, size: int) -> int:
        """PUT ``path``'s ``size`` bytes to ``target``; the answer's status. A retried PUT
        that had landed answers 412, which the caller takes as "the object exists" (the reuse
        path, under the source's lock)."""
        inline = path.read_bytes() if size <= INLINE_BODY else None

        def send(conn: http.client.HTTPConnection) -> http.client.HTTPResponse:
            if inline is not None:
                conn.request("PUT", target, body=inline, headers=headers)
            else:
                with open(path, "rb") as body:
                    conn.request("PUT", target, body=body, headers=headers)
            response = conn.getresponse()
            response.read()
            return response

        return self._exchange(send)

    def get(self, target: str, headers: dict[str, str], dest: Path, mode: int) -> int:
        """GET ``target``; a 200's body is streamed into ``dest`` (created with ``mode``,
        truncated on every try, so a retried GET never leaves a first try's bytes; a body cut
        short raises ``IncompleteRead`` and is retried). The answer's status."""

        def send(conn: http.client.HTTPConnection) -> http.client.HTTPResponse:
            conn.request("GET", target, headers=headers)
            response = conn.getresponse()
            if response.status != 200:
                response.read()
                return response
            fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
            with os.fdopen(fd, "wb") as out:
                shutil.copyfileobj(response, out, BLOCK)
            return response

        return self._exchange(send)

    def _exchange(
        self, send: Callable[[http.client.HTTPConnection], http.client.HTTPResponse]
    ) -> int:
        """One request (``send``: writes it and reads its answer whole) on a kept-alive
        connection; the answer's status. Connection errors and 5xx answers are retried
        (``RETRIES``), each try on a connection of its own."""
        for attempt in range(RETRIES + 1):
            if attempt:
                time.sleep(0 if attempt == 1 else RETRY_PAUSE_S)
            conn = self._take()
            try:
                if conn.sock is None:
                    conn.connect()  # under the connect timeout; then reads under the read one
                    conn.sock.settimeout(self._read_timeout)  # type: ignore[attr-defined]
                response = send(conn)
            except (OSError, http.client.HTTPException) as exc:
                conn.close()
                if attempt == RETRIES:
                    raise StorageError(f"object store: {type(exc).__name__}") from exc
                continue
            if response.will_close:
                conn.close()
            else:
                self._give_back(conn)
            if response.status not in RETRY_STATUSES or attempt == RETRIES:
                return response.status
        raise AssertionError("unreachable")
