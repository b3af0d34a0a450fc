"""Over a real HTTP connection to a live server (issue 10 §4): hostile multipart bodies after the
``file`` part and Django's own error answers are problem+json with stable codes, and nothing is
stored or left staged."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import requests
from django.conf import settings

from conversion_jobs.models import ConversionJob
from tests import multipart, testdocs
from tests.conftest import token

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

BODIES = multipart.hostile_bodies(testdocs.pdf_bytes(pages=1))
PROBLEM = "application/problem+json"


def _stored_files() -> list[Path]:
    root = Path(settings.QUIRE["STORAGE_DIR"])
    return [p for p in root.rglob("*") if p.is_file()] if root.exists() else []


def _assert_problem(response: requests.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, (response.status_code, response.text[:300])
    assert response.headers["Content-Type"] == PROBLEM
    body = response.json()
    assert (body["status"], body["code"]) == (status, code)
    return body


@pytest.mark.parametrize("case", sorted(BODIES))
def test_live__multipart_error_after_the_file_is_400_and_leaves_nothing(
    live_server: Any, no_broker_publish: list, case: str
) -> None:
    payload, code = BODIES[case]
    response = requests.post(
        f"{live_server.url}/api/v1/jobs",
        data=payload,
        headers={"Authorization": f"Bearer {token()}", "Content-Type": multipart.CONTENT_TYPE},
        timeout=30,
    )
    _assert_problem(response, 400, code)
    assert ConversionJob.objects.count() == 0
    assert _stored_files() == []
    assert no_broker_publish == []


def test_live__well_formed_upload_is_accepted(live_server: Any, no_broker_publish: list) -> None:
    response = requests.post(
        f"{live_server.url}/api/v1/jobs",
        headers={"Authorization": f"Bearer {token()}"},
        files={"file": ("doc.pdf", testdocs.pdf_bytes(pages=1), "application/pdf")},
        data={"output": "text", "options": '{"allow_partial": true}'},
        timeout=30,
    )
    assert response.status_code == 202, response.text
    assert ConversionJob.objects.count() == 1
    assert not list((Path(settings.QUIRE["STORAGE_DIR"]) / "staging").glob("*"))


@pytest.mark.parametrize(
    ("method", "path", "headers", "status", "code"),
    [
        ("get", "/nope", {}, 404, "not_found"),
        ("get", "/api/v1/jobs", {}, 401, "not_authenticated"),
        ("get", "/api/v1/jobs", {"Authorization": "Bearer x.y.z"}, 401, "invalid_token"),
        ("get", "/api/v1/capabilities", {"Host": "evil.example"}, 400, "invalid_host"),
        ("delete", "/api/v1/capabilities", {}, 405, "method_not_allowed"),
        (
            "post",
            "/admin/login/",
            {"Content-Type": "application/x-www-form-urlencoded"},
            403,
            "csrf_failed",
        ),
    ],
)
def test_live__django_answers_are_problems(
    live_server: Any, settings: Any, method: str, path: str, headers: dict, status: int, code: str
) -> None:
    settings.ALLOWED_HOSTS = ["localhost", "127.0.0.1", "testserver"]
    response = requests.request(
        method, f"{live_server.url}{path}", headers=headers, data=b"a=b", timeout=30
    )
    _assert_problem(response, status, code)
