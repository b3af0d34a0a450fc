"""e2e: cancellation with real worker / sweeper / beat processes, real RabbitMQ and real
LibreOffice (issue 5 acceptance). The in-process suite (tests/integration/cancellation/) covers
every state and the 200-run race; here each scenario crosses real process boundaries: a message
sitting in the broker, a converter process group with ``soffice`` in it, a retry timer owned by
beat + sweeper, an operator retry served by another attempt of a real worker."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import time
import uuid
from pathlib import Path

import pytest
from django.conf import settings
from django.utils import timezone

from conversion_jobs import storage
from conversion_jobs.converters import process_group_members
from conversion_jobs.models import (
    CancellationRequest,
    ConversionAttempt,
    ConversionJob,
    ConversionOutbox,
    PageCheckpoint,
)
from tests.conftest import token
from tests.e2e import harness

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

HEARTBEAT_S = float(harness.TEST_TIMINGS["QUIRE_HEARTBEAT_S"])
SWEEP_S = float(harness.TEST_TIMINGS["QUIRE_SWEEP_INTERVAL_S"])
#: request -> cancelled: the worker learns it at its next heartbeat (or page boundary), kills the
#: converter group (the child polls every 100 ms) and commits; the slack is for a busy 2-core host.
CANCEL_BOUND_S = HEARTBEAT_S + 2.5


@pytest.fixture
def start(start):
    """The conftest's ``start`` with a unique worker hostname (``PORT``): other engineers' e2e
    runs on this host use the same vhost, and celery's pidbox queue is exclusive per hostname."""

    def run(kind: str, **env: str) -> harness.Proc:
        env.setdefault("PORT", f"cx{uuid.uuid4().hex[:8]}")
        return start(kind, **env)

    return run


def claimed(job_id, generation: int = 1, *, timeout: float = 40) -> ConversionAttempt:
    """Wait until a worker of this test claimed ``generation``. The ``quire`` vhost is shared
    with other engineers' e2e runs whose workers (on other databases) may take our message and
    ack it as a duplicate, and whose harness purges the queue: while unclaimed, publish another
    copy of the same message every 2 s (duplicates are harmless by design: the claim CAS)."""
    deadline = time.monotonic() + timeout
    while True:
        attempt = ConversionAttempt.objects.filter(job_id=job_id, generation=generation).first()
        if attempt is not None:
            return attempt
        if time.monotonic() > deadline:
            raise AssertionError(f"generation {generation} of {job_id} never claimed")
        for _ in range(20):
            time.sleep(0.1)
            if ConversionAttempt.objects.filter(job_id=job_id, generation=generation).exists():
                break
        else:
            harness.publish_task(job_id=job_id, generation=generation)


def client(*, scopes: tuple[str, ...] = ("jobs:read", "jobs:cancel")):
    from rest_framework.test import APIClient

    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {token(scopes=scopes)}")
    return api


def cancel(job_id):
    return client().post(f"/api/v1/jobs/{job_id}/cancel")


def job_of(job_id) -> ConversionJob:
    return ConversionJob.objects.get(id=job_id)


def pages_done(job_id) -> int:
    return PageCheckpoint.objects.filter(job_id=job_id, state="done").count()


def requests_of(job_id) -> list[tuple[str, str, bool]]:
    return [
        (r.state_seen, r.outcome, r.resolved_at is not None)
        for r in CancellationRequest.objects.filter(job_id=job_id).order_by("id")
    ]


def latency_s(job_id) -> float:
    request = CancellationRequest.objects.filter(job_id=job_id).order_by("id").first()
    assert request is not None and request.resolved_at is not None
    return (request.resolved_at - request.requested_at).total_seconds()


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def pgid_of(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def converter_children(worker: harness.Proc) -> list[int]:
    return [p for p in worker.tree() if harness.is_converter_child(p)]


def working_children(worker: harness.Proc) -> list[int]:
    """Converter children that have been set up for an attempt (their cwd is their private
    directory); the other worker process's spare child (cwd /) is not one of them."""
    found = []
    for pid in converter_children(worker):
        with contextlib.suppress(OSError):
            if ".isolated-" in os.readlink(f"/proc/{pid}/cwd"):
                found.append(pid)
    return found


def work_dirs_gone(job_id) -> None:
    """The job's attempt directories are removed by the worker's tidying thread just after the
    attempt ends (services/tidying.py): at once, though not before the state is visible."""
    harness.wait_until(lambda: work_dirs(job_id) == [], timeout=5, what="the work dirs removed")


def work_dirs(job_id) -> list[str]:
    """The job's attempt directories (``<WORK_DIR>/<job>.<attempt>-<token>``), named
    ``<attempt>-<token>``."""
    prefix = f"{job_id}."
    try:
        names = os.listdir(Path(settings.QUIRE["WORK_DIR"]))
    except FileNotFoundError:
        return []
    return sorted(name.removeprefix(prefix) for name in names if name.startswith(prefix))


def submit_docx(tmp_path: Path, *, paragraphs: int, output: str = "pdf") -> ConversionJob:
    """Like the ``submit`` fixture, for a DOCX made with python-docx."""
    from conversion_jobs.services.acceptance import StagedUpload, conversion_job_accept
    from tests import testdocs

    salt = uuid.uuid4().hex
    src = testdocs.make_docx(
        tmp_path / f"{salt}.docx",
        paragraphs=[
            f"Paragraph {i} {salt} " + "lorem ipsum dolor sit amet " * 8 for i in range(paragraphs)
        ],
    )
    fh, staged = storage.stage()
    with fh, open(src, "rb") as data:
        shutil.copyfileobj(data, fh)
    raw = src.read_bytes()
    accepted = conversion_job_accept(
        tenant="tenant-a",
        actor="e2e",
        upload=StagedUpload(path=staged, sha256=hashlib.sha256(raw).hexdigest(), size=len(raw)),
        output=output,
        raw_options={},
        idempotency_key=None,
    )
    assert accepted.created
    return accepted.job


def test_cancel__message_still_in_rabbitmq_is_stale_when_a_worker_arrives(start, submit, cluster):
    job = submit(pages=2)
    # No worker yet: the generation-1 message sits in conversion.v1 (published by on_commit).
    harness.wait_until(
        lambda: ConversionOutbox.objects.filter(job_id=job.id, published_at__isnull=False).exists(),
        timeout=10,
        what="the outbox row to be published",
    )

    response = cancel(job.id)

    assert (response.status_code, response.json()["state"]) == (200, "cancelled")
    assert requests_of(job.id) == [("queued", "cancelled", True)]
    before = job_of(job.id)

    worker = start("worker")

    def stale_acked() -> bool:
        return "'duplicate'" in worker.log.read_text(errors="replace")

    try:
        harness.wait_until(stale_acked, timeout=5, what="the stale delivery acked")
    except AssertionError:
        # Another engineer's worker on the shared vhost took (or purged) the message: deliver
        # another copy of the very same stale generation-1 message.
        harness.publish_task(job_id=job.id, generation=1, copies=3)
        harness.wait_until(stale_acked, timeout=15, what="the stale delivery acked")
    time.sleep(1)  # anything else the worker would do with it, it does now
    after = job_of(job.id)
    assert (after.state, after.generation, after.attempts, after.state_version) == (
        "cancelled",
        1,
        0,
        before.state_version,
    )
    assert after.result_key is None
    assert not ConversionAttempt.objects.filter(job_id=job.id).exists()
    assert ConversionOutbox.objects.filter(job_id=job.id).count() == 1


def test_cancel__during_libreoffice_conversion_kills_the_soffice_group(start, cluster, tmp_path):
    worker = start("worker")
    job = submit_docx(tmp_path, paragraphs=3000)
    claimed(job.id)

    def soffice_groups() -> dict[int, int]:
        """Live soffice.bin processes and their groups. A pid whose group cannot be read any
        more is gone and is not counted: on a fresh profile LibreOffice runs soffice.bin twice
        (the first run writes the profile and exits, measured 1.3 s; oosplash then starts the
        second), so a pid seen in the process list can end before its group is read. (Reading
        them one after the other once gave ``set()`` in CI: issue 22.)"""
        # soffice.bin itself: the /usr/bin/soffice wrapper script execs oosplash (whose command
        # line does not say "soffice") before soffice.bin starts.
        found = {}
        for pid in worker.tree():
            if "soffice.bin" in cmdline(pid) and (group := pgid_of(pid)) is not None:
                found[pid] = group
        return found

    soffice = harness.wait_until(soffice_groups, timeout=30, interval=0.05, what="soffice running")
    groups = set(soffice.values())
    # soffice runs inside the converter child's own process group (led by the child), not the
    # worker's.
    assert len(groups) == 1 and groups <= set(converter_children(worker)), groups
    assert pgid_of(worker.pid) not in groups
    time.sleep(0.3)
    # soffice.bin can be briefly absent here without the conversion having ended (the restart
    # above). The job still running is what matters.
    soffice = harness.wait_until(
        soffice_groups, timeout=15, interval=0.05, what="soffice running (after its restart)"
    )
    assert job_of(job.id).state == "running", "LibreOffice finished first: lengthen the document"
    groups = set(soffice.values())
    assert len(groups) == 1 and groups <= set(converter_children(worker)), groups

    requested = time.monotonic()
    response = cancel(job.id)

    assert (response.status_code, response.json()["state"]) == (202, "cancelling")
    harness.wait_until(
        lambda: not any(process_group_members(g) for g in groups),
        timeout=CANCEL_BOUND_S,
        interval=0.05,
        what="the soffice process group to be gone (zombies awaiting init count as gone)",
    )
    gone_in = time.monotonic() - requested
    harness.wait_until(
        lambda: job_of(job.id).state == "cancelled", timeout=CANCEL_BOUND_S, what="cancelled"
    )
    assert not any(Path(f"/proc/{p}").exists() and cmdline(p) for p in soffice)
    done = job_of(job.id)
    assert done.result_key is None
    assert ConversionAttempt.objects.get(job_id=job.id).outcome == "cancelled"
    assert requests_of(job.id) == [("running", "cancelled", True)]
    assert latency_s(job.id) <= CANCEL_BOUND_S
    work_dirs_gone(job.id)
    assert not [p for p in worker.tree() if "soffice" in cmdline(p)]
    print(f"soffice group gone {gone_in:.2f}s after the request; latency {latency_s(job.id):.2f}s")


def test_cancel__between_pages_stops_within_the_heartbeat_bound(start, submit, cluster):
    worker = start("worker")
    job = submit(pages=8, options={"_test_fault": {"kind": "slow", "seconds": 0.6}})
    claimed(job.id)
    harness.wait_until(lambda: pages_done(job.id) >= 2, timeout=30, what="two pages done")
    children = working_children(worker)
    assert children

    response = cancel(job.id)

    assert (response.status_code, response.json()["state"]) == (202, "cancelling")
    harness.wait_until(
        lambda: job_of(job.id).state == "cancelled", timeout=CANCEL_BOUND_S, what="cancelled"
    )
    assert latency_s(job.id) <= CANCEL_BOUND_S
    done = job_of(job.id)
    assert (done.result_key, done.generation) == (None, 1)
    assert pages_done(job.id) < 8
    attempt = ConversionAttempt.objects.get(job_id=job.id)
    assert attempt.outcome == "cancelled"
    # The attempt's converter child is gone (release() may have started a fresh spare).
    harness.wait_until(
        lambda: not set(children) & set(converter_children(worker)), timeout=3, what="child gone"
    )
    work_dirs_gone(job.id)
    # Repeated cancel: same answer, no state change.
    again = cancel(job.id)
    assert (again.status_code, again.json()["state"]) == (200, "cancelled")
    assert job_of(job.id).state_version == done.state_version
    # The worker is healthy: it serves the next job.
    nxt = submit(pages=2)
    claimed(nxt.id)
    harness.wait_until(lambda: job_of(nxt.id).state == "succeeded", timeout=20, what="next job")


def test_cancel__at_finalization_ends_in_one_consistent_state(start, submit, cluster):
    """The cancel lands right after the last checkpoint, while the worker assembles and publishes
    the result. Either the cancel wins (cancelled, no result, the assembled result deleted) or the
    publish wins (succeeded, the cancel answered 409 too_late): never both, never neither. Which
    one wins is timing; the in-process race test (200 runs) forces both sides deterministically."""
    start("worker")
    pages = 12
    job = submit(
        pages=pages,
        output="png",
        options={"dpi": 150, "_test_fault": {"kind": "slow", "seconds": 1.0, "page": pages}},
    )
    claimed(job.id)
    harness.wait_until(
        lambda: pages_done(job.id) == pages, timeout=40, interval=0.01, what="last checkpoint"
    )

    response = cancel(job.id)

    harness.wait_until(
        lambda: job_of(job.id).state in ("cancelled", "succeeded"), timeout=10, what="terminal"
    )
    done = job_of(job.id)
    results = list(storage.list_objects(f"results/{job.id}"))
    if response.status_code == 202:
        assert done.state == "cancelled" and done.result_key is None
        assert requests_of(job.id) == [("running", "cancelled", True)]
        assert ConversionAttempt.objects.get(job_id=job.id).outcome == "cancelled"
        assert results == []
    else:
        assert (response.status_code, response.json()["code"]) == (409, "too_late")
        assert done.state == "succeeded" and done.result_key is not None
        # a PNG result is the ZIP of its page objects, no object of its own (ADR 0018)
        assert done.result_key == f"zip:results/{job.id}/result.g1.zip" and results == []
        assert requests_of(job.id) == [("succeeded", "too_late", True)]
    print(f"finalization race: cancel answered {response.status_code}, job {done.state}")


def test_cancel__retry_wait_timer_never_dispatches(start, submit, cluster):
    # A 3 s backoff in the worker leaves time to cancel while the job waits; beat and the sweeper
    # run throughout and keep sweeping past the (cancelled) timer.
    start("worker", QUIRE_BACKOFF_BASE_S="3")
    start("sweeper")
    beat = start("beat")
    job = submit(pages=2, options={"_test_fault": {"kind": "segv", "until_attempt": 1}})
    claimed(job.id)
    harness.wait_until(
        lambda: job_of(job.id).state == "retry_wait", timeout=30, interval=0.05, what="retry_wait"
    )
    due = job_of(job.id).next_attempt_at
    assert due is not None and due > timezone.now()

    response = cancel(job.id)

    assert (response.status_code, response.json()["state"]) == (200, "cancelled")
    cancelled = job_of(job.id)
    outbox = ConversionOutbox.objects.filter(job_id=job.id).count()
    # Wait past the timer plus several sweeps of "requeue due retries", observed in beat's log.
    wait_s = max(0.0, (due - timezone.now()).total_seconds()) + 4 * SWEEP_S + 1
    sent_before = beat.log.read_text(errors="replace").count("requeue_due_retries")
    time.sleep(wait_s)
    sent_after = beat.log.read_text(errors="replace").count("requeue_due_retries")
    assert sent_after - sent_before >= 3, "beat did not keep sending the retry sweep"
    after = job_of(job.id)
    assert (after.state, after.generation, after.attempts, after.state_version) == (
        "cancelled",
        cancelled.generation,
        cancelled.attempts,
        cancelled.state_version,
    )
    assert after.next_attempt_at is None
    assert ConversionOutbox.objects.filter(job_id=job.id).count() == outbox
    assert ConversionAttempt.objects.filter(job_id=job.id).count() == 1
    assert requests_of(job.id) == [("retry_wait", "cancelled", True)]


def test_cancel__operator_retry_after_cancel_starts_clean(start, submit, cluster):
    start("worker")
    start("sweeper")
    start("beat")
    job = submit(pages=5, options={"_test_fault": {"kind": "slow", "seconds": 0.5}})
    claimed(job.id)
    harness.wait_until(lambda: pages_done(job.id) >= 1, timeout=30, what="first page")
    first = ConversionAttempt.objects.get(job_id=job.id)
    first_dirs = work_dirs(job.id)
    assert [d for d in first_dirs if d.startswith(f"{first.id}-")], first_dirs
    assert cancel(job.id).status_code == 202
    harness.wait_until(lambda: job_of(job.id).state == "cancelled", timeout=10, what="cancelled")
    work_dirs_gone(job.id)
    done_before = set(
        PageCheckpoint.objects.filter(job_id=job.id, state="done").values_list(
            "page_number", flat=True
        )
    )

    response = client(scopes=("jobs:read", "jobs:admin")).post(f"/api/v1/jobs/{job.id}/retry")

    assert response.status_code == 202, response.content
    assert (response.json()["state"], response.json()["generation"]) == ("queued", 2)
    claimed(job.id, 2)
    seen: set[str] = set()

    def finished() -> bool:
        seen.update(work_dirs(job.id))
        return job_of(job.id).state == "succeeded"

    harness.wait_until(finished, timeout=40, interval=0.05, what="retry succeeded")
    second = ConversionAttempt.objects.get(job_id=job.id, generation=2)
    assert second.outcome == "succeeded"
    # Only the new attempt's directory ever existed during generation 2.
    assert seen and all(d.startswith(f"{second.id}-") for d in seen), (seen, first.id)
    # The worker removes its directory after the publish commits (the job reads succeeded
    # first): gone within moments, and no other directory ever appeared.
    harness.wait_until(
        lambda: not seen.update(work_dirs(job.id)) and work_dirs(job.id) == [],
        timeout=10,
        interval=0.05,
        what="attempt directory removed",
    )
    assert all(d.startswith(f"{second.id}-") for d in seen), (seen, first.id)
    gens = dict(
        PageCheckpoint.objects.filter(job_id=job.id).values_list("page_number", "generation")
    )
    assert {p for p, g in gens.items() if g == 1} == done_before
    assert {p for p, g in gens.items() if g == 2} == set(range(1, 6)) - done_before
    assert second.pages_converted == 5 - len(done_before)
    assert not CancellationRequest.objects.filter(job_id=job.id, resolved_at__isnull=True).exists()
    assert job_of(job.id).result_key is not None
