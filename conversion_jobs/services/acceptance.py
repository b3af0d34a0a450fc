"""Job acceptance (DESIGN.md §5): 202 only once the job is durably recoverable."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from conversion_jobs import converters, faults, passwords, storage
from conversion_jobs.db import violated_constraint
from conversion_jobs.exceptions import (
    IdempotencyKeyReused,
    InvalidRequest,
    StorageUnavailable,
    UnsupportedMediaType,
    UnsupportedOutput,
)
from conversion_jobs.models import ConversionJob, ConversionOutbox, IdempotencyRecord
from conversion_jobs.options import normalize_options, options_digest, request_fingerprint
from conversion_jobs.services.admission import admission_check
from conversion_jobs.services.artifacts import source_lock
from conversion_jobs.services.audit import audit_event_append
from conversion_jobs.services.dispatch import outbox_publish_after_commit
from conversion_jobs.states import LIVE_STATES, State


@dataclass(frozen=True)
class StagedUpload:
    """An upload already streamed to a local staged file and hashed."""

    path: Path
    sha256: str
    size: int


@dataclass(frozen=True)
class Acceptance:
    job: ConversionJob
    #: True: a new job was written (202). False: an existing job answers (200).
    created: bool
    #: True when the answer is an Idempotency-Key replay.
    replayed: bool


def _identity_match(*, tenant: str, sha256: str, output: str, digest: str) -> uuid.UUID | None:
    """The live or succeeded job with this content identity, if any (at most one: the partial
    unique constraint)."""
    return (
        ConversionJob.objects.filter(
            tenant=tenant,
            source_sha256=sha256,
            output=output,
            options_digest=digest,
            policy_version=settings.QUIRE["POLICY_VERSION"],
            state__in=[*LIVE_STATES, State.SUCCEEDED],
            expired_at__isnull=True,
        )
        .values_list("id", flat=True)
        .first()
    )


def _replay(*, tenant: str, key: str, fingerprint: str) -> Acceptance | None:
    """The answer for a key already bound: a replay of its job, or 422 for another payload."""
    record = (
        IdempotencyRecord.objects.filter(tenant=tenant, key=key)
        .values_list("fingerprint", "job_id")
        .first()
    )
    if record is None:
        return None
    if record[0] != fingerprint:
        raise IdempotencyKeyReused()
    return Acceptance(job=ConversionJob.objects.get(id=record[1]), created=False, replayed=True)


def _bind_key(*, tenant: str, key: str, fingerprint: str, job_id: uuid.UUID) -> Acceptance:
    """Bind a fresh key to an existing job (a content-identity duplicate). A concurrent binding
    of the same key that commits first wins and decides the answer."""
    try:
        with transaction.atomic():
            IdempotencyRecord.objects.create(
                tenant=tenant, key=key, fingerprint=fingerprint, job_id=job_id
            )
    except IntegrityError as exc:
        if violated_constraint(exc) != "idempotency_tenant_key":
            raise
        answer = _replay(tenant=tenant, key=key, fingerprint=fingerprint)
        if answer is None:  # pragma: no cover - the row that conflicted cannot vanish
            raise
        return answer
    return Acceptance(job=ConversionJob.objects.get(id=job_id), created=False, replayed=False)


def _existing_answer(
    *, tenant: str, key: str | None, fingerprint: str, job_id: uuid.UUID
) -> Acceptance:
    if key is None:
        return Acceptance(job=ConversionJob.objects.get(id=job_id), created=False, replayed=False)
    return _bind_key(tenant=tenant, key=key, fingerprint=fingerprint, job_id=job_id)


def conversion_job_accept(
    *,
    tenant: str,
    actor: str,
    upload: StagedUpload,
    output: str,
    raw_options: Any,
    idempotency_key: str | None,
    traceparent: str = "",
) -> Acceptance:
    """(none) -> QUEUED, generation 1, with its outbox row, idempotency record and audit event in
    one transaction. Returns the job and whether it is new; an existing job answers a replay or
    a content-identity duplicate. Raises a QuireError (nothing written) otherwise.

    Races are settled by the unique constraints, never by the look-ups before the insert: a
    submit that loses one rolls its whole transaction back and answers from the winner."""
    try:
        media_type = converters.sniff_media_type(upload.path)
        if media_type is None:
            raise UnsupportedMediaType()
        if output not in converters.capabilities().get(media_type, []):
            raise UnsupportedOutput(f"{media_type} cannot be converted to {output} here")
        options = normalize_options(raw_options, output=output)
        # The password leaves the options here: sealed for the worker, a keyed HMAC of it in
        # the options (and so in the content identity and the fingerprint).
        password = options.pop("password", None)
        sealed = None
        if password is not None:
            options[passwords.IDENTITY_KEY] = passwords.identity(password)
            sealed = passwords.seal(password)
            del password
        digest = options_digest(options)
        fingerprint = request_fingerprint(
            source_sha256=upload.sha256, output=output, options=options
        )
        if idempotency_key is not None:
            replay = _replay(tenant=tenant, key=idempotency_key, fingerprint=fingerprint)
            if replay is not None:
                return replay
        duplicate = _identity_match(
            tenant=tenant, sha256=upload.sha256, output=output, digest=digest
        )
        if duplicate is not None:
            return _existing_answer(
                tenant=tenant, key=idempotency_key, fingerprint=fingerprint, job_id=duplicate
            )
        admission_check(tenant=tenant)
        try:
            source_key, uploaded = storage.put_source(upload.path, upload.sha256)
        except storage.StorageError as exc:
            raise StorageUnavailable() from exc
    finally:
        upload.path.unlink(missing_ok=True)

    try:
        with transaction.atomic():
            # We reused an object a deleter (retention, the orphan sweep) may have judged unused
            # since: under the source's lock it is still there, or we stop. An object we just
            # uploaded needs no check: deleters leave objects younger than the grace alone.
            if not uploaded:
                source_lock(sha256=upload.sha256, exclusive=False)
                if not _source_present(source_key):
                    raise StorageUnavailable("the stored source vanished; retry")
            job = _insert_job(
                tenant=tenant,
                actor=actor,
                media_type=media_type,
                source_key=source_key,
                upload=upload,
                output=output,
                options=options,
                digest=digest,
                traceparent=traceparent,
                idempotency_key=idempotency_key,
                fingerprint=fingerprint,
                password_sealed=sealed,
            )
    except IntegrityError as exc:
        # Everything this submit wrote is rolled back; answer from whoever won.
        constraint = violated_constraint(exc)
        if constraint == "idempotency_tenant_key" and idempotency_key is not None:
            replay = _replay(tenant=tenant, key=idempotency_key, fingerprint=fingerprint)
            if replay is None:  # pragma: no cover - the row that conflicted cannot vanish
                raise
            return replay
        if constraint != "job_content_identity_live_or_succeeded":
            raise
        winner = _identity_match(tenant=tenant, sha256=upload.sha256, output=output, digest=digest)
        if winner is None:  # it left the live/succeeded set meanwhile; the client retries
            raise InvalidRequest("a concurrent identical job changed state; retry") from exc
        return _existing_answer(
            tenant=tenant, key=idempotency_key, fingerprint=fingerprint, job_id=winner
        )
    return Acceptance(job=job, created=True, replayed=False)


def _source_present(key: str) -> bool:
    try:
        return storage.exists(key)
    except storage.StorageError as exc:
        raise StorageUnavailable() from exc


def _insert_job(
    *,
    tenant: str,
    actor: str,
    media_type: str,
    source_key: str,
    upload: StagedUpload,
    output: str,
    options: dict[str, Any],
    digest: str,
    traceparent: str,
    idempotency_key: str | None,
    fingerprint: str,
    password_sealed: str | None = None,
) -> ConversionJob:
    """The acceptance transaction's writes. A unique violation propagates: the caller's
    transaction rolls back whole and the caller answers from the winner."""
    job = ConversionJob.objects.create(
        id=uuid.uuid4(),
        tenant=tenant,
        state=State.QUEUED,
        source_key=source_key,
        source_sha256=upload.sha256,
        source_size=upload.size,
        source_media_type=media_type,
        output=output,
        options=options,
        options_digest=digest,
        password_sealed=password_sealed,
        policy_version=settings.QUIRE["POLICY_VERSION"],
        max_attempts=settings.QUIRE["MAX_ATTEMPTS"],
        queued_at=timezone.now(),
        traceparent=traceparent,
    )
    faults.hit("accept.after_job_insert")
    outbox = ConversionOutbox.objects.create(job=job, generation=1, traceparent=traceparent)
    if idempotency_key is not None:
        IdempotencyRecord.objects.create(
            tenant=tenant, key=idempotency_key, fingerprint=fingerprint, job=job
        )
    audit_event_append(
        job_id=job.id,
        event_type="accepted",
        generation=1,
        actor=actor,
        details={"media_type": media_type, "size": upload.size, "output": output},
        lock_job=False,
        first=True,
    )
    outbox_publish_after_commit(
        outbox_id=outbox.id, job_id=job.id, generation=1, traceparent=traceparent
    )
    return job
