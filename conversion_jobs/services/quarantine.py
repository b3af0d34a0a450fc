"""Poison documents (issue 24 point 3; docs/OPERABILITY.md "Quarantine").

A document whose converter crashes - killed by a signal, past its memory limit, past its time
limit, or cut off mid-answer - on ``QUIRE_QUARANTINE_AFTER_CRASHES`` (2) attempts is quarantined
under the key (tenant, source sha256, engine version): never across tenants (that would tell one
tenant what another submitted). When the last ``QUIRE_QUARANTINE_HOST_WINDOW`` attempts ran on
more than one worker host (the host part of ``conversion_attempt.worker``, ``QUIRE_WORKER_HOST``),
the crashes must also come from two hosts, so one sick machine cannot quarantine a good document.

* The attempt that makes the decision fails its job ``document_quarantined`` (not retried to
  ``MAX_ATTEMPTS``); the same tenant's later submissions of the same bytes are answered 422
  ``document_quarantined`` with nothing written and no converter started
  (``services/acceptance.py``).
* A new engine version is a new key: the old quarantine no longer matches. An operator lifts one
  with the admin action or ``manage.py quarantine lift``: its crash rows go, so counting starts
  again.
* Counting is rows under a lock, never a read-modify-write: each crash is one
  ``document_crash`` row (one per attempt), inserted after an upsert of the key's row, which
  holds that row's lock until commit; the count that decides is read after it, so two workers
  recording a crash of one document at once are counted one after the other.

:func:`document_crash_record` is the one decision; every runner that sees a converter crash
(the page runner, a page-range runner) calls it.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from conversion_jobs.models import ConversionAttempt, DocumentCrash, DocumentQuarantine
from conversion_jobs.observability import metrics
from conversion_jobs.store import quarantine as store

log = logging.getLogger(__name__)

#: The error codes that say the converter itself crashed (converters/errors.py): a signal, the
#: memory limit, a cut answer (``converter_crashed``) or the time limit (``conversion_timeout``).
CRASH_CODES = frozenset({"converter_crashed", "conversion_timeout"})
#: The job's error code when its document is quarantined (docs/API_CONTRACT.md §5).
QUARANTINED = "document_quarantined"


def is_crash(code: str) -> bool:
    return code in CRASH_CODES


def engine_label(engine_version: str) -> str:
    """The converter's name for the metrics' ``engine`` label (``converters.engine_version``
    starts with its first engine)."""
    first = engine_version.split(" ", 1)[0].lower()
    return {"pdfium": "pdfium", "pillow": "image", "libreoffice": "libreoffice"}.get(first, "other")


def host_of(worker: str) -> str:
    """The host part of a worker identity ``<host>:<pid>``."""
    return worker.rpartition(":")[0] or worker


@dataclass(frozen=True)
class Verdict:
    #: the document is quarantined (now or before this crash)
    quarantined: bool
    crashes: int
    hosts: int
    #: hosts seen among the recent attempts (more than one: crashes must come from two)
    known_hosts: int


def known_hosts() -> int:
    """Distinct worker hosts among the last ``QUIRE_QUARANTINE_HOST_WINDOW`` attempts (a
    backward scan of the attempts' primary key: no index of its own, no table scan)."""
    window = settings.QUIRE["QUARANTINE_HOST_WINDOW"]
    workers = ConversionAttempt.objects.order_by("-id").values_list("worker", flat=True)[:window]
    return len({host_of(worker) for worker in workers})


def document_crash_record(
    *,
    tenant: str,
    source_sha256: str,
    engine_version: str,
    job_id: uuid.UUID,
    attempt_id: int,
    worker: str,
    code: str,
) -> Verdict:
    """Record that attempt ``attempt_id`` of ``job_id`` crashed its converter (``code`` in
    ``CRASH_CODES``) and decide: quarantined or not. Runs in the caller's transaction when it
    has one (the fenced failure that follows a positive verdict commits with the row), else in
    its own. A second call for one attempt counts nothing more."""
    now = timezone.now()
    host = host_of(worker)[:128]
    with transaction.atomic():
        key_id, quarantined_at, counted, crashes, hosts = store.crash_record(
            tenant=tenant,
            source_sha256=source_sha256,
            engine_version=engine_version,
            job_id=job_id,
            attempt_id=attempt_id,
            host=host,
            code=code,
            now=now,
        )
        hosts_known = known_hosts()
        enough = crashes >= settings.QUIRE["QUARANTINE_AFTER_CRASHES"]
        spread = hosts_known < 2 or hosts >= 2
        begins = quarantined_at is None and enough and spread
        values: dict[str, object] = {"crashes": crashes, "hosts": hosts}
        if begins:
            values.update(quarantined_at=now, job_id=job_id)
        DocumentQuarantine.objects.filter(id=key_id).update(**values)
    engine = engine_label(engine_version)
    if counted:
        transaction.on_commit(
            lambda: metrics.DOCUMENT_CRASHES.labels(engine=engine, code=code).inc()
        )
    if begins:
        transaction.on_commit(lambda: metrics.QUARANTINES.labels(engine=engine).inc())
        log.warning(
            "document quarantined",
            extra={"quarantine": key_id, "crashes": crashes, "hosts": hosts, "engine": engine},
        )
    return Verdict(
        quarantined=quarantined_at is not None or begins,
        crashes=crashes,
        hosts=hosts,
        known_hosts=hosts_known,
    )


def document_quarantined(*, tenant: str, source_sha256: str, engine_version: str) -> bool:
    """Whether this tenant's document is quarantined under this engine version (one lookup of
    the ``quarantine_key`` index)."""
    return DocumentQuarantine.objects.filter(
        tenant=tenant,
        source_sha256=source_sha256,
        engine_version=engine_version,
        quarantined_at__isnull=False,
    ).exists()


def document_quarantine_lift(*, quarantine_id: int, actor: str) -> bool:
    """An operator lifts a quarantine: its crash rows go (counting starts again) and the job
    that was failed by it gets a ``quarantine_lifted`` audit event (when it is still there).
    True: it was quarantined and is no longer; False: it was not (nothing changes)."""
    from conversion_jobs.models import ConversionJob
    from conversion_jobs.services.audit import audit_event_append

    with transaction.atomic():
        row = (
            DocumentQuarantine.objects.select_for_update()
            .filter(id=quarantine_id, quarantined_at__isnull=False)
            .values_list("job_id", "engine_version")
            .first()
        )
        if row is None:
            return False
        job_id, engine_version = row
        DocumentCrash.objects.filter(quarantine_id=quarantine_id).delete()
        DocumentQuarantine.objects.filter(id=quarantine_id).update(
            quarantined_at=None,
            crashes=0,
            hosts=0,
            lifted_at=timezone.now(),
            lifted_by=actor[:64],
            updated_at=timezone.now(),
        )
        if job_id is not None and ConversionJob.objects.filter(id=job_id).exists():
            audit_event_append(
                job_id=job_id,
                event_type="quarantine_lifted",
                actor=actor,
                details={"quarantine": quarantine_id},
            )
        engine = engine_label(engine_version)
        transaction.on_commit(lambda: metrics.QUARANTINE_LIFTS.labels(engine=engine).inc())
    log.info("document quarantine lifted", extra={"quarantine": quarantine_id})
    return True
