"""The S3-compatible backend, through django-storages' ``S3Storage`` (boto3).

django-storages owns the configuration (bucket, endpoint, region, addressing style, key prefix,
credentials from the environment's ``AWS_*`` variables or the instance role), the connection
and the presigned URLs; the store adds what Quire needs on top: uploads from a local file
(multipart, read from disk part by part, never the whole file in memory), puts that finish on
background threads (page artifacts), streaming reads and downloads into a work directory.

An S3 PUT is atomic and durable when it returns: a reader sees the whole object or none, so
"complete before a row names it" is "the put returned before the row committed". Objects are
private: no ACL is ever sent, so the bucket's own (private) policy applies.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO

from boto3.exceptions import Boto3Error
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError
from django.core.files import File
from storages.backends.s3 import S3Storage

from .base import CHUNK, ArtifactStore, Put, StorageError, StoredObject, check_key
from .filesystem import DIR_MODE, FILE_MODE, remove_older
from .s3put import HTTPStatusError, SignedPut

PART = 8 * 1024 * 1024
STAGING_SWEEP_EVERY_S = 600.0
STAGING_MAX_AGE_S = 3600.0


@contextlib.contextmanager
def _errors(*, missing_is_not_found: bool = False) -> Iterator[None]:
    """botocore / boto3 failures as StorageError (an OSError); a missing object as
    FileNotFoundError where the caller asked for it."""
    try:
        yield
    except ClientError as exc:
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        code = exc.response.get("Error", {}).get("Code")
        if missing_is_not_found and (status == 404 or code in ("NoSuchKey", "404")):
            raise FileNotFoundError("no such object") from exc
        raise StorageError(f"object store: {code or status}") from exc
    except (BotoCoreError, Boto3Error) as exc:
        raise StorageError(f"object store: {type(exc).__name__}") from exc


def _status(exc: StorageError) -> int | None:
    """The HTTP status of ``exc`` (the signed PUT's) or of the botocore error behind it."""
    if isinstance(exc, HTTPStatusError):
        return exc.status
    response = getattr(exc.__cause__, "response", None) or {}
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return int(status) if status is not None else None


class S3Store(ArtifactStore):
    kind = "s3"

    def __init__(
        self,
        *,
        bucket: str,
        endpoint_url: str,
        region: str,
        addressing_style: str,
        prefix: str,
        presign_ttl_s: float,
        staging_dir: Path,
    ) -> None:
        if not bucket:
            raise StorageError("QUIRE_S3_BUCKET is required with QUIRE_STORAGE=s3")
        self.presign_ttl_s = presign_ttl_s
        self.staging_dir = Path(staging_dir)
        self._staging_swept = 0.0
        # Peak memory of one transfer is about concurrency x part size (32 MiB): a 100 MiB
        # upload never sits in memory.
        self.transfer = TransferConfig(
            multipart_threshold=PART,
            multipart_chunksize=PART,
            max_concurrency=4,
            max_io_queue=4,
        )
        self.backend = S3Storage(
            bucket_name=bucket,
            endpoint_url=endpoint_url or None,
            region_name=region or None,
            location=prefix.strip("/"),
            default_acl=None,
            file_overwrite=True,
            querystring_auth=True,
            querystring_expire=max(1, int(presign_ttl_s)),
            transfer_config=self.transfer,
            client_config=Config(
                s3={
                    "addressing_style": addressing_style or "auto",
                    "payload_signing_enabled": False,
                },
                signature_version="s3v4",
                retries={"max_attempts": 3, "mode": "standard"},
                connect_timeout=5,
                read_timeout=60,
                max_pool_connections=16,
                # Integrity without hashing every body twice: a single PUT carries the SHA-256
                # the caller already computed for its row (``x-amz-checksum-sha256``, verified
                # by the server: a mismatch is refused), the payload itself is not hashed again
                # for the signature (``payload_signing_enabled`` False, also over http), and no
                # checksum is computed that the caller did not ask for; multipart uploads ask
                # for CRC32 per part (``_upload``). Measured on a 540 KB page PUT: client CPU
                # 1.9 ms instead of 2.5-3.1 ms, the server's 6.3 instead of 6.5-7.6 ms.
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
            ),
        )
        self._pool: ThreadPoolExecutor | None = None
        # One client for every thread (boto3 clients are thread-safe; django-storages' resources
        # are per thread and cost a session each: measured, that was most of a web thread's S3
        # cost). Everything below goes through it.
        self._client = self.backend.connection.meta.client
        self._bucket = bucket
        self._conditional: bool | None = None  # conditional writes honoured (probed once)
        self._signed: SignedPut | None = None  # the source PUT without boto3 (``s3put``)

    # --- names ------------------------------------------------------------------------------

    def _name(self, key: str) -> str:
        return str(self.backend._normalize_name(check_key(key)))

    def _key(self, name: str) -> str:
        location = self.backend.location
        return name[len(location) + 1 :] if location else name

    # --- writes -----------------------------------------------------------------------------

    def stage(self) -> tuple[BinaryIO, Path]:
        # The web's own work directory: nothing but this request ever reads it.
        self.staging_dir.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)
        self._sweep_staging()
        fd, name = tempfile.mkstemp(dir=self.staging_dir, prefix="up-")
        return os.fdopen(fd, "wb"), Path(name)

    def _sweep_staging(self) -> None:
        """Staged uploads a crashed web process left behind (the sweeper cannot see this
        host's disk): removed here, at most every ten minutes."""
        now = time.time()
        if now - self._staging_swept < STAGING_SWEEP_EVERY_S:
            return
        self._staging_swept = now
        self.remove_stale_staging(older_than=now - STAGING_MAX_AGE_S)

    def remove_stale_staging(self, *, older_than: float) -> int:
        return remove_older(self.staging_dir, older_than)

    def _upload(self, key: str, path: Path, sha256: str | None = None) -> None:
        """One PUT for a small file (with its SHA-256 when known, which the server verifies);
        a multipart upload read from disk part by part above ``PART``, each part with its
        CRC32 (the transfer manager's threads cost more than they save on small objects)."""
        name = self._name(key)
        params = self.backend._get_write_parameters(name)
        with _errors():
            if os.stat(path).st_size < PART:
                if sha256 is not None:
                    params["ChecksumSHA256"] = base64.b64encode(bytes.fromhex(sha256)).decode()
                with open(path, "rb") as body:
                    self._client.put_object(Bucket=self._bucket, Key=name, Body=body, **params)
            else:
                self._client.upload_file(
                    str(path),
                    self._bucket,
                    name,
                    ExtraArgs={**params, "ChecksumAlgorithm": "CRC32"},
                    Config=self.transfer,
                )

    def put_file(
        self, key: str, path: Path, *, wait: bool = True, sha256: str | None = None
    ) -> Put:
        if wait:
            self._upload(key, path, sha256)
            return Put(key=key, local=Path(path))
        pending = self._uploads().submit(self._upload, key, path, sha256)
        return Put(key=key, local=Path(path), pending=pending)

    def put_file_if_absent(self, key: str, path: Path, *, sha256: str) -> bool:
        """A small file: one conditional PUT (``If-None-Match: *``) that the server refuses
        with 412 when the key exists, so no HEAD goes first; the reuse path (the source's lock
        and a presence check, ``acceptance``) then runs as after a HEAD that found it. Only on
        a server that honours the condition (probed once per process: a server that ignored it
        would overwrite an object a deleter is about to remove, outside the lock). A large
        file, or a server without conditional writes: HEAD, then the upload."""
        if os.stat(path).st_size >= PART or not self._conditional_writes():
            return super().put_file_if_absent(key, path, sha256=sha256)
        try:
            self._put_if_none_match(self._name(key), path, sha256)
        except StorageError as exc:
            if _status(exc) == 412:
                return False
            raise
        return True

    def _put_if_none_match(self, name: str, path: Path, sha256: str) -> None:
        """The hot source PUT: signed here (``s3put``), or through boto3 when django-storages
        adds object parameters ``s3put`` does not send."""
        params = self.backend._get_write_parameters(name)
        if SignedPut.supports(params):
            self._signed_put().put_if_none_match(name, path, sha256=sha256, params=params)
            return
        params["ChecksumSHA256"] = base64.b64encode(bytes.fromhex(sha256)).decode()
        with _errors(), open(path, "rb") as body:
            self._client.put_object(
                Bucket=self._bucket, Key=name, Body=body, IfNoneMatch="*", **params
            )

    def _signed_put(self) -> SignedPut:
        if self._signed is None:
            config = self._client.meta.config
            with _errors():
                self._signed = SignedPut(
                    self._client,
                    bucket=self._bucket,
                    connect_timeout=config.connect_timeout,
                    read_timeout=config.read_timeout,
                )
        return self._signed

    def _conditional_writes(self) -> bool:
        """Whether the server refuses ``If-None-Match: *`` on an existing key (AWS S3, MinIO
        and SeaweedFS do; some S3-compatible servers ignore it). Probed once, with a probe
        object written twice and removed."""
        if self._conditional is None:
            name = self._name(f"_probe/{uuid.uuid4().hex}")
            self.staging_dir.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)
            data = b"quire conditional-write probe"
            sha256 = hashlib.sha256(data).hexdigest()
            with tempfile.NamedTemporaryFile(dir=self.staging_dir) as probe:
                probe.write(data)
                probe.flush()
                try:
                    self._put_if_none_match(name, Path(probe.name), sha256)
                    try:
                        self._put_if_none_match(name, Path(probe.name), sha256)
                        self._conditional = False
                    except StorageError as exc:
                        if _status(exc) != 412:
                            raise
                        self._conditional = True
                finally:
                    with _errors():
                        self._client.delete_object(Bucket=self._bucket, Key=name)
        return self._conditional

    def put(self, key: str, stream: BinaryIO) -> None:
        with _errors():
            self.backend.save(check_key(key), File(stream, name=key))

    def settle(self, puts: list[Put]) -> None:
        for put in puts:
            if put.pending is not None:
                put.pending.result()
                put.pending = None

    def _uploads(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="s3-put")
        return self._pool

    # --- reads and deletes ------------------------------------------------------------------

    def open(self, key: str) -> BinaryIO:
        with _errors(missing_is_not_found=True):
            body = self._client.get_object(Bucket=self._bucket, Key=self._name(key))
        return body["Body"]  # type: ignore[no-any-return]

    def read_errors(self) -> contextlib.AbstractContextManager[None]:
        return _errors()

    def download(self, key: str, dest: Path) -> None:
        """One streaming GET into ``dest`` (created 0600): the signed GET of ``s3put`` (the
        worker's per-job source read, session 10), or boto3's when object parameters ask for
        what ``s3put`` does not send (customer-provided encryption keys)."""
        if not any(k.startswith("SSECustomer") for k in self.backend.object_parameters):
            self._signed_put().get_into(self._name(key), dest, mode=FILE_MODE)
            return
        body = self.open(key)
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
        with _errors(), body, os.fdopen(fd, "wb") as out:
            shutil.copyfileobj(body, out, CHUNK)

    def exists(self, key: str) -> bool:
        return self.stat(key) is not None

    def stat(self, key: str) -> StoredObject | None:
        try:
            with _errors(missing_is_not_found=True):
                head = self._client.head_object(Bucket=self._bucket, Key=self._name(key))
        except FileNotFoundError:
            return None
        return StoredObject(
            key=key, modified=head["LastModified"].timestamp(), size=int(head["ContentLength"])
        )

    def delete(self, key: str) -> None:
        with _errors():
            self._client.delete_object(Bucket=self._bucket, Key=self._name(key))

    def delete_prefix(self, prefix: str) -> int:
        names = [self._name(o.key) for o in self.list(prefix)]
        with _errors():
            for start in range(0, len(names), 1000):
                self._client.delete_objects(
                    Bucket=self._bucket,
                    Delete={
                        "Objects": [{"Key": n} for n in names[start : start + 1000]],
                        "Quiet": True,
                    },
                )
        return len(names)

    def list(self, prefix: str) -> Iterator[StoredObject]:
        paginator = self._client.get_paginator("list_objects_v2")
        with _errors():
            for page in paginator.paginate(Bucket=self._bucket, Prefix=self._name(prefix) + "/"):
                for item in page.get("Contents", []):
                    yield StoredObject(
                        key=self._key(item["Key"]),
                        modified=item["LastModified"].timestamp(),
                        size=int(item["Size"]),
                    )

    def presigned_url(self, key: str, *, filename: str, media_type: str) -> str | None:
        if self.presign_ttl_s <= 0:
            return None
        with _errors():
            return str(
                self._client.generate_presigned_url(
                    "get_object",
                    Params={
                        "Bucket": self._bucket,
                        "Key": self._name(key),
                        "ResponseContentDisposition": f'attachment; filename="{filename}"',
                        "ResponseContentType": media_type,
                    },
                    ExpiresIn=max(1, int(self.presign_ttl_s)),
                )
            )
