"""The planner goes on with the first range in the slot it holds (ADR 0023 "Planning"): the
range is planned already claimed by it (no outbox row, no message, no wait for the relay), and
if the planner dies before converting it, the range's lease expires and the range sweep
requeues it like any other range's."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from conversion_jobs.models import ConversionJob, ConversionOutbox, JobRange
from conversion_jobs.services import runner
from conversion_jobs.services.fanout import job_ranges_recover_if_lease_expired
from conversion_jobs.services.range_runner import conversion_execute
from tests import testdocs
from tests.integration.execution.jobkit import downloaded_result, submit, unique_text
from tests.integration.fanout.rangekit import ranges_of, run_ranges

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("fanout_quire", "no_broker_publish"),
]


def test_planner__converts_the_first_range_itself_without_a_message(tmp_path, api):
    text_of = unique_text("kept")
    source = testdocs.make_pdf(tmp_path / "k.pdf", pages=12, text_of=text_of)
    job = submit(source, tenant="tenant-fan", output="text")
    # the job's message: the planner's attempt, then (same call, same slot) the first range
    assert conversion_execute(job_id=job.id, generation=job.generation) == "range_done"
    ranges = ranges_of(job.id)
    assert [(r.first_page, r.state, r.attempts) for r in ranges] == [
        (1, "done", 1),
        (4, "queued", 0),
        (7, "queued", 0),
        (10, "queued", 0),
    ]
    assert ranges[0].worker == runner.worker_identity()
    assert ranges[0].claimed_at is not None
    # no outbox row (no message) for the range the planner kept
    rows = ConversionOutbox.objects.filter(job_id=job.id, range_first__isnull=False)
    assert sorted(rows.values_list("range_first", flat=True)) == [4, 7, 10]
    assert run_ranges(job) == ["range_done", "range_done", "succeeded"]
    job = ConversionJob.objects.get(id=job.id)
    assert (job.state, job.pages_done) == ("succeeded", 12)
    text = downloaded_result(lambda: api(tenant="tenant-fan"), job)
    assert text.split(b"\f") == [text_of(n).encode() for n in range(1, 13)]


def test_planner__dies_before_its_range__the_range_sweep_requeues_it(tmp_path):
    source = testdocs.make_pdf(tmp_path / "d.pdf", pages=12, text_of=unique_text("dies"))
    job = submit(source, tenant="tenant-fan", output="text")
    # the planner plans, keeps the first range, and is gone before it converts a page of it
    outcome = runner.conversion_job_execute(
        job_id=job.id, generation=job.generation, then=lambda claim: "killed"
    )
    assert outcome == "killed"
    kept = JobRange.objects.get(job_id=job.id, first_page=1)
    assert (kept.state, kept.generation, kept.attempts) == ("running", 1, 1)
    JobRange.objects.filter(id=kept.id).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert job_ranges_recover_if_lease_expired() >= 1
    kept.refresh_from_db()
    assert (kept.state, kept.generation) == ("queued", 2)
    # one outbox row for the requeued range (none was written for it by the plan)
    again = ConversionOutbox.objects.get(job_id=job.id, range_first=1)
    assert again.range_generation == 2
    assert run_ranges(job)[-1] == "succeeded"
    assert ConversionJob.objects.get(id=job.id).pages_done == 12
