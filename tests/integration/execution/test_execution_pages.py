"""Issue 4: page checkpoints, partial results, resume after a stolen lease, hostile input and
the idempotent finalizer, driven through ``conversion_job_execute`` in-process."""

from __future__ import annotations

import pytest

from conversion_jobs.models import (
    ConversionAttempt,
    ConversionJob,
    ExecutionAuditEvent,
    PageCheckpoint,
)
from conversion_jobs.services import runner
from tests import testdocs
from tests.integration.execution.jobkit import (
    execute,
    object_bytes,
    object_sha256,
    result_files,
    run_until_pages_then_lose_lease,
    stored_result,
    submit,
    unique_text,
    work_dir_entries,
)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("fast_quire")]

FAIL_PAGE_7 = {"kind": "fail", "page": 7}


def _checkpoints(job: ConversionJob) -> dict[int, PageCheckpoint]:
    return {p.page_number: p for p in PageCheckpoint.objects.filter(job=job)}


def test_execute__failing_page_ends_partial_with_the_good_pages(tmp_path, api, no_broker_publish):
    text_of = unique_text()
    source = testdocs.make_pdf(tmp_path / "fifty.pdf", pages=50, text_of=text_of)
    job = submit(source, output="text", fault=FAIL_PAGE_7)

    assert execute(job) == "partial"

    job.refresh_from_db()
    assert (job.state, job.pages_done, job.pages_failed) == ("partial", 49, 1)
    pages = _checkpoints(job)
    assert sorted(pages) == list(range(1, 51))
    assert (pages[7].state, pages[7].error_code, pages[7].artifact_key) == (
        "failed",
        "invalid_input",
        None,
    )
    assert all(pages[n].state == "done" for n in pages if n != 7)
    client = api()
    body = b"".join(client.get(f"/api/v1/jobs/{job.id}/result").streaming_content).decode()
    assert body.split("\f") == [text_of(n) for n in range(1, 51) if n != 7]
    listing = client.get(f"/api/v1/jobs/{job.id}/pages").json()["pages"]
    assert listing[6] == {**listing[6], "page": 7, "state": "failed", "error_code": "invalid_input"}
    assert client.get(f"/api/v1/jobs/{job.id}/pages/7").status_code == 404
    assert client.get(f"/api/v1/jobs/{job.id}/pages/8").status_code == 200
    events = list(
        ExecutionAuditEvent.objects.filter(job_id=job.id).values_list("event_type", flat=True)
    )
    assert events.count("page_failed") == 1
    assert events.count("published") == 1


def test_execute__failing_page_without_allow_partial_fails_and_publishes_nothing(
    tmp_path, api, no_broker_publish
):
    source = testdocs.make_pdf(tmp_path / "fifty.pdf", pages=50, text_of=unique_text())
    job = submit(source, output="text", options={"allow_partial": False}, fault=FAIL_PAGE_7)

    assert execute(job) == "failed"

    job.refresh_from_db()
    assert (job.state, job.error_code, job.result_key, job.result_sha256) == (
        "failed",
        "invalid_input",
        None,
        None,
    )
    assert result_files(job.id) == []
    assert _checkpoints(job)[7].state == "failed"
    client = api()
    result = client.get(f"/api/v1/jobs/{job.id}/result")
    assert (result.status_code, result.json()["code"]) == (409, "no_result")
    # All-or-nothing: the converted pages of a failed job are not served either.
    assert client.get(f"/api/v1/jobs/{job.id}/pages/1").status_code == 404
    assert not ExecutionAuditEvent.objects.filter(job_id=job.id, event_type="published").exists()


def test_execute__resumed_attempt_converts_only_the_remaining_pages(tmp_path, no_broker_publish):
    pages, stolen_after = 20, 8
    text_of = unique_text()
    source = testdocs.make_pdf(tmp_path / "twenty.pdf", pages=pages, text_of=text_of)
    job = submit(source, output="text", fault={"kind": "slow", "seconds": 0.15})
    # The lease is stolen: it expires (as if the worker stalled) and the sweep recovers the job.
    run_until_pages_then_lose_lease(job, stolen_after)
    assert (job.state, job.generation) == ("queued", 2)
    converted_first = PageCheckpoint.objects.filter(job=job, state="done").count()
    assert converted_first >= stolen_after

    assert execute(job) == "succeeded"

    attempts = {a.generation: a for a in ConversionAttempt.objects.filter(job=job)}
    assert (attempts[1].outcome, attempts[1].pages_converted) == ("lease_lost", converted_first)
    assert (attempts[2].outcome, attempts[2].pages_converted) == (
        "succeeded",
        pages - converted_first,
    )
    generations = {n: p.generation for n, p in _checkpoints(job).items()}
    assert generations == {n: 1 if n <= converted_first else 2 for n in range(1, pages + 1)}
    job.refresh_from_db()
    body = object_bytes(job.result_key).decode()
    assert body.split("\f") == [text_of(n) for n in range(1, pages + 1)]
    assert work_dir_entries() == []


HOSTILE = [
    ("encrypted", lambda p: testdocs.make_encrypted_pdf(p / "x.pdf"), "text", "encrypted_input"),
    ("truncated", lambda p: testdocs.make_truncated_pdf(p / "x.pdf"), "text", "invalid_input"),
    (
        "malformed_xref",
        lambda p: testdocs.make_malformed_xref_pdf(p / "x.pdf"),
        "text",
        "invalid_input",
    ),
    ("png_bomb", lambda p: testdocs.make_png_bomb(p / "x.png"), "pdf", "input_too_large"),
    ("huge_page", lambda p: testdocs.make_huge_page_pdf(p / "x.pdf"), "png", "input_too_large"),
]


@pytest.mark.parametrize(
    ("make", "output", "code"), [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE]
)
def test_execute__hostile_input_fails_with_its_code(
    tmp_path, make, output, code, no_broker_publish
):
    job = submit(make(tmp_path), output=output)

    assert execute(job) == "failed"

    job.refresh_from_db()
    assert (job.state, job.error_code, job.error_retryable, job.result_key) == (
        "failed",
        code,
        False,
        None,
    )
    attempt = ConversionAttempt.objects.get(job=job)
    assert (attempt.outcome, attempt.error_code) == ("terminal_error", code)
    assert work_dir_entries() == []
    # The worker keeps serving the next job.
    good = submit(
        testdocs.make_pdf(tmp_path / "ok.pdf", pages=1, text_of=unique_text()), output="text"
    )
    assert execute(good) == "succeeded"


def test_finalize__run_twice_publishes_once(tmp_path, monkeypatch, no_broker_publish):
    finalize = runner._finalize
    outcomes: list[str] = []

    def finalize_twice(**kwargs):
        outcomes.append(finalize(**kwargs))
        outcomes.append(finalize(**kwargs))
        return outcomes[0]

    monkeypatch.setattr(runner, "_finalize", finalize_twice)
    source = testdocs.make_pdf(tmp_path / "doc.pdf", pages=3, text_of=unique_text())
    job = submit(source, output="text")

    assert execute(job) == "succeeded"

    assert outcomes == ["succeeded", "lost"]
    job.refresh_from_db()
    assert job.state == "succeeded"
    assert result_files(job.id) == stored_result(job)
    assert object_sha256(job.result_key) == job.result_sha256
    published = ExecutionAuditEvent.objects.filter(job_id=job.id, event_type="published")
    assert published.count() == 1
    assert ConversionAttempt.objects.get(job=job).outcome == "succeeded"
    # A redelivery of the same generation is a duplicate: nothing runs again.
    assert execute(job, generation=1) == "duplicate"
    assert published.count() == 1
