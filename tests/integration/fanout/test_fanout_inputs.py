"""Every input fans out (ADR 0023): an Office document is converted to PDF once (the warm engine,
by the planner) and its ranges split that PDF; OCR runs per range on a multi-frame TIFF."""

from __future__ import annotations

import io

import pytest
from pypdf import PdfReader

from conversion_jobs import storage
from conversion_jobs.models import ConversionJob, JobRange
from tests import testdocs
from tests.integration.execution.jobkit import downloaded_result, execute, submit
from tests.integration.fanout.rangekit import ranges_of, run_ranges

pytestmark = [
    pytest.mark.engine,
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("fanout_quire", "no_broker_publish"),
]


def test_fanout__office_converted_once_then_split(tmp_path, api):
    import uuid

    salt = uuid.uuid4().hex[:8]
    source = testdocs.make_docx(
        tmp_path / "d.docx",
        paragraphs=[f"Paragraph {n} {salt}" for n in range(1, 9)],
        page_break_after_each=True,
    )
    job = submit(source, output="pdf")
    assert execute(job) == "fanned_out"
    rows = ranges_of(job.id)
    key = storage.page_key(job_id=job.id, page=0, generation=1, ext="pdf")
    assert {r.document_key for r in rows} == {key}  # one PDF, every range splits it
    assert storage.exists(key)
    outcomes = run_ranges(job)
    assert outcomes[-1] == "succeeded", outcomes
    job.refresh_from_db()
    result = downloaded_result(api, job)
    # the result is LibreOffice's one PDF, as an unsplit Office job publishes it
    with storage.open_object(key) as fh:
        assert result == fh.read()
    assert len(PdfReader(io.BytesIO(result)).pages) == job.source_page_count == 8
    assert job.pages_done == 8


def test_fanout__ocr_per_range(tmp_path, api):
    source = testdocs.make_tiff(
        tmp_path / "s.tiff",
        sizes=[(700, 140)] * 6,
        text_of=lambda n: f"SCAN {n}",
    )
    job = submit(source, output="text")
    assert execute(job) == "fanned_out"
    assert len(ranges_of(job.id)) == 3
    assert run_ranges(job)[-1] == "succeeded"
    text = downloaded_result(api, ConversionJob.objects.get(id=job.id)).split(b"\f")
    assert [t.strip().decode() for t in text] == [f"SCAN {n}" for n in range(1, 7)]
    assert set(JobRange.objects.filter(job=job).values_list("state", flat=True)) == {"done"}
