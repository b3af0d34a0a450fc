"""The fair relay's statements (docs/ARCHITECTURE.md §2b, ADR 0021): the pick, the
acceptance's own pick on an idle system (``ADMIT``), the confirm mark, the return of units
never confirmed, and an attempt's step aside (``STEP_ASIDE``, ADR 0022). Postgres runs the
pick as ``quire_fair_pick`` (migrations 0020-0022) under a transaction-scoped advisory lock;
SQLite's twins run the same algorithm in Python under ``BEGIN IMMEDIATE`` (the database's one
write lock). ``services/fair.py`` says what they are
for: the cost of a unit, the relay, the slots, what operators see."""

from __future__ import annotations

import uuid
from collections import defaultdict
from datetime import timedelta
from typing import Any, NamedTuple

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Count, Exists, F, OuterRef, Q, QuerySet
from django.utils import timezone

from conversion_jobs.models import (
    ConversionAttempt,
    ConversionJob,
    ConversionOutbox,
    DispatchClock,
    JobRange,
    RangeState,
    TenantShare,
    WorkerSlot,
)
from conversion_jobs.states import LEASED_STATES, State
from conversion_jobs.store import db
from conversion_jobs.store.prepared import id_batch, prepared_cursor

# --- the pick ----------------------------------------------------------------------------------


#: The pick as the commit fast path sends it: bound by the server and prepared once per
#: connection (``prepared.prepared_cursor``), so Postgres neither parses nor plans the call
#: again. The columns are named, not ``*``: a later version of the function that returns more
#: columns leaves this statement's result type, and its prepared plan, valid.
PICK = (
    "SELECT out_id, out_job, out_generation, out_traceparent, out_tenant, out_cost,"
    " out_range_first, out_range_generation"
    " FROM quire_fair_pick(%(limit)s::integer, %(capacity)s::integer,"
    " %(lost)s::float8, %(ttl)s::float8)"
)


#: The pick's advisory lock (``quire_fair_pick``, migration 0017): one sender at a time
#: (``ADMIT`` names it too; tests/integration/store/test_statements.py holds the two equal).
PICK_LOCK = 7102421

#: Sent at acceptance (ADR 0021, "Sent at acceptance"): CTEs that ``store.jobs.ACCEPT`` runs
#: before its inserts when fair dispatch is on, so that on an idle system the acceptance's own
#: statement is the pick and its commit is followed by the publish alone. ``credit``: a slot is
#: free (slots > busy, counted as the pick counts them); without one a pick after the commit
#: could send nothing, and the fast path runs none (the next slot freed wakes the relay).
#: ``idle`` has a row when a credit is free, no unit waits (nothing unpublished) and the tenant
#: has no running cap: the pick would choose this very unit. ``gate`` then takes the pick's lock
#: without waiting and moves the clock, but only if no sender committed since this statement's
#: snapshot: every sender (a pick that sent, another acceptance's gate) writes
#: ``dispatch_clock``, and ``k.xmin = seen.x`` is checked again against the newest row when the
#: row changed meanwhile (READ COMMITTED's re-check of an updated row), so a snapshot taken
#: before the lock never spends a credit a sender spent. A row in ``gate``: the job and its
#: outbox row are written sent (``dispatched_at`` and ``published_at`` the same time, as a pick
#: writes them), and the tenant's virtual time advances by the unit's cost. No row: the unit
#: waits for a pick, as before. Parameters: ``j_tenant``, ``j_dispatch_cost`` (the job's) and
#: ``f_capacity``, ``f_lost``, ``f_ttl``.
ADMIT = """
seen AS (
    SELECT c.xmin AS x, c.vclock FROM dispatch_clock c WHERE c.id = 1
), credit AS (
    SELECT (CASE WHEN %(f_capacity)s::integer > 0 THEN %(f_capacity)s::integer::bigint ELSE (
               SELECT COALESCE(sum(w.slots), 0) FROM worker_slot w
               WHERE w.seen_at > now() - make_interval(secs => %(f_ttl)s::float8)) END)
        > (SELECT count(*) FROM conversion_job j WHERE j.state IN ('running', 'cancelling')
             AND j.aside_lease IS DISTINCT FROM j.lease_token
             AND NOT EXISTS (SELECT 1 FROM job_range r WHERE r.job_id = j.id
                             AND r.job_generation = j.generation
                             AND r.state IN ('queued', 'running')))
        -- sent, not claimed: read in job_dispatched_queued's order, so that a plan made while
        -- the table had no statistics (a new deployment: the acceptance is prepared once per
        -- connection) still reads that index and not job_queued_since, every queued job
        + (SELECT count(*) FROM (
               SELECT j.dispatched_at FROM conversion_job j
               WHERE j.state = 'queued' AND j.dispatched_generation = j.generation
                 AND j.dispatched_at > now() - make_interval(secs => %(f_lost)s::float8)
               ORDER BY j.dispatched_at) sent)
        + (SELECT count(*) FROM job_range r
           JOIN conversion_job j ON j.id = r.job_id AND j.generation = r.job_generation
           WHERE j.state IN ('running', 'cancelling') AND r.state IN ('queued', 'running')
             AND (r.state = 'running'
                  OR (r.dispatched_at IS NOT NULL
                      AND r.dispatched_at > now() - make_interval(secs => %(f_lost)s::float8))))
        AS free
), idle AS (
    SELECT GREATEST(COALESCE(s.vtime, 0), seen.vclock) AS base, COALESCE(s.weight, 1) AS weight
    FROM credit, seen LEFT JOIN tenant_share s ON s.tenant = %(j_tenant)s
    WHERE credit.free AND s.running_cap IS NULL
      AND NOT EXISTS (SELECT 1 FROM conversion_outbox o WHERE o.published_at IS NULL)
), gate AS (
    UPDATE dispatch_clock k SET vclock = GREATEST(k.vclock, i.base)
    FROM seen, idle i
    WHERE k.id = 1 AND k.xmin = seen.x AND pg_try_advisory_xact_lock(7102421)
    RETURNING i.base, i.weight
), """

#: ``ADMIT``'s last part, after the job's insert (``job``): the tenant's virtual time advances
#: by the unit's cost when the gate let it through and the job was written.
ADMIT_SHARE = """, share AS (
    INSERT INTO tenant_share AS s (tenant, weight, vtime, updated_at)
    SELECT %(j_tenant)s, 1,
           g.base + GREATEST(%(j_dispatch_cost)s::integer, 1)::float8 / g.weight, now()
    FROM gate g, job
    ON CONFLICT (tenant) DO UPDATE SET vtime = GREATEST(s.vtime, EXCLUDED.vtime),
        updated_at = EXCLUDED.updated_at
)"""


def admit_params() -> dict[str, Any]:
    """``ADMIT``'s own parameters (the job's come with the job's)."""
    q = settings.QUIRE
    return {
        "f_capacity": q["FAIR_CAPACITY"],
        "f_lost": float(q["FAIR_LOST_S"]),
        "f_ttl": float(q["FAIR_SLOT_TTL_S"]),
    }


class Picked(NamedTuple):
    """One unit a pick chose and marked sent (``services/fair.py`` makes its ``Unit`` of it)."""

    outbox_id: int
    job_id: uuid.UUID
    generation: int
    traceparent: str
    tenant: str
    cost: int
    range_first: int | None = None
    range_generation: int | None = None


def pick(*, limit: int) -> list[Picked]:
    """``PICK`` (SQLite: :func:`_pick_orm`): choose and mark sent at most ``limit`` units, fewer
    when credits are short, in fair order. Commits before it returns when called outside a
    transaction."""
    q = settings.QUIRE
    if not db.postgres():
        return _pick_orm(limit=limit)
    with prepared_cursor() as cursor:
        cursor.execute(
            PICK,
            {
                "limit": limit,
                "capacity": q["FAIR_CAPACITY"],
                "lost": float(q["FAIR_LOST_S"]),
                "ttl": float(q["FAIR_SLOT_TTL_S"]),
            },
        )
        rows = cursor.fetchall()
    return [Picked(r[0], r[1], r[2], r[3] or "", r[4], r[5], r[6], r[7]) for r in rows]


def capacity() -> int:
    """Worker slots: ``QUIRE_FAIR_CAPACITY``, or those announced within the slot TTL."""
    fixed = settings.QUIRE["FAIR_CAPACITY"]
    if fixed > 0:
        return int(fixed)
    since = timezone.now() - timedelta(seconds=settings.QUIRE["FAIR_SLOT_TTL_S"])
    return sum(WorkerSlot.objects.filter(seen_at__gt=since).values_list("slots", flat=True))


def busy_by_tenant() -> dict[str, int]:
    """Slots in use per tenant: running or cancelling jobs (not a fanned-out job whose ranges
    are queued or running: they hold its slots), running ranges, plus jobs and ranges sent and
    not claimed yet (within ``QUIRE_FAIR_LOST_S``). Read from rows."""
    lost = timezone.now() - timedelta(seconds=settings.QUIRE["FAIR_LOST_S"])
    busy: dict[str, int] = defaultdict(int)
    live_ranges = JobRange.objects.filter(
        job_id=OuterRef("id"),
        job_generation=OuterRef("generation"),
        state__in=[RangeState.QUEUED, RangeState.RUNNING],
    )
    leased = (
        ConversionJob.objects.filter(state__in=LEASED_STATES)
        .exclude(Exists(live_ranges))
        .exclude(aside_lease=F("lease_token"))  # stepped aside: its slot is handed back
    )
    sent = ConversionJob.objects.filter(
        state=State.QUEUED,
        dispatched_at__gt=lost,
        dispatched_generation=F("generation"),
    )
    for query in (leased, sent):
        for tenant, n in (
            query.values_list("tenant").annotate(n=Count("id")).values_list("tenant", "n")
        ):
            busy[tenant] += n
    ranges = JobRange.objects.filter(
        job__state__in=LEASED_STATES, job__generation=F("job_generation")
    ).filter(Q(state=RangeState.RUNNING) | Q(state=RangeState.QUEUED, dispatched_at__gt=lost))
    for tenant, n in (
        ranges.values_list("job__tenant").annotate(n=Count("id")).values_list("job__tenant", "n")
    ):
        busy[tenant] += n
    return dict(busy)


# --- stepping aside (ADR 0022) -----------------------------------------------------------------

#: The code a starved attempt's yield records on it (``converters.ConversionStarved``).
STARVED = "conversion_starved"

#: An attempt in a long conversion hands its slot back: fenced on its lease, only while the
#: job runs, while fewer attempts are aside than spare pool processes announced themselves
#: (``worker_slot`` rows of 0 slots within the slot TTL: every unit the relay sends then finds
#: a process), while a unit waits (on an idle system there is nothing to hand the slot to),
#: and never again for a job an earlier attempt of which was starved aside (it yielded once:
#: now it keeps its slot and converts, so that it ends whatever the load). Run under the
#: pick's advisory lock, so that two attempts never take one spare.
STEP_ASIDE = """
UPDATE conversion_job j SET aside_lease = j.lease_token
WHERE j.id = %(job)s AND j.lease_token = %(lease)s AND j.state = 'running'
  AND (SELECT count(*) FROM conversion_job a
       WHERE a.state IN ('running', 'cancelling') AND a.aside_lease = a.lease_token)
    < (SELECT count(*) FROM worker_slot w
       WHERE w.slots = 0 AND w.seen_at > now() - make_interval(secs => %(ttl)s::float8))
  AND EXISTS (SELECT 1 FROM conversion_outbox o WHERE o.published_at IS NULL)
  AND NOT EXISTS (SELECT 1 FROM conversion_attempt a
                  WHERE a.job_id = j.id AND a.error_code = 'conversion_starved')
"""


def step_aside(*, job_id: uuid.UUID, lease: uuid.UUID) -> bool:
    """``STEP_ASIDE`` (SQLite: its ORM twin under the database's write lock): True when the
    attempt holding ``lease`` on ``job_id`` handed its slot back (or already had)."""
    ttl = float(settings.QUIRE["FAIR_SLOT_TTL_S"])
    with transaction.atomic():
        if ConversionJob.objects.filter(id=job_id, aside_lease=lease, lease_token=lease).exists():
            return True
        if db.postgres():
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_advisory_xact_lock(%s)", [PICK_LOCK])
                cursor.execute(STEP_ASIDE, {"job": job_id, "lease": lease, "ttl": ttl})
                return cursor.rowcount == 1
        since = timezone.now() - timedelta(seconds=ttl)
        aside = ConversionJob.objects.filter(
            state__in=LEASED_STATES, aside_lease=F("lease_token")
        ).count()
        spares = WorkerSlot.objects.filter(slots=0, seen_at__gt=since).count()
        starved = ConversionAttempt.objects.filter(job_id=job_id, error_code=STARVED).exists()
        if aside >= spares or starved or not anything_unsent():
            return False
        return (
            ConversionJob.objects.filter(id=job_id, lease_token=lease, state=State.RUNNING).update(
                aside_lease=lease
            )
            == 1
        )


def anything_unsent() -> bool:
    """An outbox row is not sent yet (one probe of the partial index ``outbox_waiting_tenant``,
    a row of SQLite's table): whether a pick could have anything to choose."""
    return ConversionOutbox.objects.filter(published_at__isnull=True).exists()


def others_unsent(*, tenant: str) -> bool:
    """Another tenant has an outbox row not sent yet: the cheap first question of a running
    unit past its slice, false while no other tenant waits (true does not yet mean a unit
    waits: ``waiting``). Two range reads of the partial index ``outbox_waiting_tenant``, the
    tenants below and above this one, each stopping at its first row: however long this
    tenant's own backlog, it is never read. SQLite (no trigger fills ``tenant``): the job's."""
    unsent = ConversionOutbox.objects.filter(published_at__isnull=True)
    if not db.postgres():
        return unsent.exclude(job__tenant=tenant).exists()
    return unsent.filter(tenant__lt=tenant).exists() or unsent.filter(tenant__gt=tenant).exists()


def waiting() -> QuerySet[ConversionOutbox]:
    """Dispatch units: unpublished outbox rows whose job is queued in their generation, and
    those of a range queued in their range generation while its job runs in theirs."""
    queued_range = JobRange.objects.filter(
        job_id=OuterRef("job_id"),
        first_page=OuterRef("range_first"),
        generation=OuterRef("range_generation"),
        job_generation=OuterRef("generation"),
        state=RangeState.QUEUED,
    )
    return ConversionOutbox.objects.filter(
        published_at__isnull=True, job__generation=F("generation")
    ).filter(
        Q(range_first__isnull=True, job__state=State.QUEUED)
        | Q(Exists(queued_range), range_first__isnull=False, job__state=State.RUNNING)
    )


def _pick_orm(*, limit: int) -> list[Picked]:
    """``quire_fair_pick``'s twin for the standalone profile, the same algorithm in Python: every
    transaction there is ``BEGIN IMMEDIATE``, so this one holds the database's write lock from
    its first read, as the Postgres function holds its advisory lock."""
    with transaction.atomic():
        busy = busy_by_tenant()
        credit = min(limit, capacity() - sum(busy.values()))
        if credit <= 0:
            return []
        rows: list[tuple[Any, ...]] = list(
            waiting()
            .order_by("id")
            .values_list(
                "id",
                "job_id",
                "generation",
                "traceparent",
                "job__tenant",
                "cost",
                "job__dispatch_cost",
                "range_first",
                "range_generation",
            )
        )
        shares = {s.tenant: s for s in TenantShare.objects.filter(tenant__in={r[4] for r in rows})}
        clock = DispatchClock.objects.get_or_create(id=1)[0].vclock
        per_tenant: dict[str, list[tuple[Any, ...]]] = defaultdict(list)
        for row in rows:
            per_tenant[row[4]].append(row)
        candidates = []
        for tenant, units in per_tenant.items():
            share = shares.get(tenant)
            weight = share.weight if share else 1
            base = max(share.vtime if share else 0.0, clock)
            room = credit
            if share is not None and share.running_cap is not None:
                room = min(room, share.running_cap - busy.get(tenant, 0))
            upto = 0
            for row in units[: max(0, room)]:
                cost = max(row[5] if row[5] is not None else row[6], 1)
                start = base + upto / weight
                upto += cost
                candidates.append((start, row[0], base + upto / weight, row, cost))
        candidates.sort(key=lambda c: (c[0], c[1]))
        chosen = candidates[:credit]
        if not chosen:
            return []
        now = timezone.now()
        ConversionOutbox.objects.filter(
            id__in=[c[1] for c in chosen], published_at__isnull=True
        ).update(published_at=now, publish_attempts=F("publish_attempts") + 1)
        for _start, _id, _finish, row, _cost in chosen:
            if row[7] is None:
                ConversionJob.objects.filter(id=row[1]).update(
                    dispatched_at=now, dispatched_generation=row[2]
                )
            else:
                JobRange.objects.filter(
                    job_id=row[1], first_page=row[7], generation=row[8], state=RangeState.QUEUED
                ).update(dispatched_at=now)
        finish: dict[str, float] = {}
        for _start, _id, fin, row, _cost in chosen:
            finish[row[4]] = max(finish.get(row[4], 0.0), fin)
        for tenant, fin in finish.items():
            TenantShare.objects.get_or_create(tenant=tenant)
            TenantShare.objects.filter(tenant=tenant, vtime__lt=fin).update(vtime=fin)
        DispatchClock.objects.filter(id=1, vclock__lt=chosen[-1][0]).update(vclock=chosen[-1][0])
        return [
            Picked(
                row[0],
                row[1],
                row[2],
                row[3] or "",
                row[4],
                cost,
                row[7],
                row[8],
            )
            for _s, _i, _f, row, cost in chosen
        ]


#: The broker confirmed these picked units: their row's ``published_at`` moves from the pick's
#: time (which ``conversion_job.dispatched_at`` also holds) to now. Its own transaction, which
#: does not wait for its WAL flush (a mark lost in a Postgres crash only makes the unit look
#: unconfirmed: sent once more, a duplicate the claim's CAS ignores).
CONFIRM = (
    "UPDATE conversion_outbox"
    " SET published_at = GREATEST(clock_timestamp(), published_at + interval '1 microsecond')"
    " WHERE id = ANY(%(ids)s::bigint[]) AND published_at IS NOT NULL"
    " AND set_config('synchronous_commit', 'off', true) IS NOT NULL"
)


def confirm(outbox_ids: list[int]) -> None:
    """``CONFIRM`` (SQLite: its ORM twin): the broker confirmed these picked units' messages."""
    id_batch(
        CONFIRM,
        outbox_ids,
        twin=lambda: ConversionOutbox.objects.filter(
            id__in=outbox_ids, published_at__isnull=False
        ).update(published_at=timezone.now()),
    )


#: Jobs sent by a pick (``dispatched_at`` set in their generation), not claimed, whose outbox
#: row still carries the pick's own time (never confirmed) past ``unconfirmed_after_s``: the
#: picker died or stalled between its pick and its publish. Their rows go back to waiting and
#: the jobs stop counting as busy, in one statement; the jobs' row locks first, skipping any a
#: claim holds. A confirm that commits meanwhile changes ``published_at``, so the row no longer
#: matches and nothing is returned for it.
RETURN_UNCONFIRMED = """
WITH lost AS (
    SELECT j.id, j.generation, j.dispatched_at FROM conversion_job j
    WHERE j.state = 'queued' AND j.dispatched_at IS NOT NULL
      AND j.dispatched_generation = j.generation
      AND j.dispatched_at < now() - make_interval(secs => %(after)s)
    ORDER BY j.dispatched_at
    LIMIT %(batch)s
    FOR UPDATE OF j SKIP LOCKED
), back AS (
    UPDATE conversion_outbox o SET published_at = NULL, last_error_code = 'unconfirmed'
    FROM lost l
    WHERE o.job_id = l.id AND o.generation = l.generation AND o.published_at = l.dispatched_at
      AND o.range_first IS NULL
    RETURNING o.job_id
)
UPDATE conversion_job j SET dispatched_at = NULL
FROM (SELECT DISTINCT b.job_id FROM back b) r WHERE j.id = r.job_id
RETURNING j.id
"""


def return_unconfirmed(*, after_s: float, batch: int) -> int:
    """``RETURN_UNCONFIRMED`` (SQLite: :func:`_return_unconfirmed_orm`): units picked and never
    confirmed past ``after_s`` back to waiting, at most ``batch``; the count returned."""
    if db.postgres():
        with connection.cursor() as cursor:  # one statement, its own transaction
            cursor.execute(RETURN_UNCONFIRMED, {"after": after_s, "batch": batch})
            return len(cursor.fetchall())
    return _return_unconfirmed_orm(after=after_s, batch=batch)


def _return_unconfirmed_orm(*, after: float, batch: int) -> int:
    cutoff = timezone.now() - timedelta(seconds=after)
    with transaction.atomic():  # BEGIN IMMEDIATE: the database's write lock from here
        rows = list(
            ConversionOutbox.objects.filter(
                range_first__isnull=True,
                job__state=State.QUEUED,
                job__generation=F("generation"),
                job__dispatched_generation=F("generation"),
                job__dispatched_at__lt=cutoff,
                published_at=F("job__dispatched_at"),
            ).values_list("id", "job_id")[:batch]
        )
        if not rows:
            return 0
        ConversionOutbox.objects.filter(id__in=[r[0] for r in rows]).update(
            published_at=None, last_error_code="unconfirmed"
        )
        return ConversionJob.objects.filter(id__in={r[1] for r in rows}).update(dispatched_at=None)
