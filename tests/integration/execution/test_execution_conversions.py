"""Issue 4: documents round-trip through the whole service (accept -> execute -> results API)
with real converter child processes and real Postgres."""

from __future__ import annotations

import hashlib
import io
import zipfile
from typing import Any

import pytest
from PIL import Image
from pypdf import PdfReader

from conversion_jobs.models import ConversionAttempt, PageCheckpoint
from tests import testdocs
from tests.integration.execution.jobkit import (
    downloaded_result,
    execute,
    object_bytes,
    object_sha256,
    submit,
    unique_text,
    work_dir_entries,
)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("fast_quire")]


@pytest.fixture(autouse=True)
def _lease_for_a_loaded_runner(fast_quire: None, settings: Any) -> None:
    """These tests check conversions, not leases: fast_quire's 2 s lease, renewed every 0.2 s by
    this process's heartbeat thread, was once lost during a 15 s LibreOffice conversion on a CI
    runner running three suites at once (the attempt ended ``lost``). 10 s keeps the fencing
    real and out of the way."""
    settings.QUIRE = {**settings.QUIRE, "LEASE_S": 10}


def test_execute__pdf_text_round_trips_exactly(tmp_path, api, no_broker_publish):
    base = unique_text("Round trip")

    def text_of(n: int) -> str:
        return f"{base(n)}\nsecond line (with parens) of page {n}"

    source = testdocs.make_pdf(tmp_path / "doc.pdf", pages=7, text_of=text_of)
    job = submit(source, output="text")

    assert execute(job) == "succeeded"

    job.refresh_from_db()
    assert (job.state, job.source_page_count, job.pages_done, job.pages_failed) == (
        "succeeded",
        7,
        7,
        0,
    )
    body = downloaded_result(api, job).decode("utf-8")
    assert body.split("\f") == [text_of(n) for n in range(1, 8)]
    attempt = ConversionAttempt.objects.get(job=job)
    assert (attempt.outcome, attempt.pages_converted) == ("succeeded", 7)
    assert work_dir_entries() == []


def test_execute__png_pages_have_requested_dpi(tmp_path, api, no_broker_publish):
    # 300 x 400 pt at 144 dpi = 600 x 800 px; 612 x 792 pt at 100 dpi = 850 x 1100 px.
    cases = [((300, 400), 144, (600, 800)), ((612, 792), 100, (850, 1100))]
    for page_size, dpi, expected in cases:
        source = testdocs.make_pdf(
            tmp_path / f"p{dpi}.pdf", pages=2, text_of=unique_text(), page_size=page_size
        )
        job = submit(source, output="png", options={"dpi": dpi})

        assert execute(job) == "succeeded"

        archive = zipfile.ZipFile(io.BytesIO(downloaded_result(api, job)))
        assert archive.namelist() == ["page-0001.png", "page-0002.png"]
        for name in archive.namelist():
            with Image.open(io.BytesIO(archive.read(name))) as img:
                assert (img.format, img.size) == ("PNG", expected)


def test_execute__image_to_pdf_keeps_page_count_and_pixels(tmp_path, api, no_broker_publish):
    sizes = [(321, 123), (456, 234), (210, 345)]
    source = testdocs.make_tiff(tmp_path / "scan.tiff", sizes=sizes, text_of=unique_text())
    job = submit(source, output="pdf")

    assert execute(job) == "succeeded"

    reader = PdfReader(io.BytesIO(downloaded_result(api, job)))
    assert len(reader.pages) == 3
    assert [page.images[0].image.size for page in reader.pages] == sizes


def test_execute__docx_to_pdf_to_text_contains_source_text(tmp_path, api, no_broker_publish):
    salt = unique_text("Docx")(0)
    paragraphs = [f"First paragraph {salt}", f"Second paragraph {salt}", f"Third one {salt}"]
    source = testdocs.make_docx(
        tmp_path / "doc.docx", paragraphs=paragraphs, page_break_after_each=True
    )
    pdf_job = submit(source, output="pdf")

    assert execute(pdf_job) == "succeeded"

    pdf = tmp_path / "from-docx.pdf"
    pdf.write_bytes(downloaded_result(api, pdf_job))
    assert len(PdfReader(pdf).pages) == 3
    text_job = submit(pdf, output="text")
    assert execute(text_job) == "succeeded"
    pages = downloaded_result(api, text_job).decode("utf-8").split("\f")
    assert len(pages) == 3
    for paragraph, page in zip(paragraphs, pages, strict=True):
        assert paragraph in page
    assert work_dir_entries() == []


def test_execute__page_range_converts_only_selected_pages(tmp_path, api, no_broker_publish):
    text_of = unique_text()
    source = testdocs.make_pdf(tmp_path / "doc.pdf", pages=6, text_of=text_of)
    job = submit(source, output="text", options={"pages": "2-4"})

    assert execute(job) == "succeeded"

    assert downloaded_result(api, job).decode().split("\f") == [text_of(n) for n in (2, 3, 4)]
    assert sorted(PageCheckpoint.objects.filter(job=job).values_list("page_number", flat=True)) == [
        2,
        3,
        4,
    ]


def test_execute__result_is_stored_once_under_a_job_derived_key(tmp_path, no_broker_publish):
    source = testdocs.make_docx(tmp_path / "doc.docx", paragraphs=["one", "two"])
    job = submit(source, output="pdf")

    assert execute(job) == "succeeded"

    job.refresh_from_db()
    assert job.result_key.startswith(f"results/{job.id}/")
    body = object_bytes(job.result_key)
    assert (hashlib.sha256(body).hexdigest(), len(body)) == (job.result_sha256, job.result_size)
    pages = PageCheckpoint.objects.filter(job=job).order_by("page_number")
    for page in pages:
        assert object_sha256(page.artifact_key) == page.artifact_sha256
