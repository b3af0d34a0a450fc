"""e2e: a poison document quarantined by real workers on two hosts (issue 24 point 3).

Two worker processes name two hosts (``QUIRE_WORKER_HOST`` node-a / node-b) and each has run a
normal job, so the newest attempts show two hosts. A PDF whose converter child kills itself
with SIGSEGV on every attempt then crashes twice on node-b alone: not quarantined (two hosts
exist, the crashes came from one). Once node-b is stopped and node-a runs it, its third crash
quarantines it: the job fails ``document_quarantined`` before ``max_attempts``; a resubmission
by the same tenant is refused with no new attempt, another tenant's is accepted.
"""

from __future__ import annotations

import pytest

from conversion_jobs.exceptions import DocumentQuarantined
from conversion_jobs.models import ConversionAttempt, ConversionJob, DocumentCrash
from tests.e2e import harness

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

SEGV = {"_test_fault": {"kind": "segv"}}
#: two crashes quarantine; a backoff long enough to stop node-b between two attempts
QUARANTINE = {"QUIRE_QUARANTINE_AFTER_CRASHES": "2", "QUIRE_BACKOFF_BASE_S": "4"}


def _finished(job_id) -> bool:
    return ConversionJob.objects.filter(id=job_id, finished_at__isnull=False).exists()


def test_quarantine__crashes_on_one_of_two_hosts_wait_for_the_second(start, submit, settings):
    settings.QUIRE = {**settings.QUIRE, "QUARANTINE_AFTER_CRASHES": 2, "MAX_ATTEMPTS": 8}
    start("sweeper")
    start("beat")
    node_a = start("worker", QUIRE_WORKER_HOST="node-a", **QUARANTINE)
    warm_a = submit(pages=1)
    harness.wait_until(lambda: _finished(warm_a.id), timeout=60, what="node-a's normal job")
    node_a.stop()
    node_b = start("worker", QUIRE_WORKER_HOST="node-b", **QUARANTINE)
    warm_b = submit(pages=1)
    harness.wait_until(lambda: _finished(warm_b.id), timeout=60, what="node-b's normal job")
    hosts = {w.split(":")[0] for w in ConversionAttempt.objects.values_list("worker", flat=True)}
    assert hosts == {"node-a", "node-b"}

    job = submit(pages=1, options=SEGV)
    harness.wait_until(
        lambda: DocumentCrash.objects.filter(job_id=job.id).count() >= 2,
        timeout=90,
        what="two crashes on node-b",
    )
    node_b.kill9()  # idle: the job waits for its retry timer
    row = ConversionJob.objects.get(id=job.id)
    assert row.state in ("retry_wait", "queued", "running"), row.state
    assert set(DocumentCrash.objects.filter(job_id=job.id).values_list("host", flat=True)) == {
        "node-b"
    }

    start("worker", QUIRE_WORKER_HOST="node-a", **QUARANTINE)
    harness.wait_until(lambda: _finished(job.id), timeout=90, what="the poison job's end")
    row = ConversionJob.objects.get(id=job.id)
    assert (row.state, row.error_code) == ("failed", "document_quarantined")
    assert (row.attempts, row.max_attempts) == (3, 8)
    crash_hosts = list(DocumentCrash.objects.filter(job_id=job.id).values_list("host", flat=True))
    assert sorted(set(crash_hosts)) == ["node-a", "node-b"] and len(crash_hosts) == row.attempts

    attempts = ConversionAttempt.objects.count()
    with pytest.raises(DocumentQuarantined):
        submit_same(submit, row, tenant="tenant-a")
    assert ConversionAttempt.objects.count() == attempts
    other = submit_same(submit, row, tenant="tenant-b")
    assert other.tenant == "tenant-b"


def submit_same(submit, job, *, tenant: str):
    """Submit the stored source of ``job`` again (same bytes) as ``tenant``."""
    import shutil
    import tempfile
    from pathlib import Path

    from conversion_jobs import storage
    from conversion_jobs.models import InlineSource

    with tempfile.TemporaryDirectory() as scratch:
        copy = Path(scratch) / "source"
        if storage.is_inline_source(job.source_key):
            copy.write_bytes(bytes(InlineSource.objects.get(job_id=job.id).content))
        else:
            with storage.open_object(job.source_key) as data, open(copy, "wb") as fh:
                shutil.copyfileobj(data, fh)
        return harness.accept_path(copy, tenant=tenant).job
