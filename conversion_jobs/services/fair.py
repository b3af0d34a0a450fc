"""Fair dispatch (docs/ARCHITECTURE.md §2b, ADR 0021): Postgres decides what runs next.

A *dispatch unit* is an unpublished ``conversion_outbox`` row whose job is still ``queued`` in
the row's generation, or - a page range of a fanned-out job (ADR 0023) - whose range is still
``queued`` in the row's range generation while its job runs in the row's generation; its cost is
``COALESCE(outbox.cost, job.dispatch_cost)`` page units (:func:`dispatch_cost`; a range's row
carries its own: its pages x the output's factor). The relay sends a unit to RabbitMQ only
when a worker slot is free:

* **credits** = slots - busy. Slots are ``QUIRE_FAIR_CAPACITY`` when set, else the worker pool
  processes that announced themselves in ``worker_slot`` within ``QUIRE_FAIR_SLOT_TTL_S``
  (:func:`slot_beat_start`). Busy = jobs ``running`` / ``cancelling`` (but not a fanned-out
  job whose ranges are queued or running: they hold its slots) + running ranges + jobs and
  ranges sent and not claimed yet (``dispatched_at`` within ``QUIRE_FAIR_LOST_S``). Every
  figure is counted from rows at each pick, never kept as a running counter: a credit returns
  by itself when a job (or range) ends, yields, is cancelled or loses its lease (it leaves
  ``running``), and a message lost after its pick stops counting after ``QUIRE_FAIR_LOST_S``
  (the stale-dispatch sweep then writes a new unit for it).
* **order**: start-time fair queueing over cost / weight. Each tenant has a virtual time
  (``tenant_share.vtime``, the finish tag of its last sent unit); a waiting unit's start tag is
  ``max(vtime, clock) + (cost of the tenant's units before it) / weight``; the units with the
  smallest start tags are sent, ``dispatch_clock.vclock`` follows the last start tag sent, so a
  tenant that was idle starts again at the clock and banks nothing.
* **one picker at a time**: Postgres runs the whole pick as ``quire_fair_pick`` (migration 0020:
  it reads each tenant's first waiting units, ``conversion_outbox.tenant``) under a
  transaction-scoped advisory lock; SQLite's twin runs under ``BEGIN IMMEDIATE`` (the
  database's one write lock). Both, and every statement of the relay, are ``store/fair.py``'s.
  Two relays never send one unit twice or exceed the credits.

Every caller that may have freed or filled a slot runs a pick: the commit fast path (the web's
background publisher, or inline), the worker after each attempt (its credit returned: in
production, where a worker may not publish, it :func:`wake` s the sweeper's relay instead), the
relay woken by ``NOTIFY quire_dispatch`` (``relay_wake.py``: ranges planned, a slot freed), the
outbox sweep every second (the backstop). On an idle system the unit a commit wrote is the one
its own fast path picks: one statement before the publish instead of one after.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import re
import socket
import threading
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any, NamedTuple

from django.conf import settings
from django.db import close_old_connections, connection, transaction
from django.db.models import Count, Sum
from django.db.models.functions import Coalesce, Now
from django.utils import timezone

from conversion_jobs import faults
from conversion_jobs.converters import StepAside
from conversion_jobs.models import (
    ConversionJob,
    ConversionOutbox,
    JobRange,
    PageCheckpoint,
    PageState,
    TenantShare,
    WorkerSlot,
)
from conversion_jobs.observability import gauges, metrics
from conversion_jobs.services import broker
from conversion_jobs.services.leases import Lease
from conversion_jobs.store import fair as fair_store
from conversion_jobs.store import notify

log = logging.getLogger(__name__)


def enabled() -> bool:
    return bool(settings.QUIRE["FAIR_DISPATCH"])


# --- cost ----------------------------------------------------------------------------------------

#: Bytes per page when the page count is not known yet (acceptance): medians of the test corpus
#: and of common office documents, rounded (docs/OPERABILITY.md "Fair share", cost estimate).
BYTES_PER_PAGE = {
    "application/pdf": 60_000,
    "image/tiff": 400_000,
    "application/vnd.openxmlformats-officedocument.wordprocessingml.document": 20_000,
    "application/vnd.oasis.opendocument.text": 20_000,
    "application/rtf": 8_000,
    "application/vnd.openxmlformats-officedocument.presentationml.presentation": 150_000,
    "application/vnd.openxmlformats-officedocument.spreadsheetml.sheet": 30_000,
}
#: Single-image formats are one page whatever their size.
ONE_PAGE = frozenset({"image/png", "image/jpeg"})
#: Page units per page, by what the page costs a worker (measured relative to PDF -> text).
TEXT_FACTOR = 1
OCR_FACTOR = 40
OFFICE_FACTOR = 10  # LibreOffice's share per page, added to the output's own
PNG_FACTOR_AT_150_DPI = 4
PDF_FACTOR = 1
#: A guess is capped: a huge source's real page count replaces it at its first yield or retry.
MAX_ESTIMATED_PAGES = 5_000


def estimated_pages(
    *, media_type: str, size: int, options: dict[str, Any], page_hint: int | None = None
) -> int:
    """The page count an acceptance can know: the selected range when there is one, else one
    page for a single image, else the larger of the PDF's page hint (``pdf_page_hint``) and the
    size over the format's bytes per page (at least 1, at most ``MAX_ESTIMATED_PAGES``)."""
    selected = options.get("pages")
    if selected:
        first, last = selected[0], selected[-1]
        return max(1, int(last) - int(first) + 1)
    if media_type in ONE_PAGE:
        return 1
    per_page = BYTES_PER_PAGE.get(media_type, 50_000)
    return max(1, min(MAX_ESTIMATED_PAGES, max(page_hint or 0, math.ceil(size / per_page))))


#: How much of a stored PDF the hint reads: its first and its last bytes (a PDF's page tree
#: root, with its ``/Count``, is usually near one end).
HINT_BYTES = 256 * 1024
_PAGE_OBJECT = re.compile(rb"/Type\s*/Page(?![A-Za-z])")
_PAGE_COUNT = re.compile(rb"/Count\s+(\d{1,7})")


def pdf_page_hint(source: bytes | Path | None) -> int | None:
    """The page count a PDF's bytes suggest without parsing it (no document is interpreted in
    the web, docs/ARCHITECTURE.md §7): the larger of the page objects seen and the largest
    ``/Count`` seen, in the whole of a small source or the first and last ``HINT_BYTES`` of a
    stored one. Pages inside compressed object streams are not seen (the size estimate still
    counts); a wrong hint only moves the job's turn. None: nothing seen."""
    if source is None:
        return None
    if isinstance(source, Path):
        try:
            with open(source, "rb") as fh:
                head = fh.read(HINT_BYTES)
                fh.seek(0, os.SEEK_END)
                end = fh.tell()
                fh.seek(max(HINT_BYTES, end - HINT_BYTES))
                data = head + b"\n" + fh.read(HINT_BYTES)
        except OSError:
            return None
    else:
        data = source
    objects = len(_PAGE_OBJECT.findall(data))
    counts = [int(n) for n in _PAGE_COUNT.findall(data)]
    hint = max([objects, *counts])
    return min(hint, MAX_ESTIMATED_PAGES) or None


def page_factor(*, media_type: str, output: str, options: dict[str, Any]) -> int:
    """What one page of this output costs, in page units (PDF -> text = 1)."""
    image = media_type.startswith("image/")
    office = not image and media_type != "application/pdf"
    if output == "text":
        factor = OCR_FACTOR if image else TEXT_FACTOR
    elif output == "png":
        dpi = options.get("dpi") or 150
        factor = max(1, round(PNG_FACTOR_AT_150_DPI * (dpi / 150) ** 2))
    else:
        factor = PDF_FACTOR
    return factor + (OFFICE_FACTOR if office else 0)


def dispatch_cost(
    *,
    media_type: str,
    size: int,
    output: str,
    options: dict[str, Any],
    pages: int | None = None,
    page_hint: int | None = None,
) -> int:
    """A dispatch's cost in page units: pages x the output's factor. ``pages``: the pages the
    dispatch will convert when known (a resumed job's pages left), else estimated (with the
    source's ``page_hint``, ``pdf_page_hint``)."""
    if pages is None:
        pages = estimated_pages(
            media_type=media_type, size=size, options=options, page_hint=page_hint
        )
    return max(1, pages) * page_factor(media_type=media_type, output=output, options=options)


# --- the pick -----------------------------------------------------------------------------------


class Unit(fair_store.Picked):
    """A dispatch unit the relay chose to send now (a row of the pick, ``store.fair.Picked``): a
    job's message, or a page range's (its first page and range generation, ADR 0023)."""

    @property
    def page_range(self) -> broker.RangeRef | None:
        if self.range_first is None or self.range_generation is None:
            return None
        return broker.RangeRef(self.range_first, self.range_generation)

    @classmethod
    def sent_at_acceptance(
        cls, outbox_id: int, job_id: uuid.UUID, generation: int, traceparent: str
    ) -> Unit:
        """A job's unit its acceptance's statement sent (``store.fair.ADMIT``): what the publish
        and its failure need (the tenant and the cost were spent in the statement)."""
        return cls(outbox_id, job_id, generation, traceparent, tenant="", cost=0)


def pick(*, limit: int) -> list[Unit]:
    """Choose and mark sent at most ``limit`` units, fewer when credits are short, in fair order
    (``store.fair.pick``). Commits before it returns when called outside a transaction (the
    caller publishes after)."""
    units = [Unit(*row) for row in fair_store.pick(limit=limit)]
    if units:
        metrics.FAIR_DISPATCHED.inc(len(units))
    return units


def capacity() -> int:
    """Worker slots: ``QUIRE_FAIR_CAPACITY``, or those announced within the slot TTL."""
    return fair_store.capacity()


def busy_by_tenant() -> dict[str, int]:
    """Slots in use per tenant, read from rows (``store.fair.busy_by_tenant``)."""
    return fair_store.busy_by_tenant()


def unsend(units: list[Unit], *, code: str) -> None:
    """Units picked but not published (a broker error): back to waiting, the failure recorded.
    Their tenants' virtual time stays advanced (a little unfair to them, never to the others)."""
    if not units:
        return
    with transaction.atomic():
        ConversionOutbox.objects.filter(id__in=[u.outbox_id for u in units]).update(
            published_at=None, last_error_code=code
        )
        for u in units:
            if u.range_first is None:
                ConversionJob.objects.filter(
                    id=u.job_id, dispatched_generation=u.generation
                ).update(dispatched_at=None)
            elif u.range_generation is not None:
                JobRange.objects.filter(
                    job_id=u.job_id, first_page=u.range_first, generation=u.range_generation
                ).update(dispatched_at=None)


# --- the relay ------------------------------------------------------------------------------------

#: ``NOTIFY`` channel of the relay's wake-up (``relay_wake.py`` listens in the sweeper process,
#: whose broker user may publish).
CHANNEL = "quire_dispatch"


def wake() -> None:
    """Ask the process that publishes to pick now: dispatch units were written by a process that
    may not publish (a worker: ranges planned or requeued), or a slot was freed (an attempt or a
    range ended). Inside a transaction Postgres delivers the NOTIFY at its commit, and folds
    several into one; without one, at once. Never fails its caller (the outbox sweep's tick is
    the backstop). SQLite: nothing (the standalone worker relays itself)."""
    try:
        notify.notify(CHANNEL)
    except Exception as exc:
        if connection.in_atomic_block:
            raise  # the caller's transaction is broken anyway: its own handling decides
        log.warning("relay wake-up failed; the sweep picks", extra={"error": type(exc).__name__})


def relay(*, limit: int, path: str) -> int:
    """Pick and publish (:func:`publish`). The count sent."""
    return publish(pick(limit=limit), path=path)


def relay_if_waiting(*, limit: int, path: str) -> int:
    """:func:`relay` when a row waits to be sent (``store.fair.anything_unsent``), else nothing:
    the woken relay and the sweep's tick (a slot freed, nothing waiting: the idle case) no
    longer take the pick's lock, which an idle system's acceptance then finds free and sends
    its own unit (ADR 0021, "Sent at acceptance"). A row written after the look has its own
    way out: its commit's fast path, or the wake-up its writer sends."""
    if not fair_store.anything_unsent():
        return 0
    return relay(limit=limit, path=path)


def publish(units: list[Unit], *, path: str) -> int:
    """Publish units marked sent (by a pick, or by their acceptance); units the broker did not
    take go back to waiting, the ones it confirmed are marked so (:func:`confirm`). The count
    sent."""
    if units:
        faults.hit("fair.after_pick")
    for index, unit in enumerate(units):
        try:
            broker.publish_conversion(
                job_id=unit.job_id,
                generation=unit.generation,
                traceparent=unit.traceparent,
                page_range=unit.page_range,
            )
        except Exception as exc:
            code = broker.error_code(exc)
            metrics.OUTBOX_PUBLISH_FAILURES.labels(path=path, code=code).inc(len(units) - index)
            log.warning(
                "fair relay publish failed; the units wait for the next pick",
                extra={"code": code, "error": type(exc).__name__},
            )
            confirm([u.outbox_id for u in units[:index]])
            unsend(units[index:], code=code)
            return index
    if units:
        confirm([u.outbox_id for u in units])
        metrics.OUTBOX_PUBLISHED.labels(path=path).inc(len(units))
    return len(units)


# --- a pick that was never published ------------------------------------------------------------


def confirm(outbox_ids: list[int]) -> None:
    """Record that the broker confirmed these picked units' messages (ADR 0021, "A unit picked
    and lost"): their row's ``published_at`` moves from the pick's time to the confirm's
    (``store.fair.CONFIRM``). Never raises: a mark that fails leaves the units looking
    unconfirmed, and :func:`units_return_unconfirmed` sends them once more (a harmless
    duplicate)."""
    if not outbox_ids:
        return
    try:
        fair_store.confirm(outbox_ids)
    except Exception as exc:
        log.warning("could not mark picked units confirmed", extra={"error": type(exc).__name__})
        raw = connection.connection
        if raw is not None and (getattr(raw, "broken", False) or getattr(raw, "closed", False)):
            connection.close()  # a thread with no request cycle would keep a dead one


def unconfirmed_after_s() -> float:
    """How long a picked unit may stay unconfirmed before it goes back to waiting: twice the
    publisher's confirm timeout (a live publisher has had its confirm or given the unit back
    by then)."""
    return 2.0 * float(settings.QUIRE["PUBLISH_CONFIRM_TIMEOUT_S"])


def units_return_unconfirmed(*, batch: int) -> int:
    """Units picked and never confirmed (their picker killed between its pick and its publish)
    go back to waiting after ``unconfirmed_after_s``, for the next pick, instead of counting as
    busy until ``QUIRE_FAIR_LOST_S`` and the stale-dispatch sweep (``store.fair.
    RETURN_UNCONFIRMED``). The outbox sweep runs this before its pick, every tick. Their
    tenants' virtual time stays advanced, as after a broker error (:func:`unsend`). A picker
    that was only stalled and publishes after all sends a duplicate message, which the claim's
    CAS ignores. The count returned."""
    count = fair_store.return_unconfirmed(after_s=unconfirmed_after_s(), batch=batch)
    if count:
        metrics.REDISPATCHES.labels(reason="unconfirmed").inc(count)
        log.warning("picked units never confirmed went back to waiting", extra={"count": count})
    return count


def relay_quietly(*, path: str) -> int:
    """:func:`relay` for hooks that must never fail their caller (after a commit, after an
    attempt): an error leaves the units to the outbox sweep."""
    try:
        return relay(limit=settings.QUIRE["SWEEP_BATCH"], path=path)
    except Exception as exc:
        log.warning(
            "fair relay pass failed; the sweep retries", extra={"error": type(exc).__name__}
        )
        return 0


def publish_quietly(units: list[Unit], *, path: str) -> int:
    """:func:`publish` for a hook that must never fail its caller (after an acceptance's commit
    that sent its unit): an error leaves the units to the outbox sweep, which returns a unit
    never confirmed to waiting (:func:`units_return_unconfirmed`)."""
    try:
        return publish(units, path=path)
    except Exception as exc:
        log.warning("fair publish failed; the sweep retries", extra={"error": type(exc).__name__})
        return 0


def others_waiting(*, tenant: str) -> bool:
    """Another tenant has a unit waiting and no slot is free for it: the condition under which
    a running attempt that used its slice yields (docs/ARCHITECTURE.md §2b). Asked every
    ``QUIRE_FAIR_CHECK_S`` past the slice: the cheap question first."""
    if not fair_store.others_unsent(tenant=tenant):
        return False
    if not fair_store.waiting().exclude(job__tenant=tenant).exists():
        return False
    return capacity() - sum(busy_by_tenant().values()) <= 0


def outbox_rows_retire_superseded(*, batch: int) -> int:
    """Unpublished rows whose job left that generation (cancelled, requeued, finished), or whose
    range left that range generation (claimed through another message, requeued, cancelled),
    are no dispatch unit any more: marked so the backlog and its gauges do not keep them."""
    cutoff = timezone.now() - timedelta(seconds=settings.QUIRE["FAIR_LOST_S"])
    ids = list(
        ConversionOutbox.objects.filter(published_at__isnull=True, created_at__lt=cutoff)
        .exclude(id__in=fair_store.waiting().values("id"))
        .values_list("id", flat=True)[:batch]
    )
    if not ids:
        return 0
    return ConversionOutbox.objects.filter(id__in=ids, published_at__isnull=True).update(
        published_at=Now(), last_error_code="superseded"
    )


# --- stepping aside (ADR 0022) -------------------------------------------------------------------


def step_aside_for(lease: Lease) -> StepAside:
    """What a converter needs to step aside for the attempt holding ``lease``."""
    return StepAside(ask=functools.partial(step_aside, lease), others_wait=units_waiting)


def units_waiting() -> bool:
    """A unit waits to be sent (``store.fair.anything_unsent``): a conversion aside pauses. False
    when the database cannot say: it goes on (its CPU limit and wall cap still hold)."""
    try:
        return fair_store.anything_unsent()
    except Exception as exc:
        log.warning("units waiting: no answer", extra={"error": type(exc).__name__})
        close_old_connections()
        return False


def step_aside(lease: Lease) -> bool:
    """The attempt holding ``lease`` hands its slot back for the rest of a long conversion
    (``store.fair.STEP_ASIDE``: fenced, at most one attempt per spare pool process, only while
    a unit waits), and the relay is woken to fill it. False (keep the slot and ask again later)
    when it may not, or when the database cannot say: the conversion goes on either way."""
    try:
        stepped = fair_store.step_aside(job_id=lease.job_id, lease=lease.token)
    except Exception as exc:
        log.warning("step aside failed", extra={"error": type(exc).__name__})
        close_old_connections()
        return False
    if stepped:
        metrics.FAIR_STEPPED_ASIDE.inc()
        slot_freed()
    return stepped


def slot_freed() -> None:
    """A worker slot is free (an attempt or a range ended, or an attempt stepped aside): the
    fair order fills it now, not at the next outbox sweep. Where the worker may publish
    (standalone) it picks itself; in production its broker user may not (deploy/rabbitmq), so
    it wakes the sweeper's relay (``NOTIFY``, docs/ARCHITECTURE.md §2b)."""
    if not enabled():
        return
    if settings.STANDALONE:
        relay_quietly(path="fast")
    else:
        wake()


# --- worker slots ---------------------------------------------------------------------------------

_slot_lock = threading.Lock()
_slot_thread: tuple[int, threading.Thread] | None = None


def slot_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"[:160]


def slot_announce(*, slots: int = 1) -> None:
    """Say "this process has ``slots`` conversion slots, free or busy" (upsert, seen now)."""
    WorkerSlot.objects.update_or_create(
        name=slot_name(), defaults={"slots": slots, "seen_at": timezone.now()}
    )


def slot_withdraw() -> None:
    WorkerSlot.objects.filter(name=slot_name()).delete()


def slot_beat_start(*, slots: int = 1) -> None:
    """Announce this worker pool process now and every ``QUIRE_FAIR_SLOT_BEAT_S`` on a daemon
    thread (its own database connection); a process that dies stops counting after the TTL."""
    global _slot_thread
    with _slot_lock:
        if _slot_thread is not None and _slot_thread[0] == os.getpid():
            return
        thread = threading.Thread(
            target=_slot_beat, args=(slots,), name="quire-fair-slot", daemon=True
        )
        _slot_thread = (os.getpid(), thread)
        thread.start()


def _slot_beat(slots: int) -> None:
    stop = threading.Event()
    while True:
        try:
            slot_announce(slots=slots)
        except Exception as exc:  # the database is away: the slot lapses, credits shrink
            log.warning("worker slot beat failed", extra={"error": type(exc).__name__})
            close_old_connections()
        stop.wait(settings.QUIRE["FAIR_SLOT_BEAT_S"])


def slots_remove_stale(*, older_than_s: float = 3600.0) -> int:
    """Rows of processes gone for long (a sweep's housekeeping)."""
    cutoff = timezone.now() - timedelta(seconds=older_than_s)
    return WorkerSlot.objects.filter(seen_at__lt=cutoff).delete()[0]


# --- what operators see and set ---------------------------------------------------------------


class TenantFairness(NamedTuple):
    """One tenant's fair-share picture (admin page, ``/metrics``)."""

    tenant: str
    weight: int
    running_cap: int | None
    #: dispatch units waiting, and their cost in page units
    backlog_units: int
    backlog_cost: int
    #: jobs running or cancelling, and jobs sent and not yet claimed
    running: int
    #: pages checkpointed done in the last ``QUIRE_FAIR_SHARE_WINDOW_S``, and their share of all
    pages_window: int
    page_share: float


def tenants_fairness() -> list[TenantFairness]:
    """Every tenant with a share row, waiting work or running work (reads only; the page share
    counts ``page_checkpoint`` rows written in the window)."""
    window = timezone.now() - timedelta(seconds=settings.QUIRE["FAIR_SHARE_WINDOW_S"])
    backlog: dict[str, tuple[int, int]] = {}
    for tenant, n, cost in (
        fair_store.waiting()
        .values_list("job__tenant")
        .annotate(n=Count("id"), cost=Sum(Coalesce("cost", "job__dispatch_cost")))
        .values_list("job__tenant", "n", "cost")
    ):
        backlog[tenant] = (n, int(cost or 0))
    busy = busy_by_tenant()
    pages = dict(
        PageCheckpoint.objects.filter(state=PageState.DONE, updated_at__gte=window)
        .values_list("job__tenant")
        .annotate(n=Count("id"))
        .values_list("job__tenant", "n")
    )
    total = sum(pages.values())
    shares = {s.tenant: s for s in TenantShare.objects.all()}
    tenants = sorted(set(shares) | set(backlog) | set(busy) | set(pages))
    return [
        TenantFairness(
            tenant=t,
            weight=shares[t].weight if t in shares else 1,
            running_cap=shares[t].running_cap if t in shares else None,
            backlog_units=backlog.get(t, (0, 0))[0],
            backlog_cost=backlog.get(t, (0, 0))[1],
            running=busy.get(t, 0),
            pages_window=pages.get(t, 0),
            page_share=pages.get(t, 0) / total if total else 0.0,
        )
        for t in tenants
    ]


def tenant_share_set(
    *, tenant: str, weight: int | None = None, running_cap: int | None = None, no_cap: bool = False
) -> TenantShare:
    """An operator sets a tenant's weight (1-1000) and/or running cap (>= 1, or none). One
    upsert: the relay's ``vtime`` is never read or written here."""
    if weight is not None and not 1 <= weight <= 1000:
        raise ValueError("weight must be from 1 to 1000")
    if running_cap is not None and running_cap < 1:
        raise ValueError("running cap must be at least 1")
    TenantShare.objects.get_or_create(tenant=tenant)
    values: dict[str, Any] = {}
    if weight is not None:
        values["weight"] = weight
    if running_cap is not None or no_cap:
        values["running_cap"] = None if no_cap else running_cap
    if values:
        TenantShare.objects.filter(tenant=tenant).update(**values, updated_at=Now())
    return TenantShare.objects.get(tenant=tenant)


# the fairness gauges read through this hook (observability imports no service)
gauges.fairness_rows = tenants_fairness
gauges.fairness_capacity = capacity
