"""The warm LibreOffice through the worker path (issue 13 point 4): a cancelled Office job's
conversion is killed with its engine, a conversion past its limit is charged a timeout, and
the engine comes back for the next document."""

from __future__ import annotations

import time
import uuid

import pytest

from conversion_jobs.converters import engines, process_group_members
from conversion_jobs.models import ConversionJob
from tests import testdocs
from tests.integration.execution.jobkit import Worker, execute, submit, wait_for

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("fast_quire"),
    pytest.mark.engine,
]


@pytest.fixture(autouse=True)
def warm_engine(settings):
    settings.QUIRE = {**settings.QUIRE, "OFFICE_ENGINE": "warm"}
    yield
    engines.stop("test")


def _docx_job(tmp_path, **kwargs) -> ConversionJob:
    words = f"Office words {uuid.uuid4().hex}"
    source = testdocs.make_docx(tmp_path / f"{uuid.uuid4().hex}.docx", paragraphs=[words])
    return submit(source, output="pdf", **kwargs)


def test_cancel_running_office_job__conversion_killed__engine_back_for_the_next(
    tmp_path, api, no_broker_publish
):
    assert execute(_docx_job(tmp_path)) == "succeeded"  # a warm engine
    pgid = engines.host_pgid()
    assert pgid is not None
    job = _docx_job(tmp_path, fault={"kind": "hang"})
    worker = Worker(job.id, 1)
    worker.start()
    wait_for(lambda: ConversionJob.objects.get(id=job.id).state == "running", timeout=30)
    time.sleep(0.5)  # LibreOffice is now stopped mid-conversion

    response = api().post(f"/api/v1/jobs/{job.id}/cancel")
    assert response.status_code == 202
    assert worker.result() == "cancelled"
    assert process_group_members(pgid) == []  # host, soffice and its client: all gone
    assert engines.host_pgid() is None

    after = _docx_job(tmp_path)
    assert execute(after) == "succeeded"
    assert engines.host_pgid() not in (None, pgid)


def test_office_conversion_past_its_limit__charged_a_timeout__next_converts(
    tmp_path, no_broker_publish, settings
):
    settings.QUIRE = {**settings.QUIRE, "CONVERTER_LIMITS": {"prepare_timeout_s": 10}}
    assert execute(_docx_job(tmp_path)) == "succeeded"
    pgid = engines.host_pgid()
    job = _docx_job(tmp_path, fault={"kind": "hang"})

    started = time.monotonic()
    assert execute(job) == "failed"
    elapsed = time.monotonic() - started

    job.refresh_from_db()
    assert job.error_code == "conversion_timeout"
    assert elapsed < 10 + 3, elapsed
    assert process_group_members(pgid) == []
    assert execute(_docx_job(tmp_path)) == "succeeded"
