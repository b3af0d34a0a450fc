"""Uploads: size limit (413, nothing stored) and sniffed media type (415)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from conversion_jobs import storage
from tests import testdocs
from tests.integration.api.conftest import (
    problem,
    row_counts,
    staged_uploads,
    stored_objects,
    submit,
)

LIMIT = 100_000


def _storage_files() -> list[Any]:
    return [*stored_objects(), *staged_uploads()]


def _blob(path: Path, size: int) -> Path:
    path.write_bytes(testdocs.pdf_bytes(pages=1) + b"%" * size)
    return path


@pytest.mark.django_db
def test_submit__far_over_size_limit_is_413_before_reading(
    api, tmp_path, settings_quire, no_broker_publish
):
    settings_quire(MAX_UPLOAD_BYTES=LIMIT)
    body = problem(submit(api(), _blob(tmp_path / "big.pdf", 5 * LIMIT)), 413, "payload_too_large")
    assert str(LIMIT) in body["detail"]
    assert _storage_files() == []
    assert row_counts()["jobs"] == 0


@pytest.mark.django_db
def test_submit__just_over_size_limit_is_413_and_the_partial_file_is_removed(
    api, tmp_path, settings_quire, no_broker_publish
):
    """Content-Length passes the envelope allowance: the handler stops while streaming."""
    settings_quire(MAX_UPLOAD_BYTES=LIMIT)
    problem(submit(api(), _blob(tmp_path / "big.pdf", LIMIT + 10_000)), 413, "payload_too_large")
    assert _storage_files() == []
    assert row_counts()["jobs"] == 0


@pytest.mark.django_db
def test_submit__at_size_limit_is_accepted(api, tmp_path, settings_quire, no_broker_publish):
    settings_quire(MAX_UPLOAD_BYTES=LIMIT)
    path = tmp_path / "ok.pdf"
    head = testdocs.pdf_bytes(pages=1)
    path.write_bytes(head + b"%" * (LIMIT - len(head)))
    response = submit(api(), path)
    assert response.status_code == 202, response.content
    assert response.json()["source"]["size"] == LIMIT
    assert staged_uploads() == []
    sources = list(storage.list_objects("sources"))
    assert len(sources) == 1
    assert sources[0].size == LIMIT


@pytest.mark.django_db
def test_submit__zip_declared_as_pdf_is_415(api, tmp_path, no_broker_publish):
    path = testdocs.make_zip_as_pdf(tmp_path / "report.pdf")
    client = api()
    upload = SimpleUploadedFile("report.pdf", path.read_bytes(), content_type="application/pdf")
    response = client.post("/api/v1/jobs", {"file": upload, "output": "text"}, format="multipart")
    problem(response, 415, "unsupported_media_type")
    assert row_counts()["jobs"] == 0
    assert _storage_files() == []


@pytest.mark.django_db
def test_submit__wrong_magic_is_415(api, tmp_path, no_broker_publish):
    problem(
        submit(api(), testdocs.make_wrong_magic(tmp_path / "x.pdf")), 415, "unsupported_media_type"
    )
    assert _storage_files() == []


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("data", "code"),
    [
        ({"output": "text"}, "invalid_request"),  # no file
        ({"output": "docx"}, "invalid_request"),
        ({"output": "text", "options": "{not json"}, "invalid_options"),
        ({"output": "text", "options": '{"dpi": 300}'}, "invalid_options"),
    ],
)
def test_submit__invalid_form_is_400(api, pdf_file, data, code, no_broker_publish):
    client = api()
    payload = dict(data)
    with open(pdf_file(), "rb") as fh:
        if data != {"output": "text"}:
            payload["file"] = fh
        response = client.post("/api/v1/jobs", payload, format="multipart")
    problem(response, 400, code)
    assert row_counts()["jobs"] == 0
    assert _storage_files() == []


@pytest.mark.django_db
def test_submit__json_body_is_400(api, no_broker_publish):
    problem(api().post("/api/v1/jobs", {"output": "text"}, format="json"), 400, "invalid_request")


@pytest.mark.django_db
def test_submit__bad_idempotency_key_is_400(api, pdf_file, no_broker_publish):
    problem(submit(api(), pdf_file(), key="x" * 256), 400, "invalid_request")
    assert _storage_files() == []
