"""Client CPU of an acceptance's two statements (the pre-check and the insert) in one process on
one connection, with and without the kept cursor and the directly built insert parameters
(ADR 0017, "Session 6, round 2"). The four variants alternate inside the process, so the load
of the moment falls on all of them alike; the fast-path publish is a no-op.

    .venv/bin/python bench/accept_statements.py [--rounds 8] [--n 400]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import _common as c  # noqa: E402

DB_NAME = c.bench_db_name("quire_statements")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--n", type=int, default=400, help="acceptances per variant per round")
    args = parser.parse_args()
    os.environ.update(
        DATABASE_URL=c.recreate_database(DB_NAME),
        DJANGO_SETTINGS_MODULE="project.settings",
        QUIRE_LOG_LEVEL="WARNING",
    )
    c.run([sys.executable, "manage.py", "migrate", "--noinput", "-v0"], env=dict(os.environ))

    import django

    django.setup()
    from django.conf import settings
    from django.db import connection
    from django.utils import timezone

    from conversion_jobs.ids import uuid7
    from conversion_jobs.models import ConversionJob
    from conversion_jobs.services import acceptance, dispatch, transitions
    from conversion_jobs.states import State
    from conversion_jobs.store import jobs, prepared

    dispatch.outbox_publish_fast = lambda item: None  # type: ignore[assignment]
    keep, kept, direct = prepared._keep, prepared._kept_cursor, jobs.job_insert_params

    def by_fields(job: ConversionJob) -> dict[str, Any]:
        return {
            f"j_{f.column}": f.get_db_prep_save(getattr(job, f.attname), connection)
            for f in ConversionJob._meta.concrete_fields
        }

    def variant(keep_cursor: bool, direct_params: bool) -> None:
        prepared._keep = keep if keep_cursor else (lambda db, raw: raw)  # type: ignore[assignment]
        prepared._kept_cursor = kept if keep_cursor else (lambda db: prepared._BUSY)  # type: ignore[assignment]
        jobs.job_insert_params = direct if direct_params else by_fields  # type: ignore[assignment]

    def one() -> None:
        job = ConversionJob(
            id=uuid7(),
            tenant="bench",
            state=State.QUEUED,
            source_key="sources/bench",
            source_sha256=uuid.uuid4().hex * 2,
            source_size=10240,
            source_media_type="application/pdf",
            output="text",
            options={},
            options_digest="d" * 64,
            policy_version=settings.QUIRE["POLICY_VERSION"],
            max_attempts=5,
            queued_at=timezone.now(),
            traceparent="",
            password_sealed=None,
        )
        new = transitions.NewJob(
            job=job,
            actor="bench",
            idempotency_key="bench-" + uuid.uuid4().hex,
            fingerprint="f" * 64,
            details={"media_type": "application/pdf", "size": 10240, "output": "text"},
        )
        acceptance._precheck(
            acceptance._Identity(
                tenant="bench",
                key=new.idempotency_key,
                fingerprint=new.fingerprint,
                sha256=job.source_sha256,
                output="text",
                digest="d" * 64,
                engine="",
            )
        )
        transitions.job_insert_queued(new)

    for _ in range(300):
        one()
    variants = [(False, False), (True, False), (False, True), (True, True)]
    spent: dict[tuple[bool, bool], list[float]] = {v: [] for v in variants}
    for _ in range(args.rounds):
        for v in variants:
            variant(*v)
            started = time.thread_time()
            for _ in range(args.n):
                one()
            spent[v].append((time.thread_time() - started) / args.n * 1000)
    for (keep_cursor, direct_params), ms in spent.items():
        print(
            f"kept cursor {'yes' if keep_cursor else 'no ':3}  direct parameters "
            f"{'yes' if direct_params else 'no ':3}: median {statistics.median(ms):.3f} ms,"
            f" min {min(ms):.3f} ms CPU per pre-check + insert"
        )


if __name__ == "__main__":
    main()
