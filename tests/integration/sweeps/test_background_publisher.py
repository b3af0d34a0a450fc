"""The web's background fast-path publisher (ADR 0017 addendum) in-process, in both profiles:
RabbitMQ with publisher confirms (production) and the standalone profile's server-less
transport. Acceptances hand their committed outbox rows over; the publisher publishes and marks
them, once each. (The live web process, a broker outage and a kill -9 before the publish:
tests/e2e/test_background_publisher.py.)"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from conversion_jobs.models import ConversionOutbox
from conversion_jobs.services import publisher
from tests import testdocs
from tests.integration.execution.jobkit import submit

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def background(settings) -> Iterator[publisher.BackgroundPublisher]:
    settings.QUIRE = {**settings.QUIRE, "FAST_PUBLISH": "background", "PUBLISH_BATCH": 8}
    enabled = publisher.enable()
    assert enabled is not None
    yield enabled
    enabled.stop(10)  # its thread's database connection must not outlive the test database
    publisher.disable()


def _accept(tmp_path: Path) -> uuid.UUID:
    src = tmp_path / f"{uuid.uuid4().hex}.pdf"
    salt = uuid.uuid4().hex
    testdocs.make_pdf(src, pages=1, text_of=lambda n: f"Page {n} {salt}")
    return submit(src, output="text").id


def test_background_publisher__committed_rows_are_published_and_marked_once(
    background: publisher.BackgroundPublisher, tmp_path: Path
) -> None:
    job_ids = [_accept(tmp_path) for _ in range(20)]
    assert background.flush(30), "the publisher did not drain"
    rows = list(
        ConversionOutbox.objects.filter(job_id__in=job_ids).values_list(
            "published_at", "publish_attempts", "last_error_code"
        )
    )
    assert len(rows) == 20
    assert all(published is not None for published, _, _ in rows)
    assert {(attempts, error) for _, attempts, error in rows} == {(1, None)}


def test_background_publisher__off_in_processes_that_did_not_enable_it(
    settings, tmp_path: Path
) -> None:
    """Workers, the sweeper and the test client publish inline: the row is marked before the
    accepting call returns."""
    publisher.disable()
    job_id = _accept(tmp_path)
    row = ConversionOutbox.objects.get(job_id=job_id)
    assert row.published_at is not None and row.publish_attempts == 1


def test_background_publisher__inline_setting_keeps_the_per_request_publish(settings) -> None:
    settings.QUIRE = {**settings.QUIRE, "FAST_PUBLISH": "inline"}
    publisher.disable()
    assert publisher.enable() is None and publisher.current() is None
