"""The gated fast path (ADR 0021, "Idle latency: the gated fast path"): on an idle system the
web's background publisher sends a fresh commit's unit before its pick, as a gated message
(its outbox id in the ``quire_gate`` header), and picks while it travels. A worker's claim of a
gated message runs only if a pick marked the unit sent; a claim that finds no mark waits for
any pick in progress and otherwise records its refusal, which the pick that later chooses the
unit reports so its publisher sends it again. Real Postgres (the pick's advisory lock, real
threads) and, for the publisher, real RabbitMQ."""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings as django_settings
from django.db import connection, connections, transaction
from kombu import Connection

from conversion_jobs.models import ConversionJob, ConversionOutbox
from conversion_jobs.observability import metrics
from conversion_jobs.services import broker, fair, publisher, transitions
from conversion_jobs.states import State
from conversion_jobs.store.fair import GATE_REFUSED, PICK_LOCK
from tests import testdocs
from tests.integration.execution.jobkit import submit

pytestmark = [pytest.mark.fair_credits]


def _outbox_id(job: ConversionJob) -> int:
    return int(ConversionOutbox.objects.get(job=job, generation=1).id)


def _counter(counter: Any, **labels: str) -> float:
    return float(counter.labels(**labels)._value.get())


@pytest.mark.django_db
def test_gated_claim__runs_a_unit_a_pick_marked(capacity: Any, unit: Any) -> None:
    capacity(1)
    job = unit("a")
    assert [u.job_id for u in fair.pick(limit=10)] == [job.id]
    claim = transitions.claim(job_id=job.id, generation=1, worker="w", gate=_outbox_id(job))
    assert claim is not None
    assert ConversionJob.objects.get(id=job.id).state == State.RUNNING


@pytest.mark.django_db
def test_gated_claim__refuses_an_unpicked_unit_and_its_pick_says_so(
    capacity: Any, unit: Any
) -> None:
    """The fair order said "not yet" (or no pick has run): the gated message runs nothing, the
    unit keeps waiting with the refusal on its row, and the pick that chooses it reports it."""
    capacity(1)
    job = unit("a")
    refused_before = _counter(metrics.DUPLICATE_DELIVERIES, reason="unpicked")
    gate = _outbox_id(job)
    assert transitions.claim(job_id=job.id, generation=1, worker="w", gate=gate) is None
    job.refresh_from_db()
    assert (job.state, job.attempts, job.dispatched_at) == (State.QUEUED, 0, None)
    row = ConversionOutbox.objects.get(id=gate)
    assert (row.published_at, row.last_error_code) == (None, GATE_REFUSED)
    assert _counter(metrics.DUPLICATE_DELIVERIES, reason="unpicked") == refused_before + 1
    picked = fair.pick(limit=10)
    assert [(u.job_id, u.refused) for u in picked] == [(job.id, True)]
    # a plain message of the unit, as the publisher sends it again, runs
    assert transitions.claim(job_id=job.id, generation=1, worker="w") is not None


@pytest.mark.django_db
def test_gated_claim__of_another_generation_or_a_running_job_is_a_duplicate(
    capacity: Any, unit: Any
) -> None:
    capacity(2)
    job = unit("a")
    fair.pick(limit=10)
    assert transitions.claim(job_id=job.id, generation=1, worker="w") is not None
    gate = _outbox_id(job)
    assert transitions.claim(job_id=job.id, generation=1, worker="w2", gate=gate) is None
    assert transitions.claim(job_id=job.id, generation=2, worker="w2", gate=gate) is None
    assert ConversionOutbox.objects.get(id=gate).last_error_code is None


def _pick_holding_the_lock(started: threading.Event, hold_s: float, out: list[Any]) -> None:
    """A pick in progress, as slow as ``hold_s``: the pick's lock first, the pick at the end."""
    try:
        with transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_advisory_xact_lock(%s)", [PICK_LOCK])
            started.set()
            time.sleep(hold_s)
            out.extend(fair.pick(limit=10))
    finally:
        connections.close_all()


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_gated_claim__waits_for_a_pick_in_progress_and_runs(capacity: Any, unit: Any) -> None:
    """The claim outran the pick that will mark its unit: it waits for that pick's commit
    instead of refusing, then runs - the common race on an idle system."""
    if connection.vendor != "postgresql":
        pytest.fail("this test needs the production profile (the Postgres advisory lock)")
    capacity(1)
    job = unit("a")
    started, picked = threading.Event(), []
    picker = threading.Thread(target=_pick_holding_the_lock, args=(started, 0.6, picked))
    picker.start()
    assert started.wait(10)
    t0 = time.monotonic()
    claim = transitions.claim(job_id=job.id, generation=1, worker="w", gate=_outbox_id(job))
    waited = time.monotonic() - t0
    picker.join(10)
    assert [u.job_id for u in picked] == [job.id]
    assert claim is not None and waited >= 0.4
    assert ConversionOutbox.objects.get(job=job).last_error_code is None


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_gated_claim__a_refusal_and_a_pick_never_interleave(capacity: Any, unit: Any) -> None:
    """Many rounds of a gated claim racing the pick of its unit: every unit ends either claimed
    by its gated message or refused with the pick saying so - never sent with no message."""
    if connection.vendor != "postgresql":
        pytest.fail("this test needs the production profile (the Postgres advisory lock)")
    capacity(1000)
    outcomes = {"claimed": 0, "refused": 0}
    for _ in range(30):
        job = unit("a")
        gate = _outbox_id(job)
        barrier = threading.Barrier(2)
        picked: list[fair.Unit] = []

        def pick(barrier: threading.Barrier = barrier, picked: list[fair.Unit] = picked) -> None:
            try:
                barrier.wait(10)
                picked.extend(fair.pick(limit=10))
            finally:
                connections.close_all()

        thread = threading.Thread(target=pick)
        thread.start()
        barrier.wait(10)
        claim = transitions.claim(job_id=job.id, generation=1, worker="w", gate=gate)
        thread.join(10)
        mine = [u for u in picked if u.job_id == job.id]
        if claim is not None:
            outcomes["claimed"] += 1
            assert mine and not mine[0].refused  # chosen, and its gated message ran
        else:
            outcomes["refused"] += 1
            # refused before the pick: the pick chose it and says so (its publisher resends)
            assert [u.refused for u in mine] == [True]
    assert sum(outcomes.values()) == 30


# --- the web's background publisher, on RabbitMQ -------------------------------------------------


@pytest.fixture
def background(settings: Any) -> Iterator[publisher.BackgroundPublisher]:
    if not django_settings.AMQP_BROKER or connection.vendor != "postgresql":
        pytest.fail("this test needs the production profile (Postgres and RabbitMQ)")
    settings.QUIRE = {**settings.QUIRE, "FAST_PUBLISH": "background", "PUBLISH_BATCH": 8}
    enabled = publisher.enable()
    assert enabled is not None
    yield enabled
    enabled.stop(10)
    publisher.disable()


def _accept(tmp_path: Path, tenant: str = "tenant-gate") -> ConversionJob:
    src = tmp_path / f"{uuid.uuid4().hex}.pdf"
    salt = uuid.uuid4().hex
    testdocs.make_pdf(src, pages=1, text_of=lambda n: f"Page {n} {salt}")
    return submit(src, output="text", tenant=tenant)


def _gates_on_the_queue(job_ids: set[str]) -> dict[str, Any]:
    """Take the conversion messages of ``job_ids`` off the queue: job id -> its gate header."""
    found: dict[str, Any] = {}
    # the workers' user: the test process's own (the web's) may only publish
    url = os.environ.get("QUIRE_RMQ_WORKER_URL") or django_settings.CELERY_BROKER_URL
    with Connection(url) as conn:
        channel = conn.channel()  # basic_get declares nothing: the worker may not
        deadline = time.monotonic() + 10
        while set(found) != job_ids and time.monotonic() < deadline:
            message = channel.basic_get(queue=django_settings.CONVERSION_QUEUE, no_ack=False)
            if message is None:
                time.sleep(0.05)
                continue
            job = str(json.loads(message.body)[0][0])
            if job in job_ids:
                found[job] = message.headers.get(broker.GATE_HEADER)
            channel.basic_ack(message.delivery_tag)
    return found


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_background_publisher__idle__sends_gated_messages_before_the_pick(
    background: publisher.BackgroundPublisher, capacity: Any, tmp_path: Path
) -> None:
    capacity(1000)
    sent_before = _counter(metrics.FAIR_GATED, outcome="sent")
    first = _accept(
        tmp_path
    )  # the gate opens once a pick chose exactly the rows handed to it (nothing else was waiting)
    assert background.flush(30)
    second = _accept(tmp_path)
    assert background.flush(30)
    assert _counter(metrics.FAIR_GATED, outcome="sent") == sent_before + 1
    for job in (first, second):
        job.refresh_from_db()
        row = ConversionOutbox.objects.get(job=job)
        # picked (the job's sent mark) and confirmed (the row's time moved past the pick's)
        assert job.dispatched_generation == 1 and row.published_at > job.dispatched_at
    gates = _gates_on_the_queue({str(first.id), str(second.id)})
    assert gates == {str(first.id): None, str(second.id): _outbox_id(second)}


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_background_publisher__busy__sends_no_gated_messages(
    background: publisher.BackgroundPublisher, capacity: Any, make_job: Any, tmp_path: Path
) -> None:
    """No free credit: the pick chooses nothing, so the gate closes and the next commit's unit
    waits its turn, with no message sent for it."""
    capacity(1000)
    _accept(tmp_path)
    assert background.flush(30)  # the gate is open
    capacity(1)
    make_job(state=State.RUNNING, tenant="tenant-busy")
    not_sent_before = _counter(metrics.FAIR_GATED, outcome="not_sent")
    waiting = _accept(tmp_path)  # sent gated (the gate was open), not chosen: refused later
    assert background.flush(30)
    after = _accept(tmp_path)  # the gate closed: no message at all
    assert background.flush(30)
    assert _counter(metrics.FAIR_GATED, outcome="not_sent") == not_sent_before + 1
    for job in (waiting, after):
        assert ConversionOutbox.objects.get(job=job).published_at is None
    gates = _gates_on_the_queue({str(waiting.id)})
    assert gates == {str(waiting.id): _outbox_id(waiting)}
    # its gated message, claimed now, runs nothing and leaves the refusal for the pick
    assert (
        transitions.claim(job_id=waiting.id, generation=1, worker="w", gate=gates[str(waiting.id)])
        is None
    )
    assert ConversionOutbox.objects.get(job=waiting).last_error_code == GATE_REFUSED


def _hold_row(job_id: uuid.UUID, started: threading.Event, hold_s: float, out: list[float]) -> None:
    try:
        with transaction.atomic():
            ConversionJob.objects.select_for_update().get(id=job_id)
            started.set()
            time.sleep(hold_s)
            out.append(time.time())
    finally:
        connections.close_all()


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_gated_claim__a_held_row_is_waited_for_after_and_the_attempt_starts_after_the_wait(
    capacity: Any, unit: Any
) -> None:
    """The first look of a gated claim skips a row another transaction holds (a pick marking
    it) rather than wait inside the claim statement; the second look waits for the holder. The
    attempt's start is taken after that wait, so commit -> claim counts it."""
    if connection.vendor != "postgresql":
        pytest.fail("this test needs the production profile (row locks)")
    capacity(1)
    job = unit("a")
    fair.pick(limit=10)
    started, released = threading.Event(), []
    holder = threading.Thread(target=_hold_row, args=(job.id, started, 0.5, released))
    holder.start()
    assert started.wait(10)
    claim = transitions.claim(job_id=job.id, generation=1, worker="w", gate=_outbox_id(job))
    holder.join(10)
    assert claim is not None
    assert claim.lease.started_at is not None
    assert claim.lease.started_at.timestamp() >= released[0] - 0.05
