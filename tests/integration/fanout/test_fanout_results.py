"""A fanned-out job's result is the unsplit job's, byte for byte, with absolute page numbers
(ADR 0023): PDF -> text and png, multi-frame TIFF -> pdf (merged with pypdf); ``pages`` splits
within the range asked; failed pages follow ``allow_partial``; progress is the sum of the
ranges."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.db import connection

from conversion_jobs.models import ConversionJob, ConversionOutbox, JobRange, PageCheckpoint
from conversion_jobs.services.dispatch import outbox_rows_publish_unpublished
from tests import testdocs
from tests.integration.execution.jobkit import downloaded_result, execute, submit, unique_text
from tests.integration.fanout.rangekit import ranges_of, run_ranges

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("fanout_quire", "no_broker_publish"),
]


def _unsplit(source: Path, **kwargs: Any) -> ConversionJob:
    """The same document converted by one attempt (fan-out off), as another tenant."""
    settings.QUIRE = {**settings.QUIRE, "FANOUT": False}
    try:
        job = submit(source, tenant="tenant-unsplit", **kwargs)
        assert execute(job) in ("succeeded", "partial")
    finally:
        settings.QUIRE = {**settings.QUIRE, "FANOUT": True}
    return ConversionJob.objects.get(id=job.id)


def _fanned_out(source: Path, **kwargs: Any) -> tuple[ConversionJob, list[str]]:
    job = submit(source, tenant="tenant-fan", **kwargs)
    assert execute(job) == "fanned_out"
    outcomes = run_ranges(job)
    return ConversionJob.objects.get(id=job.id), outcomes


def test_fanout__pdf_to_text__identical_to_unsplit(tmp_path, api, no_broker_publish):
    source = testdocs.make_pdf(tmp_path / "t.pdf", pages=12, text_of=unique_text("fan"))
    job = submit(source, tenant="tenant-fan", output="text")
    assert execute(job) == "fanned_out"

    def ranges_sent() -> list[tuple[int, int]]:
        return [m[2:] for m in no_broker_publish if len(m) == 4]

    if connection.vendor == "postgresql":
        # a production worker may not publish: the planner wakes the sweeper's relay instead
        assert ranges_sent() == []
    # the range rows are units of the fair pick (or, fair dispatch off, published at once):
    # one message per range, in page order, carrying the range's first page
    outbox_rows_publish_unpublished()
    assert ranges_sent() == [(1, 1), (4, 1), (7, 1), (10, 1)]
    outcomes = run_ranges(job)
    job = ConversionJob.objects.get(id=job.id)
    assert outcomes == ["range_done", "range_done", "range_done", "succeeded"]
    spans = [(r.first_page, r.last_page, r.state) for r in ranges_of(job.id)]
    assert spans == [(1, 3, "done"), (4, 6, "done"), (7, 9, "done"), (10, 12, "done")]
    # one outbox row (and one message) per range, carrying the range's first page
    rows = ConversionOutbox.objects.filter(job_id=job.id, range_first__isnull=False)
    assert sorted(rows.values_list("range_first", "range_generation")) == [
        (1, 1),
        (4, 1),
        (7, 1),
        (10, 1),
    ]
    # progress is the sum of the ranges; checkpoints keep absolute page numbers
    assert (job.pages_done, job.pages_failed, job.source_page_count) == (12, 0, 12)
    numbers = sorted(PageCheckpoint.objects.filter(job=job).values_list("page_number", flat=True))
    assert numbers == list(range(1, 13))
    unsplit = _unsplit(source, output="text")
    fanned = downloaded_result(lambda: api(tenant="tenant-fan"), job)
    assert fanned == downloaded_result(lambda: api(tenant="tenant-unsplit"), unsplit)
    assert fanned.split(b"\f")[11].endswith(b"page 12")
    assert job.result_sha256 == unsplit.result_sha256


def test_fanout__pdf_to_png__identical_zip_with_absolute_page_names(tmp_path, api):
    source = testdocs.make_pdf(tmp_path / "p.pdf", pages=7, text_of=unique_text("png"))
    job, outcomes = _fanned_out(source, output="png", options={"dpi": 40})
    assert outcomes[-1] == "succeeded" and len(outcomes) == 4  # ranges of 2 (7 / 4 slots)
    unsplit = _unsplit(source, output="png", options={"dpi": 40})
    fanned = downloaded_result(lambda: api(tenant="tenant-fan"), job)
    assert fanned == downloaded_result(lambda: api(tenant="tenant-unsplit"), unsplit)
    names = zipfile.ZipFile(io.BytesIO(fanned)).namelist()
    assert len(names) == 7 and names[-1].endswith("7.png")


def test_fanout__tiff_to_pdf__merged_identical_to_unsplit(tmp_path, api):
    from pypdf import PdfReader

    source = testdocs.make_tiff(tmp_path / "f.tiff", frames=6)
    job, outcomes = _fanned_out(source, output="pdf")
    assert outcomes[-1] == "succeeded"
    unsplit = _unsplit(source, output="pdf")
    fanned = downloaded_result(lambda: api(tenant="tenant-fan"), job)
    assert fanned == downloaded_result(lambda: api(tenant="tenant-unsplit"), unsplit)
    pages = PdfReader(io.BytesIO(fanned)).pages
    # frame n is 300 + 10 n wide (testdocs.make_tiff): the merged order is the page order
    widths = [round(float(p.mediabox.width)) for p in pages]
    assert widths == sorted(widths) and len(widths) == 6


def test_fanout__pages_option__ranges_split_within_the_range_asked(tmp_path, api):
    source = testdocs.make_pdf(tmp_path / "r.pdf", pages=14, text_of=unique_text("sel"))
    job, outcomes = _fanned_out(source, output="text", options={"pages": [3, 11]})
    assert outcomes[-1] == "succeeded"
    spans = [(r.first_page, r.last_page) for r in ranges_of(job.id)]
    assert spans == [(3, 5), (6, 8), (9, 11)]
    text = downloaded_result(lambda: api(tenant="tenant-fan"), job).split(b"\f")
    assert len(text) == 9 and text[0].endswith(b"page 3") and text[-1].endswith(b"page 11")


@pytest.mark.parametrize(("allow_partial", "state"), [(True, "partial"), (False, "failed")])
def test_fanout__a_failed_page__follows_allow_partial(tmp_path, allow_partial, state):
    source = testdocs.make_pdf(tmp_path / "x.pdf", pages=9, text_of=unique_text("part"))
    job = submit(
        source,
        tenant="tenant-fan",
        output="text",
        options={"allow_partial": allow_partial},
        fault={"kind": "fail", "page": 5},
    )
    assert execute(job) == "fanned_out"
    outcomes = run_ranges(job)
    job.refresh_from_db()
    assert (outcomes[-1], job.state) == (state, state)
    assert (job.pages_done, job.pages_failed) == (8, 1)
    if state == "failed":
        assert job.error_code == "invalid_input" and job.result_key is None
    assert set(JobRange.objects.filter(job=job).values_list("state", flat=True)) == {"done"}


def test_fanout__few_pages_left__no_fanout(tmp_path):
    """At or below FANOUT_MIN_PAGES pages to convert, a job runs as one attempt."""
    source = testdocs.make_pdf(tmp_path / "s.pdf", pages=4, text_of=unique_text("small"))
    job = submit(source, tenant="tenant-fan", output="text")
    assert execute(job) == "succeeded"
    assert not JobRange.objects.filter(job=job).exists()


def test_fanout__source_fetched_once_per_job_and_host(tmp_path, monkeypatch):
    """Four ranges on this host: the stored source is downloaded once, into the host's cache;
    each range's copy is a hard link to it."""
    from conversion_jobs import storage
    from conversion_jobs.services import fanout

    fetched: list[str] = []
    download = storage.download

    def counted(key, dest):
        fetched.append(key)
        download(key, dest)

    source = testdocs.make_pdf(tmp_path / "o.pdf", pages=12, text_of=unique_text("once"))
    job = submit(source, tenant="tenant-fan", output="text")
    assert execute(job) == "fanned_out"
    monkeypatch.setattr(storage, "download", counted)
    assert run_ranges(job)[-1] == "succeeded"
    assert fetched == [job.source_key]
    cached = (
        Path(settings.QUIRE["WORK_DIR"]) / fanout.SOURCE_CACHE / f"{job.id}-{job.source_sha256}"
    )
    assert cached.read_bytes() == source.read_bytes()
    # gone once the job is no longer running and the entry is old enough
    assert fanout.source_cache_remove_stale(older_than_s=-1) >= 1
    assert not cached.exists()
