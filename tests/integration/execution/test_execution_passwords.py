"""``options.password`` through the service (issue 13 point 2): sealed at rest, never stored,
echoed or audited in clear, a keyed HMAC in the content identity, wiped when the job ends."""

from __future__ import annotations

import json

import pytest
from django.db import connection
from django.utils import timezone

from conversion_jobs import passwords
from conversion_jobs.models import ConversionJob
from conversion_jobs.states import State
from tests import testdocs
from tests.integration.execution.jobkit import execute, submit

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("fast_quire")]

PASSWORD = "Tr0ub4dor&3-office"


def _everything_stored_about(job: ConversionJob) -> str:
    """Every row of every table that mentions the job, as text."""
    found = []
    with connection.cursor() as cursor:
        for table in connection.introspection.table_names():
            columns = [
                c.name for c in connection.introspection.get_table_description(cursor, table)
            ]
            cursor.execute(f'SELECT * FROM "{table}"')  # noqa: S608 - names from introspection
            for row in cursor.fetchall():
                text = json.dumps([str(v) for v in row])
                if str(job.id) in text or (columns and table.startswith("conversion")):
                    found.append(text)
    return "\n".join(found)


def test_password__opens_encrypted_pdf__never_stored_in_clear__wiped_at_end(
    tmp_path, api, no_broker_publish
):
    source = testdocs.make_encrypted_pdf(tmp_path / "enc.pdf", pages=2, password=PASSWORD)
    job = submit(source, output="text", options={"password": PASSWORD})

    assert "password" not in job.options
    assert job.options[passwords.IDENTITY_KEY] == passwords.identity(PASSWORD)
    assert job.password_sealed and passwords.unseal(job.password_sealed) == PASSWORD
    assert PASSWORD not in _everything_stored_about(job)
    shown = api().get(f"/api/v1/jobs/{job.id}").json()
    assert "password" not in json.dumps(shown) and PASSWORD not in json.dumps(shown)
    assert passwords.IDENTITY_KEY not in shown["options"]

    assert execute(job) == "succeeded"

    job.refresh_from_db()
    assert job.password_sealed is None  # gone with the attempt that ended the job
    assert api().get(f"/api/v1/jobs/{job.id}/result").status_code == 200
    assert job.pages_done == 2


def test_password__wrong_one_ends_invalid_password(tmp_path, no_broker_publish):
    source = testdocs.make_encrypted_pdf(tmp_path / "enc.pdf", pages=1, password=PASSWORD)
    job = submit(source, output="text", options={"password": "not the one"})

    assert execute(job) == "failed"

    job.refresh_from_db()
    assert (job.state, job.error_code, job.password_sealed) == ("failed", "invalid_password", None)


def test_password__without_one_an_encrypted_pdf_ends_encrypted_input(tmp_path, no_broker_publish):
    source = testdocs.make_encrypted_pdf(tmp_path / "enc.pdf", pages=1, password=PASSWORD)
    job = submit(source, output="text")

    assert execute(job) == "failed"

    job.refresh_from_db()
    assert job.error_code == "encrypted_input"


def test_password__identity_is_keyed_per_password(tmp_path, no_broker_publish):
    import shutil
    import uuid
    from pathlib import Path

    from django.conf import settings

    from conversion_jobs import storage
    from conversion_jobs.services.acceptance import StagedUpload, conversion_job_accept

    source = testdocs.make_encrypted_pdf(tmp_path / "enc.pdf", pages=1, password=PASSWORD)

    def accept(password: str):
        staged = Path(settings.QUIRE["STORAGE_DIR"]) / "staging" / f"t-{uuid.uuid4().hex}"
        staged.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, staged)
        sha, size = storage.sha256_file(staged)
        return conversion_job_accept(
            tenant="tenant-a",
            actor="tester",
            upload=StagedUpload(path=staged, sha256=sha, size=size),
            output="text",
            raw_options={"password": password},
            idempotency_key=None,
        )

    first = accept(PASSWORD)
    again = accept(PASSWORD)
    other = accept("another password")
    assert first.created and not again.created and again.job.id == first.job.id
    assert other.created and other.job.options_digest != first.job.options_digest


def test_password__sweep_wipes_jobs_that_ended_without_a_worker(tmp_path, no_broker_publish):
    source = testdocs.make_encrypted_pdf(tmp_path / "enc.pdf", pages=1, password=PASSWORD)
    job = submit(source, output="text", options={"password": PASSWORD})
    assert passwords.sealed_passwords_wipe() == 0  # queued: still needed
    ConversionJob.objects.filter(id=job.id).update(
        state=State.CANCELLED, finished_at=timezone.now()
    )

    from tasks.sweeps import remove_stale_work_dirs

    remove_stale_work_dirs()

    job.refresh_from_db()
    assert job.password_sealed is None
