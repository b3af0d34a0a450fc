"""Issue 22 point 6 through whole jobs (``conversion_job_execute``, real converter children,
the real LibreOffice): a zip-bomb DOCX ends ``failed`` with its code instead of succeeding
empty, and LibreOffice never reads it (the warm engine is not even started for it); a PDF that
lost all of a document's text fails ``conversion_lost_content``."""

from __future__ import annotations

import pytest

from conversion_jobs.converters import engines
from conversion_jobs.models import ConversionJob
from tests import testdocs
from tests.integration.execution.jobkit import execute, result_files, submit, unique_text

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("fast_quire", "no_broker_publish"),
    pytest.mark.engine,
]


@pytest.fixture(autouse=True)
def warm_engine(settings):
    """The production default: Office documents go to the worker's warm engine."""
    settings.QUIRE = {
        **settings.QUIRE,
        "OFFICE_ENGINE": "warm",
        "CONVERTER_LIMITS": {"prepare_timeout_s": 120},
    }
    engines.stop("test")
    yield
    engines.stop("test")


def _failed(job: ConversionJob) -> ConversionJob:
    assert execute(job) == "failed"
    done = ConversionJob.objects.get(id=job.id)
    assert (done.state, done.result_key, done.error_retryable) == ("failed", None, False)
    assert result_files(job.id) == []
    return done


@pytest.mark.parametrize("output", ["text", "pdf"])
def test_zip_bomb_docx__fails_input_too_large__libreoffice_never_starts(tmp_path, output):
    bomb = testdocs.make_docx_bomb(tmp_path / "bomb.docx")  # 1 GiB of text in one run, ~1 MB
    failed = _failed(submit(bomb, output=output))
    assert failed.error_code == "input_too_large"
    assert "inflated bytes" in failed.error_detail
    assert failed.attempts == 1  # terminal: never retried
    assert not engines.host_engine_started()


@pytest.mark.parametrize("output", ["text", "pdf"])
def test_zip_bomb_docx_with_lying_headers__fails_invalid_input(tmp_path, output):
    liar = testdocs.make_docx_bomb(tmp_path / "liar.docx", declared=4096)
    failed = _failed(submit(liar, output=output))
    assert failed.error_code == "invalid_input"
    assert "inflates past its declared size" in failed.error_detail
    assert not engines.host_engine_started()


def test_office_pdf_without_the_documents_text__fails_conversion_lost_content(tmp_path):
    words = unique_text("Lost")(1)
    source = testdocs.make_docx_unknown_root(tmp_path / "lost.docx", paragraphs=[words])
    failed = _failed(submit(source, output="pdf"))
    assert failed.error_code == "conversion_lost_content"
    assert words not in failed.error_detail
