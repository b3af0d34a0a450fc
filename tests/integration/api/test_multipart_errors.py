"""Multipart errors after the ``file`` part (issue 10 §4): 400 problem+json with a stable code,
no job, nothing stored, no staged file left."""

from __future__ import annotations

from typing import Any

import pytest

from conversion_jobs.models import InlineSource
from tests import multipart, testdocs
from tests.integration.api.conftest import problem, row_counts, staged_uploads, stored_objects

BODIES = multipart.hostile_bodies(testdocs.pdf_bytes(pages=1))


def _stored_files() -> list[Any]:
    return [*stored_objects(), *staged_uploads()]


@pytest.mark.django_db
@pytest.mark.parametrize("case", sorted(BODIES))
def test_submit__multipart_error_after_the_file_is_400_and_leaves_nothing(
    api, case, no_broker_publish
):
    payload, code = BODIES[case]
    response = api().generic("POST", "/api/v1/jobs", payload, content_type=multipart.CONTENT_TYPE)
    problem(response, 400, code)
    assert row_counts()["jobs"] == 0
    assert _stored_files() == []
    assert no_broker_publish == []


@pytest.mark.django_db
def test_submit__valid_hand_built_body_is_accepted(api, no_broker_publish):
    """The same builder with a well-formed body: the 400s above are the errors, not the builder."""
    payload = multipart.body(
        multipart.part("file", testdocs.pdf_bytes(pages=1), filename="doc.pdf"),
        multipart.part("output", b"text"),
        multipart.part("options", b'{"allow_partial": false}'),
    )
    response = api().generic("POST", "/api/v1/jobs", payload, content_type=multipart.CONTENT_TYPE)
    assert response.status_code == 202, response.content
    assert stored_objects() == []  # a small source: inline (ADR 0017 session 10)
    assert InlineSource.objects.count() == 1
    assert staged_uploads() == []


@pytest.mark.django_db
@pytest.mark.parametrize("content_type", multipart.malformed_content_types())
def test_submit__malformed_multipart_envelope_is_400(api, content_type, no_broker_publish):
    payload, _ = BODIES["too_many_fields"]
    response = api().generic("POST", "/api/v1/jobs", payload, content_type=content_type)
    problem(response, 400, "malformed_body")
    assert row_counts()["jobs"] == 0
    assert _stored_files() == []
