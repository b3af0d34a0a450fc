"""``options.pages`` against the document's page count, through whole jobs (issue 22 point 6;
docs/API_CONTRACT.md §2.1): a range that ends past the last page fails ``invalid_input``, for a
PDF, a multi-frame TIFF and an Office document alike; a range within the document converts."""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path

import pytest
from pypdf import PdfReader

from conversion_jobs.models import ConversionJob, PageCheckpoint
from tests import testdocs
from tests.integration.execution.jobkit import (
    downloaded_result,
    execute,
    result_files,
    submit,
    unique_text,
)

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("fast_quire", "no_broker_publish"),
]


def _pdf(tmp_path: Path) -> Path:
    return testdocs.make_pdf(tmp_path / "three.pdf", pages=3, text_of=unique_text("range"))


def _tiff(tmp_path: Path) -> Path:
    return testdocs.make_tiff(tmp_path / "three.tiff", frames=3, text_of=unique_text("frame"))


SOURCES = [
    pytest.param(_pdf, "text", id="pdf"),
    pytest.param(_tiff, "pdf", id="tiff"),
]


@pytest.mark.parametrize(("make", "output"), SOURCES)
def test_page_range_past_the_last_page__fails_invalid_input(
    tmp_path, make: Callable[[Path], Path], output: str
):
    job = submit(make(tmp_path), output=output, options={"pages": [1, 99]})
    assert execute(job) == "failed"
    failed = ConversionJob.objects.get(id=job.id)
    assert (failed.error_code, failed.source_page_count) == ("invalid_input", 3)
    assert failed.error_detail == "the requested page range 1-99 exceeds the page count (3)"
    assert (failed.result_key, result_files(job.id)) == (None, [])
    assert not PageCheckpoint.objects.filter(job=job, state="done").exists()


@pytest.mark.parametrize(("make", "output"), SOURCES)
def test_page_range_ending_on_the_last_page__converts(
    tmp_path, api, make: Callable[[Path], Path], output: str
):
    job = submit(make(tmp_path), output=output, options={"pages": "2-3"})
    assert execute(job) == "succeeded"
    done = ConversionJob.objects.get(id=job.id)
    assert (done.source_page_count, done.pages_done) == (3, 2)
    result = downloaded_result(api, job)
    if output == "text":
        assert len(result.decode().split("\f")) == 2
    else:
        assert len(PdfReader(io.BytesIO(result)).pages) == 2


@pytest.mark.engine
def test_page_range_past_the_last_page_of_an_office_document__fails_invalid_input(tmp_path):
    source = testdocs.make_docx(
        tmp_path / "three.docx",
        paragraphs=[unique_text("office")(n) for n in (1, 2, 3)],
        page_break_after_each=True,
    )
    job = submit(source, output="pdf", options={"pages": [1, 99]})
    assert execute(job) == "failed"
    failed = ConversionJob.objects.get(id=job.id)
    assert (failed.error_code, failed.source_page_count) == ("invalid_input", 3)
    assert "exceeds the page count (3)" in failed.error_detail
