"""API fuzzing (issue 10 §6): schemathesis against the served OpenAPI document of a live server,
with a valid token, every operation, bounded in time. Any server error, any answer outside the
declared statuses, content types, headers or schemas fails the test."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import requests

from conversion_jobs.services.runner import conversion_job_execute
from tests import testdocs
from tests.conftest import token

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

#: The whole run's budget (schemathesis stops generating when it is spent).
MAX_TIME_S = int(os.environ.get("QUIRE_FUZZ_MAX_TIME_S", "45"))
CHECKS = ",".join(
    [
        "not_a_server_error",
        "status_code_conformance",
        "content_type_conformance",
        "response_headers_conformance",
        "response_schema_conformance",
    ]
)


def _finished_job(live_server: Any, bearer: str, *, output: str) -> str:
    """A job submitted over HTTP and converted here by the real runner: the result, page and
    event operations then have something real to serve."""
    response = requests.post(
        f"{live_server.url}/api/v1/jobs",
        headers={"Authorization": f"Bearer {bearer}"},
        files={"file": ("doc.pdf", testdocs.pdf_bytes(pages=2), "application/pdf")},
        data={"output": output},
        timeout=30,
    )
    assert response.status_code == 202, response.text
    job = response.json()
    assert conversion_job_execute(job_id=job["id"], generation=job["generation"]) == "succeeded"
    return str(job["id"])


def test_api_fuzz__no_server_error_and_no_answer_outside_the_schema(
    live_server: Any, no_broker_publish: list, tmp_path: Path
) -> None:
    bearer = token(ttl=3600)
    text_job = _finished_job(live_server, bearer, output="text")
    png_job = _finished_job(live_server, bearer, output="png")
    config = tmp_path / "schemathesis.toml"
    config.write_text(
        f"""
[[operations]]
include-path-regex = "/(result|events)$"
parameters = {{ "path.job_id" = "{text_job}" }}

[[operations]]
include-path-regex = "/pages"
parameters = {{ "path.job_id" = "{png_job}" }}
"""
    )
    st = Path(sys.executable).with_name("st")
    command = [
        str(st),
        "--config-file",
        str(config),
        "run",
        f"{live_server.url}/api/v1/schema",
        "--checks",
        CHECKS,
        "--phases",
        "examples,coverage,fuzzing",
        "--max-time",
        str(MAX_TIME_S),
        "--request-timeout",
        "40",
        "--workers",
        "1",
        "--seed",
        os.environ.get("QUIRE_FUZZ_SEED", "10"),
        "--suppress-health-check",
        "all",
        "--header",
        f"Authorization: Bearer {bearer}",
        "--report",
        "junit",
        "--report-dir",
        str(tmp_path),
    ]
    result = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=MAX_TIME_S + 120,
        cwd=tmp_path,
        env={**os.environ, "SCHEMATHESIS_HOOKS": "", "NO_COLOR": "1"},
    )
    output = result.stdout + result.stderr
    print(output[-6_000:])
    assert result.returncode == 0, output[-20_000:]
    # Not vacuous: every operation of the served document was exercised.
    operations = sum(
        len(item)
        for item in requests.get(f"{live_server.url}/api/v1/schema?format=json", timeout=30)
        .json()["paths"]
        .values()
    )
    tested = re.search(r"Tested: (\d+)", output)
    assert tested is not None and int(tested.group(1)) == operations >= 10, output[-5_000:]
