"""Helpers for fan-out tests: run a fanned-out job's ranges through the real worker path."""

from __future__ import annotations

import threading
import uuid
from typing import Any

from django.db import connection

from conversion_jobs.models import ConversionJob, JobRange
from conversion_jobs.observability import metrics
from conversion_jobs.services.range_runner import conversion_range_execute


def ranges_of(job_id: uuid.UUID) -> list[JobRange]:
    return list(JobRange.objects.filter(job_id=job_id).order_by("first_page"))


def run_range(job: ConversionJob, row: JobRange) -> str:
    return conversion_range_execute(
        job_id=job.id,
        generation=row.job_generation,
        range_first=row.first_page,
        range_generation=row.generation,
    )


def run_ranges(job: ConversionJob) -> list[str]:
    """Every queued range of ``job``, one after another, in page order (as one worker slot
    would take their messages). Returns their outcomes."""
    return [run_range(job, row) for row in ranges_of(job.id) if row.state == "queued"]


class RangeWorker(threading.Thread):
    """``conversion_range_execute`` in its own thread (and database connection)."""

    def __init__(self, job: ConversionJob, row: JobRange, before: Any = None) -> None:
        super().__init__(daemon=True)
        self.job, self.row, self.before = job, row, before
        self.outcome: str | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            if self.before is not None:
                self.before()
            self.outcome = run_range(self.job, self.row)
        except BaseException as exc:
            self.error = exc
        finally:
            connection.close()

    def result(self, timeout: float = 60) -> str | None:
        self.join(timeout)
        assert not self.is_alive(), "the range worker did not finish"
        if self.error is not None:
            raise self.error
        return self.outcome


def refused(statement: str) -> float:
    """``quire_fenced_writes_refused_total{statement}`` in this process."""
    return metrics.FENCED_WRITES_REFUSED.labels(statement=statement)._value.get()
