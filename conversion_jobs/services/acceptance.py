"""Job acceptance (DESIGN.md §5): 202 only once the job is durably recoverable."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from conversion_jobs import converters, faults, storage
from conversion_jobs.db import violated_constraint
from conversion_jobs.exceptions import (
    IdempotencyKeyReused,
    InvalidRequest,
    UnsupportedMediaType,
    UnsupportedOutput,
)
from conversion_jobs.models import ConversionJob, ConversionOutbox, IdempotencyRecord
from conversion_jobs.options import normalize_options, options_digest, request_fingerprint
from conversion_jobs.services.admission import admission_check
from conversion_jobs.services.audit import audit_event_append
from conversion_jobs.services.dispatch import outbox_publish_after_commit
from conversion_jobs.states import LIVE_STATES, State


@dataclass(frozen=True)
class StagedUpload:
    """An upload already streamed to the storage filesystem and hashed."""

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


def _existing_by_identity(
    *, tenant: str, sha256: str, output: str, digest: str
) -> ConversionJob | None:
    return (
        ConversionJob.objects.filter(
            tenant=tenant,
            source_sha256=sha256,
            output=output,
            options_digest=digest,
            policy_version=settings.QUIRE["POLICY_VERSION"],
            state__in=[*LIVE_STATES, State.SUCCEEDED],
        )
        .order_by("-created_at")
        .first()
    )


def _replay(*, tenant: str, key: str, fingerprint: str) -> ConversionJob | None:
    record = IdempotencyRecord.objects.select_related("job").filter(tenant=tenant, key=key).first()
    if record is None:
        return None
    if record.fingerprint != fingerprint:
        raise IdempotencyKeyReused()
    return record.job


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
    a content-identity duplicate. Raises a QuireError (nothing written) otherwise."""
    try:
        media_type = converters.sniff_media_type(upload.path)
        if media_type is None:
            raise UnsupportedMediaType()
        if output not in converters.capabilities().get(media_type, []):
            raise UnsupportedOutput(f"{media_type} cannot be converted to {output} here")
        options = normalize_options(raw_options, output=output)
        digest = options_digest(options)
        fingerprint = request_fingerprint(
            source_sha256=upload.sha256, output=output, options=options
        )
        if idempotency_key is not None:
            replayed = _replay(tenant=tenant, key=idempotency_key, fingerprint=fingerprint)
            if replayed is not None:
                return Acceptance(job=replayed, created=False, replayed=True)
        duplicate = _existing_by_identity(
            tenant=tenant, sha256=upload.sha256, output=output, digest=digest
        )
        if duplicate is not None:
            if idempotency_key is not None:
                try:
                    with transaction.atomic():
                        _record_key(
                            tenant=tenant,
                            key=idempotency_key,
                            fingerprint=fingerprint,
                            job=duplicate,
                        )
                except _ExistingJob as existing:
                    return Acceptance(job=existing.job, created=False, replayed=existing.replayed)
            return Acceptance(job=duplicate, created=False, replayed=False)
        admission_check(tenant=tenant)
        source_key = storage.promote_source(upload.path, upload.sha256)
    finally:
        upload.path.unlink(missing_ok=True)

    with transaction.atomic():
        return _insert_job(
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
        )


class _ExistingJob(Exception):
    def __init__(self, job: ConversionJob, replayed: bool) -> None:
        self.job, self.replayed = job, replayed


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
) -> Acceptance:
    """Runs inside the acceptance transaction. A content-identity race lost to a concurrent
    submit answers with the winner's job; the key (if any) is then bound to that job in this
    same transaction, which must commit, so the answer is returned rather than raised."""
    job_id = uuid.uuid4()
    try:
        with transaction.atomic():
            job = ConversionJob.objects.create(
                id=job_id,
                tenant=tenant,
                state=State.QUEUED,
                source_key=source_key,
                source_sha256=upload.sha256,
                source_size=upload.size,
                source_media_type=media_type,
                output=output,
                options=options,
                options_digest=digest,
                policy_version=settings.QUIRE["POLICY_VERSION"],
                max_attempts=settings.QUIRE["MAX_ATTEMPTS"],
                queued_at=timezone.now(),
                traceparent=traceparent,
            )
    except IntegrityError as exc:
        if violated_constraint(exc) != "job_content_identity_live_or_succeeded":
            raise
        # Another submit of the same content committed first: answer with its job.
        existing = _existing_by_identity(
            tenant=tenant, sha256=upload.sha256, output=output, digest=digest
        )
        if existing is None:  # it left the live/succeeded set meanwhile; the client retries
            raise InvalidRequest("a concurrent identical job changed state; retry") from exc
        if idempotency_key is not None:
            try:
                _record_key(
                    tenant=tenant, key=idempotency_key, fingerprint=fingerprint, job=existing
                )
            except _ExistingJob as winner:
                return Acceptance(job=winner.job, created=False, replayed=winner.replayed)
        return Acceptance(job=existing, created=False, replayed=False)

    faults.hit("accept.after_job_insert")
    outbox = ConversionOutbox.objects.create(job=job, generation=1, traceparent=traceparent)
    if idempotency_key is not None:
        _record_key(tenant=tenant, key=idempotency_key, fingerprint=fingerprint, job=job)
    audit_event_append(
        job_id=job.id,
        event_type="accepted",
        generation=1,
        actor=actor,
        details={"media_type": media_type, "size": upload.size, "output": output},
        lock_job=False,
    )
    outbox_publish_after_commit(
        outbox_id=outbox.id, job_id=job.id, generation=1, traceparent=traceparent
    )
    return Acceptance(job=job, created=True, replayed=False)


def _record_key(*, tenant: str, key: str, fingerprint: str, job: ConversionJob) -> None:
    """Bind the key to ``job``; a concurrent binding of the same key wins and decides."""
    try:
        with transaction.atomic():
            IdempotencyRecord.objects.create(
                tenant=tenant, key=key, fingerprint=fingerprint, job=job
            )
    except IntegrityError as exc:
        if violated_constraint(exc) != "idempotency_tenant_key":
            raise
        winner = IdempotencyRecord.objects.select_related("job").get(tenant=tenant, key=key)
        if winner.fingerprint != fingerprint:
            raise IdempotencyKeyReused() from exc
        raise _ExistingJob(winner.job, replayed=True) from exc
