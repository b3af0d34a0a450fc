"""One-page jobs measured in one process, without Celery: the CPU the worker side and Postgres
spend per job, which (unlike jobs/s on a shared 2-core machine) varies little with what else
runs (issue 12; ADR 0017 "Session 5: one-page jobs, worker side").

    .venv/bin/python bench/onepage_inprocess.py [--what statements|job] [--n 500] [--warm 20]

* ``statements``: the claim and publish statements only (``transitions.claim`` +
  ``publish_succeeded`` with one inline text page, as a one-page job makes them), on jobs
  inserted directly in ``queued``;
* ``job``: ``runner.conversion_job_execute`` on one-page PDFs accepted through the service layer
  (no broker: the fast-path publish is a no-op), with the converter sandbox on and
  ``QUIRE_CONVERTER_REUSE=tenant`` unless set otherwise.

Printed per job after ``--warm`` untimed jobs: wall, CPU of this process (``statements``) or of
its process tree incl. the fork server and converter children (``job``), CPU of this process's
Postgres backend (``/proc/<pid>/stat`` of ``pg_backend_pid()``: Postgres runs on this host) and
the number of WAL flushes the whole server made meanwhile (``pg_stat_wal.wal_sync``; other
sessions' flushes count too). Its own database (``quire_inproc`` + this checkout's suffix) is
created and dropped. Run a base tree and a changed tree alternately, with ``PYTHONPATH`` set to
each, to compare.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._common import (  # noqa: E402
    bench_db_name,
    drop_database,
    load_average,
    recreate_database,
    tree_cpu_s,
)


def _ticks_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--what", choices=("statements", "job"), default="statements")
    parser.add_argument("--n", type=int, default=500)
    parser.add_argument("--warm", type=int, default=20)
    args = parser.parse_args()
    name = bench_db_name("quire_inproc")
    url = recreate_database(name)
    scratch = Path(tempfile.mkdtemp(prefix="quire-inproc-"))
    env = {
        **os.environ,
        "DATABASE_URL": url,
        "QUIRE_VAR_DIR": str(scratch),
        "QUIRE_TENANT_QUOTA": "1000000",
        "QUIRE_GLOBAL_CAPACITY": "1000000",
        "DJANGO_SETTINGS_MODULE": "project.settings",
    }
    env.setdefault("QUIRE_CONVERTER_REUSE", "tenant")
    try:
        subprocess.run(
            [sys.executable, str(ROOT / "manage.py"), "migrate", "-v0"], env=env, check=True
        )
        child = [sys.executable, __file__, "--_run", args.what, str(args.n), str(args.warm)]
        subprocess.run(child, env=env, check=True)
    finally:
        drop_database(name)
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


def _run(what: str, n: int, warm: int) -> None:
    import django

    django.setup()
    from django.conf import settings
    from django.db import connection
    from django.utils import timezone

    from conversion_jobs import converters, storage
    from conversion_jobs.models import ConversionJob, PageCheckpoint, PageState
    from conversion_jobs.services import broker, execution
    from conversion_jobs.services.acceptance import StagedUpload, conversion_job_accept
    from conversion_jobs.services.checkpoints import INLINE_PREFIX
    from conversion_jobs.services.runner import conversion_job_execute
    from conversion_jobs.states import State
    from tests import testdocs

    broker.publish_conversion = lambda **_: None  # type: ignore[assignment]

    def queued() -> ConversionJob:
        sha = uuid.uuid4().hex * 2
        return ConversionJob.objects.create(
            tenant="bench",
            state=State.QUEUED,
            source_key=f"sources/{sha[:2]}/{sha}",
            source_sha256=sha,
            source_size=10,
            source_media_type="application/pdf",
            output="text",
            options={"dpi": None, "pages": None, "allow_partial": True},
            options_digest=uuid.uuid4().hex,
            queued_at=timezone.now(),
        )

    def accepted() -> ConversionJob:
        folder = Path(settings.QUIRE["WORK_DIR"]).parent / "docs"
        folder.mkdir(parents=True, exist_ok=True)
        salt = uuid.uuid4().hex
        pdf = testdocs.make_pdf(folder / f"{salt}.pdf", pages=1, text_of=lambda p: f"{p} {salt}")
        fh, staged = storage.stage()
        with fh, open(pdf, "rb") as data:
            shutil.copyfileobj(data, fh)
        pdf.unlink()
        sha, size = storage.sha256_file(staged)
        return conversion_job_accept(
            tenant="bench",
            actor="bench",
            upload=StagedUpload(path=staged, sha256=sha, size=size),
            output="text",
            raw_options=None,
            idempotency_key=None,
        ).job

    def statements(job: ConversionJob) -> None:
        claim = execution.conversion_job_claim(job_id=job.id, generation=1, worker="bench:1")
        assert claim is not None
        text = b"Page 1 of a one-page document\n"
        key = storage.page_key(job_id=job.id, page=1, generation=1, ext="txt")
        page = PageCheckpoint(
            job_id=job.id,
            page_number=1,
            state=PageState.DONE,
            attempts=1,
            artifact_key=INLINE_PREFIX + key,
            artifact_sha256=hashlib.sha256(text).hexdigest(),
            artifact_size=len(text),
            media_type="text/plain",
            generation=1,
            content=text,
        )
        result = execution.Result(
            key=INLINE_PREFIX + storage.result_key(job_id=job.id, generation=1, ext="txt"),
            sha256=page.artifact_sha256 or "",
            size=len(text),
            media_type="text/plain",
            pages_done=1,
            pages_failed=0,
            page_count=1,
        )
        assert execution.conversion_job_publish(
            lease=claim.lease, state=State.SUCCEEDED, result=result, checkpoints=[page]
        )

    def job_run(job: ConversionJob) -> None:
        assert conversion_job_execute(job_id=job.id, generation=job.generation) == "succeeded"

    make, run = (queued, statements) if what == "statements" else (accepted, job_run)
    if what == "job":
        converters.sandbox.configure(work_dir=settings.QUIRE["WORK_DIR"])
        converters.warm()
    if os.environ.get("BENCH_SETUP_SQL"):  # an experiment's schema change, e.g. a trigger off
        with connection.cursor() as cursor:
            cursor.execute(os.environ["BENCH_SETUP_SQL"])
    jobs = [make() for _ in range(n + warm)]
    for job in jobs[:warm]:
        run(job)
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        (backend,) = cursor.fetchone()

    def wal_syncs() -> int:
        with connection.cursor() as cursor:
            cursor.execute("SELECT wal_sync FROM pg_stat_wal")
            return int(cursor.fetchone()[0])

    def cpu() -> float:
        return time.process_time() if what == "statements" else tree_cpu_s(os.getpid())

    counted: dict[str, int] = {}
    if os.environ.get("BENCH_COUNT_STATEMENTS"):

        def count(execute, sql, params, many, context):  # type: ignore[no-untyped-def]
            head = " ".join(str(sql).split())[:90]
            counted[head] = counted.get(head, 0) + 1
            return execute(sql, params, many, context)

        connection.execute_wrappers.append(count)
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
        )
        (x0,) = cursor.fetchone()
    load = load_average()
    s0, w0, c0, p0 = wal_syncs(), time.perf_counter(), cpu(), _ticks_s(backend)
    own0 = time.process_time()
    if os.environ.get("BENCH_CPROFILE"):  # this process's own profile (cProfile, CPU clock)
        import cProfile

        profiler = cProfile.Profile(time.process_time)
        profiler.enable()
    for job in jobs[warm:]:
        run(job)
    if os.environ.get("BENCH_CPROFILE"):
        profiler.disable()
        profiler.dump_stats(os.environ["BENCH_CPROFILE"])
    w1, c1, p1, s1 = time.perf_counter(), cpu(), _ticks_s(backend), wal_syncs()
    own1 = time.process_time()
    if counted:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_stat_clear_snapshot()")
            cursor.execute(
                "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
            )
            (x1,) = cursor.fetchone()
            cursor.execute(
                "SELECT generic_plans, custom_plans, left(regexp_replace(statement, '\\s+', ' ',"
                " 'g'), 60) FROM pg_prepared_statements"
            )
            for generic, custom, text in cursor.fetchall():
                print(f"  prepared: generic {generic} custom {custom}  {text}")
        print(f"commits per job (pg_stat_database, lagging): {(x1 - x0) / n:.2f}")
        for head, times in sorted(counted.items(), key=lambda kv: -kv[1]):
            print(f"  {times / n:6.2f}/job  {head}")
    who = "this process" if what == "statements" else "worker tree"
    own = "" if what == "statements" else f" (this process {1000 * (own1 - own0) / n:.3f})"
    print(
        f"{what}: N={n}  wall {1000 * (w1 - w0) / n:.2f} ms/job  {who} CPU "
        f"{1000 * (c1 - c0) / n:.3f}{own} ms/job  postgres backend CPU {1000 * (p1 - p0) / n:.3f} "
        f"ms/job  server WAL flushes {(s1 - s0) / n:.2f}/job  load at start {load}"
    )


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--_run":
        _run(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        sys.exit(0)
    sys.exit(main())
