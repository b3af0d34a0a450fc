"""A submitted file name and a bearer token never reach any log line, whatever the level."""

from __future__ import annotations

import io
import logging
import logging.config
import uuid

import pytest
from django.conf import settings as django_settings
from rest_framework.test import APIClient

from conversion_jobs.logging import RedactFilter, redact
from tests.conftest import token


@pytest.fixture
def captured_logs():
    stream = io.StringIO()
    config = {**django_settings.LOGGING, "disable_existing_loggers": False}
    config["handlers"] = {
        "console": {
            "class": "logging.StreamHandler",
            "stream": stream,
            "formatter": "json",
            "filters": ["redact"],
        }
    }
    config["root"] = {"handlers": ["console"], "level": "DEBUG"}
    config["loggers"] = {}
    logging.config.dictConfig(config)
    try:
        yield stream
    finally:
        logging.config.dictConfig(django_settings.LOGGING)


@pytest.mark.django_db(transaction=True)
def test_logs__never_carry_file_name_or_token(captured_logs, pdf_file, no_broker_publish):
    secret_name = f"secret-merger-{uuid.uuid4().hex}.pdf"
    bearer = token(tenant="tenant-privacy")
    client = APIClient(raise_request_exception=False)
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {bearer}")
    path = pdf_file(name=secret_name)
    with open(path, "rb") as fh:
        accepted = client.post("/api/v1/jobs", {"file": fh, "output": "text"}, format="multipart")
    assert accepted.status_code == 202
    with open(path, "rb") as fh:  # an error path too: a bad output, logged as a 4xx by Django
        assert (
            client.post(
                "/api/v1/jobs", {"file": fh, "output": "nope"}, format="multipart"
            ).status_code
            == 400
        )
    bad = APIClient(raise_request_exception=False)
    bad.credentials(HTTP_AUTHORIZATION=f"Bearer {bearer}x")
    assert bad.get(f"/api/v1/jobs/{accepted.json()['id']}").status_code == 401
    # Code that logs carelessly is caught by the filter, not by luck:
    logging.getLogger("quire.careless").warning(
        "upload %s with Authorization: Bearer %s",
        secret_name,
        bearer,
        extra={"upload_file": secret_name},
    )

    output = captured_logs.getvalue()
    assert output, "nothing was logged: the test would prove nothing"
    assert secret_name not in output
    assert bearer not in output
    assert "tenant-privacy" not in output


def test_redact__tokens_urls_and_filenames():
    jwt_like = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJ4In0.c2lnbmF0dXJl"
    assert jwt_like not in redact(f"token {jwt_like}")
    assert "hunter2" not in redact("amqp://quire_worker:hunter2@127.0.0.1:5672/quire")
    assert "report.pdf" not in redact(
        'Content-Disposition: form-data; name="file"; filename="report.pdf"'
    )
    record = logging.LogRecord("x", logging.INFO, "f", 1, "plain %s", ("text",), None)
    record.token = "abc"  # type: ignore[attr-defined]
    assert RedactFilter().filter(record) and record.token == "[redacted]"  # type: ignore[attr-defined]
