"""Job acceptance (docs/ARCHITECTURE.md §2): 202 only once the job is durably recoverable."""

from __future__ import annotations

import functools
import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ParamSpec

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from conversion_jobs import converters, faults, passwords, storage
from conversion_jobs.exceptions import (
    CapacityExceeded,
    DocumentQuarantined,
    IdempotencyKeyReused,
    InvalidMetadata,
    InvalidRequest,
    StorageUnavailable,
    TenantQuotaExceeded,
    UnsupportedMediaType,
    UnsupportedOutput,
)
from conversion_jobs.ids import uuid7
from conversion_jobs.models import ConversionJob, IdempotencyRecord
from conversion_jobs.observability import metrics
from conversion_jobs.options import normalize_options, options_digest, request_fingerprint
from conversion_jobs.services import fair, transitions
from conversion_jobs.services.admission import (
    admission_accepted,
    admission_admit,
)
from conversion_jobs.services.artifacts import source_lock
from conversion_jobs.services.quarantine import document_quarantined
from conversion_jobs.states import LIVE_STATES, State
from conversion_jobs.store import jobs as jobs_store
from conversion_jobs.store.db import violated_constraint

P = ParamSpec("P")


@dataclass(frozen=True)
class StagedUpload:
    """An upload already hashed: streamed to a local staged file (``path``), or, no larger than
    ``QUIRE_INLINE_SOURCE_MAX_BYTES``, kept in memory (``content``; ``path`` None)."""

    path: Path | None
    sha256: str
    size: int
    content: bytes | None = None


@dataclass(frozen=True)
class Acceptance:
    job: ConversionJob
    #: True: a new job was written (202). False: an existing job answers (200).
    created: bool
    #: True when the answer is an Idempotency-Key replay.
    replayed: bool


@dataclass(frozen=True)
class _Identity:
    """What the answers to a submit other than a new job are looked up by: the tenant, its
    Idempotency-Key (``key``) and the request's ``fingerprint`` (a replay); the content identity,
    the source's ``sha256``, the ``output`` and the options' ``digest`` (a duplicate); and with
    ``sha256``, ``engine`` (``converters.engine_version``: the quarantine's key)."""

    tenant: str
    key: str | None
    fingerprint: str
    sha256: str
    output: str
    digest: str
    engine: str

    @classmethod
    def of(
        cls, *, tenant: str, key: str | None, sha256: str, output: str, checked: _Checked
    ) -> _Identity:
        """A submit's identity: the request's own parts and what its checks made of them."""
        return cls(
            tenant, key, checked.fingerprint, sha256, output, checked.digest, checked.engine_version
        )


def _identity_match(identity: _Identity) -> uuid.UUID | None:
    """The live or succeeded job with this content identity, if any (at most one: the partial
    unique constraint)."""
    return (
        ConversionJob.objects.filter(
            tenant=identity.tenant,
            source_sha256=identity.sha256,
            output=identity.output,
            options_digest=identity.digest,
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


def _existing_answer(identity: _Identity, job_id: uuid.UUID) -> Acceptance:
    """The answer of the existing job ``job_id`` (a duplicate), the key (if any) bound to it."""
    if identity.key is None:
        return Acceptance(job=ConversionJob.objects.get(id=job_id), created=False, replayed=False)
    return _bind_key(
        tenant=identity.tenant, key=identity.key, fingerprint=identity.fingerprint, job_id=job_id
    )


@dataclass(frozen=True)
class _Seen:
    key_fingerprint: str | None
    key_job: uuid.UUID | None
    duplicate: uuid.UUID | None
    quarantined: bool = False


def _precheck(identity: _Identity) -> _Seen:
    params = {
        "tenant": identity.tenant,
        "key": identity.key,
        "sha": identity.sha256,
        "output": identity.output,
        "digest": identity.digest,
        "policy": settings.QUIRE["POLICY_VERSION"],
        "engine": identity.engine,
    }
    fingerprint, key_job, duplicate, quarantined = jobs_store.precheck(params)
    as_uuid = lambda value: None if value is None else uuid.UUID(str(value))  # noqa: E731
    return _Seen(fingerprint, as_uuid(key_job), as_uuid(duplicate), bool(quarantined))


def _quarantine_refusals_counted(accept: Callable[P, Acceptance]) -> Callable[P, Acceptance]:
    """``accept``, counting the refusals of a quarantined document
    (``QUARANTINE_REFUSALS``)."""

    @functools.wraps(accept)
    def counted(*args: P.args, **kwargs: P.kwargs) -> Acceptance:
        try:
            return accept(*args, **kwargs)
        except DocumentQuarantined:
            metrics.QUARANTINE_REFUSALS.inc()
            raise

    return counted


@_quarantine_refusals_counted
def conversion_job_accept(
    *,
    tenant: str,
    actor: str,
    upload: StagedUpload,
    output: str,
    raw_options: Any,
    idempotency_key: str | None,
    traceparent: str = "",
    raw_metadata: Any = None,
) -> Acceptance:
    """(none) -> QUEUED, generation 1, with its outbox row, idempotency record and audit event in
    one statement (``transitions.job_insert_queued``). Returns the job and whether it is new; an
    existing job answers a replay or a content-identity duplicate. Raises a QuireError (nothing
    written) otherwise.

    A stored source: two round trips on the way to a 202, the pre-check read
    (``store.jobs.PRECHECK``), then the insert (plus the admission snapshot's grouped count, at most
    every 0.25 s per process, and the exact count near a limit). An inline source on Postgres:
    the insert alone, which also writes the bytes; its conflicts are the pre-check (the key's
    binding is read first, then the content identity's job). Races are settled by the unique
    constraints, never by a read: a submit that loses one rolls its whole statement back and
    answers from the winner.

    A document the tenant has quarantined (services/quarantine.py) is refused with
    DocumentQuarantined (422), nothing written, after a key's replay and before a duplicate:
    the pre-check read asks, and the insert statement itself is guarded (no row back)."""
    inline = upload.content is not None
    db = transaction.get_connection()
    # No pre-check read for an inline source where its statement settles duplicates.
    fold = inline and jobs_store.insert_alone()
    try:
        checked = _checked(
            upload=upload, output=output, raw_options=raw_options, raw_metadata=raw_metadata
        )
        identity = _Identity.of(
            tenant=tenant, key=idempotency_key, sha256=upload.sha256, output=output, checked=checked
        )
        precheck = functools.partial(_precheck_answer, identity)
        existing = None if fold else precheck()
        if existing is None:
            existing = _admitted(tenant=tenant, fold=fold, precheck=precheck)
        if existing is not None:
            return existing
        source_key, uploaded = _source_stored(upload)
    finally:
        if upload.path is not None:
            upload.path.unlink(missing_ok=True)

    new = _new_job(
        tenant=tenant,
        actor=actor,
        upload=upload,
        output=output,
        checked=checked,
        source_key=source_key,
        idempotency_key=idempotency_key,
        traceparent=traceparent,
    )
    job = new.job
    try:
        inserted = _inserted(
            new, db=db, sha256=upload.sha256, source_key=source_key, uploaded=uploaded
        )
    except IntegrityError as exc:
        # Everything this submit wrote is rolled back; answer from whoever won.
        constraint = violated_constraint(exc)
        if constraint == "idempotency_tenant_key" and idempotency_key is not None:
            replay = _replay(tenant=tenant, key=idempotency_key, fingerprint=checked.fingerprint)
            if replay is None:  # pragma: no cover - the row that conflicted cannot vanish
                raise
            return replay
        if constraint != "job_content_identity_live_or_succeeded":
            raise
        conflict: IntegrityError | None = exc
    else:
        if inserted:
            admission_accepted(tenant=tenant)
            return Acceptance(job=job, created=True, replayed=False)
        conflict = None  # the inline statement met the identity: nothing written, no error
    return _identity_conflict_answer(identity, cause=conflict)


def _admitted(
    *, tenant: str, fold: bool, precheck: Callable[[], Acceptance | None]
) -> Acceptance | None:
    """Admission control lets the new job in (None), or refuses it (raised). A replay or a
    duplicate is answered even at the tenant's limit (it adds no job): the folded path reads
    what the pre-check would have, on refusal only, and answers with it."""
    try:
        admission_admit(tenant=tenant)
    except (TenantQuotaExceeded, CapacityExceeded):
        if not fold:
            raise
        existing = precheck()
        if existing is None:
            raise
        return existing
    return None


def _source_stored(upload: StagedUpload) -> tuple[str, bool]:
    """The source's key, and whether this request uploaded it (an inline source counts: it is
    in the insert statement) rather than reusing an object already stored."""
    if upload.content is not None or upload.path is None:
        return storage.inline_source_key(upload.sha256), True
    try:
        return storage.put_source(upload.path, upload.sha256)
    except storage.StorageError as exc:
        raise StorageUnavailable() from exc


def _inserted(
    new: transitions.NewJob, *, db: Any, sha256: str, source_key: str, uploaded: bool
) -> bool:
    """The job's insert (``transitions.job_insert_queued``): whether it wrote the job (False:
    the inline statement met the content identity, nothing written)."""
    if uploaded and jobs_store.insert_alone() and not db.in_atomic_block:
        # An object we just uploaded (or an inline source, which is in the statement) needs no
        # check (deleters leave objects younger than the grace alone), so the acceptance is the
        # insert alone: one statement, which Postgres commits whole or not at all in
        # autocommit, without a BEGIN and a COMMIT round trip around it (ADR 0017, session 6).
        # The 202 still follows its commit.
        return transitions.job_insert_queued(new)
    with transaction.atomic():
        # We reused an object a deleter (retention, the orphan sweep) may have judged unused
        # since: under the source's lock it is still there, or we stop.
        if not uploaded:
            source_lock(sha256=sha256, exclusive=False)
            if not _source_present(source_key):
                raise StorageUnavailable("the stored source vanished; retry")
        inserted = transitions.job_insert_queued(new)
        faults.hit("accept.after_job_insert")
    return inserted


@dataclass(frozen=True)
class _Checked:
    """What the request's checks made of it: the sniffed type, the normalised options (the
    password sealed out of them), their digest and the request's fingerprint."""

    media_type: str
    options: dict[str, Any]
    sealed: str | None
    digest: str
    fingerprint: str
    metadata: dict[str, Any] | None = None
    #: ``converters.engine_version`` of the sniffed type (the quarantine's key)
    engine_version: str = ""
    #: the page count the source's bytes suggest, for the dispatch cost (``fair.pdf_page_hint``)
    page_hint: int | None = None


#: The largest client ``metadata`` object, as compact UTF-8 JSON (docs/API_CONTRACT.md §3).
METADATA_MAX_BYTES = 2048


def checked_metadata(raw: Any) -> dict[str, Any] | None:
    """The client's ``metadata`` form field: absent, or a JSON object of at most 2 KB. Not part
    of the content identity or the idempotency fingerprint: a duplicate or a replay answers the
    job as first accepted, its metadata included."""
    if raw is None or raw == "":
        return None
    try:
        value = json.loads(raw) if isinstance(raw, (str, bytes)) else raw
    except ValueError as exc:
        raise InvalidMetadata("metadata must be a JSON object") from exc
    if not isinstance(value, dict):
        raise InvalidMetadata("metadata must be a JSON object")
    size = len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())
    if size > METADATA_MAX_BYTES:
        raise InvalidMetadata(f"metadata must be at most {METADATA_MAX_BYTES} bytes of JSON")
    return value


def _checked(
    *, upload: StagedUpload, output: str, raw_options: Any, raw_metadata: Any = None
) -> _Checked:
    """The acceptance's checks, in memory (no query). Raises a QuireError (415, 422)."""
    if upload.content is not None:
        media_type = converters.sniff_media_type_bytes(upload.content)
    elif upload.path is not None:
        media_type = converters.sniff_media_type(upload.path)
    else:  # pragma: no cover - the upload handler makes one or the other
        raise InvalidRequest("the file part is required")
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
    fingerprint = request_fingerprint(source_sha256=upload.sha256, output=output, options=options)
    metadata = checked_metadata(raw_metadata)
    engine = converters.engine_version(media_type)
    hint = (
        fair.pdf_page_hint(upload.content if upload.content is not None else upload.path)
        if media_type == "application/pdf"
        else None
    )
    return _Checked(
        media_type, options, sealed, digest, fingerprint, metadata, engine, page_hint=hint
    )


def _new_job(
    *,
    tenant: str,
    actor: str,
    upload: StagedUpload,
    output: str,
    checked: _Checked,
    source_key: str,
    idempotency_key: str | None,
    traceparent: str,
) -> transitions.NewJob:
    job = ConversionJob(
        id=uuid7(),
        tenant=tenant,
        state=State.QUEUED,
        source_key=source_key,
        source_sha256=upload.sha256,
        source_size=upload.size,
        source_media_type=checked.media_type,
        output=output,
        options=checked.options,
        options_digest=checked.digest,
        policy_version=settings.QUIRE["POLICY_VERSION"],
        max_attempts=settings.QUIRE["MAX_ATTEMPTS"],
        queued_at=timezone.now(),
        traceparent=traceparent,
        password_sealed=checked.sealed,
        metadata=checked.metadata,
        dispatch_cost=fair.dispatch_cost(
            media_type=checked.media_type,
            size=upload.size,
            output=output,
            options=checked.options,
            page_hint=checked.page_hint,
        ),
    )
    return transitions.NewJob(
        job=job,
        actor=actor,
        idempotency_key=idempotency_key,
        fingerprint=checked.fingerprint,
        details={"media_type": checked.media_type, "size": upload.size, "output": output},
        inline_content=upload.content,
        engine_version=checked.engine_version,
    )


def _precheck_answer(identity: _Identity) -> Acceptance | None:
    """The answer the pre-check read gives (a replay, a duplicate), or None: insert. Raises
    DocumentQuarantined for a quarantined document that is not a key's replay."""
    seen = _precheck(identity)
    if seen.key_job is not None:
        if seen.key_fingerprint != identity.fingerprint:
            raise IdempotencyKeyReused()
        return Acceptance(
            job=ConversionJob.objects.get(id=seen.key_job), created=False, replayed=True
        )
    if seen.quarantined:
        raise DocumentQuarantined()
    if seen.duplicate is not None:
        return _existing_answer(identity, seen.duplicate)
    return None


def _identity_conflict_answer(identity: _Identity, *, cause: Exception | None) -> Acceptance:
    """The insert met a job with this content identity, or the document's quarantine. With a
    key, its binding answers first (a replay of its own job, or 422 for another payload: the
    same answers the pre-check read gives); then the quarantine (422); otherwise the
    identity's job does, and the key (if any) is bound to it."""
    tenant, key = identity.tenant, identity.key
    if key is not None:
        replay = _replay(tenant=tenant, key=key, fingerprint=identity.fingerprint)
        if replay is not None:
            return replay
    if document_quarantined(
        tenant=tenant, source_sha256=identity.sha256, engine_version=identity.engine
    ):
        raise DocumentQuarantined()
    winner = _identity_match(identity)
    if winner is None:  # it left the live/succeeded set meanwhile; the client retries
        raise InvalidRequest("a concurrent identical job changed state; retry") from cause
    return _existing_answer(identity, winner)


def _source_present(key: str) -> bool:
    try:
        return storage.exists(key)
    except storage.StorageError as exc:
        raise StorageUnavailable() from exc
