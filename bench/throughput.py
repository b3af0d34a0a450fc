"""Worker throughput: N one-page PDF -> text Quire jobs vs the plain Celery task a team would
otherwise write, and vs a Celery no-op; same broker settings, same PDFs, same run (issues 3, 12).

    .venv/bin/python bench/throughput.py [--n 2000] [--layout 1x2|2x1] [--accept-threads 4]
                                         [--reuse attempt[,tenant]] [--history N]
                                         [--sandbox both|on|off] [--child-starts 300]
                                         [--storage filesystem|s3] [--profile DIR]

What runs:

* a fresh Postgres database ``quire_tp`` and a throwaway RabbitMQ vhost with the production
  topology (``deploy/rabbitmq/definitions.json``); Quire processes use the least-privilege users;
* phase **celery** (baseline): ``--n`` messages published with confirms (persistent, a durable
  quorum queue ``bench.noop``) by a bare Celery app (``bench/noop_celery.py``: acks_late,
  prefetch 1, results ignored), *then* a worker started with the Procfile ``worker`` command's
  flags (``-E``, ``--prefetch-multiplier 1``, …), only ``-A`` / ``-Q`` changed; the task is a
  no-op that appends its start / finish time to a per-process file;
* phase **plain celery** (the peer of docs/TEST_STRATEGY.md §6.1): the same ``--n`` PDFs, each a
  message to ``bench.convert`` (``bench/noop_celery.py``) on a quorum queue ``bench.plain`` with the
  same publish and worker settings: in-process pypdfium2, the text written to a file, one UPDATE of
  the job's row in a table ``bench_plain_job`` of the same database;
* phase **quire**: the same ``--n`` one-page PDFs (text output) accepted through the
  service layer (``conversion_job_accept``, as tests/e2e/conftest.py ``submit``; its on_commit
  fast path publishes each), all accepted *before* any worker starts; then ``beat``,
  ``sweeper`` and the ``worker`` from the Procfile (production settings) run them to the end.

``--layout 1x2`` (default): one worker process with ``WORKER_CONCURRENCY=2`` (two pool
processes); ``2x1``: two worker processes with one pool process each. Both phases use the same.

Measured window, both phases: first task start (Quire: the first ``conversion_attempt.started_at``;
Celery: the first task's start) to the last completion (Quire: the last
``conversion_job.finished_at``; Celery: the last task's finish). Worker boot is outside it and
printed separately. jobs/s = N / window. Printed: Quire / plain Celery (target >= 0.3 with a
fresh sandboxed child per attempt, >= 0.6 with converter reuse within a tenant) and
Quire / no-op.

Converter sandbox (issue 10, docs/adr/0013-converter-sandbox.md): ``--sandbox both`` (default)
adds a Quire phase with ``QUIRE_SANDBOX=off`` for the first reuse mode; the ratio on / off has a
target of >= 0.9. Before the phases, ``--child-starts`` converter children are started in this
process with each setting, and their start (spawn from the fork server + setup) and end (kill +
reap + group check) times are printed as p50 / p99.

``--reuse``: the converter reuse modes to run a Quire phase in (each as its own tenant, its
workers started with ``QUIRE_CONVERTER_REUSE=<mode>``). ``attempt`` is today's behaviour; the
``tenant`` mode is the hook for converter reuse within a tenant (issue 12 point 4): until that
setting exists it runs exactly like ``attempt``.

``--storage s3`` (issue 14) adds a Quire phase for the first reuse mode with every artifact in a
real S3 server (SeaweedFS, ``tests/s3server.py``, started on free loopback ports): sources are
put there by this process's acceptance, pages and results by the workers; the ratio
s3 / filesystem has a target of >= 0.8.

``--profile DIR`` attaches ``py-spy record`` (non-blocking, 200 Hz, subprocesses followed) to
every process of each Quire phase: ``DIR/<phase>/{worker0,sweeper,beat}.raw.txt`` (collapsed
stacks; speedscope and flamegraph.pl read them) and ``….top.txt`` (busiest functions, inclusive
and self). Sampling costs CPU itself: compare CPU per job only between runs without it.

``--history N`` runs last (its seed stays in the database): the first reuse mode's Quire phase
again with N finished jobs in the tables (``bench/history.py``); ratio to the empty-table phase,
target >= 0.9.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as c
import kombu.pools

DB_NAME = c.bench_db_name("quire_tp")
#: Quire with the converter sandbox on / off (issue 10, docs/adr/0013-converter-sandbox.md).
TARGET_SANDBOX_RATIO = 0.9
#: Quire / plain Celery conversion task, per converter reuse mode (docs/TEST_STRATEGY.md §6.1).
TARGETS = {"attempt": 0.3, "tenant": 0.6}


@dataclass
class Phase:
    name: str
    n: int
    done: int = 0
    first_start: float = float("nan")
    last_finish: float = float("nan")
    boot_to_last_s: float = float("nan")
    worker_cpu_s: float = float("nan")
    #: worker CPU from the first claim on (boot excluded; Quire phases only)
    steady_cpu_s: float = float("nan")
    machine_cpu_s: float = float("nan")
    rabbitmq_cpu_s: float = float("nan")
    notes: list[str] = field(default_factory=list)

    @property
    def window_s(self) -> float:
        return self.last_finish - self.first_start

    @property
    def per_s(self) -> float:
        return self.done / self.window_s if self.window_s > 0 else float("nan")


def _cpu() -> tuple[float, float]:
    """(machine busy CPU seconds, RabbitMQ CPU seconds). Postgres backends come and go, so a
    per-process Postgres sum would not be monotonic; the machine figure includes it (and
    whatever else runs on this shared host)."""
    busy, _ = c.machine_cpu()
    return busy / c.CLK_TCK, sum(c.proc_cpu_s(p) for p in c.pids_named("beam.smp"))


def _worker_argv(layout_concurrency: str, hostname: str, queue: str) -> list[str]:
    """The Procfile worker command with this app and queue."""
    cmd = c.procfile_command("worker")
    cmd = cmd[cmd.index("celery ") :]  # without the ``env VAR=…`` prefix (Quire's broker URLs)
    cmd = cmd.replace("-A project", "-A bench.noop_celery").replace(
        "-Q conversion.v1", f"-Q {queue}"
    )
    # the slots alone: the baseline app has no spare pool process (ADR 0022, "Stepping aside")
    cmd = cmd.replace(
        "$(( ${WORKER_CONCURRENCY:-2} + ${QUIRE_WORKER_SPARES:-1} ))", layout_concurrency
    )
    cmd = cmd.replace("worker.%h.${PORT:-0}", hostname)
    argv = shlex.split(cmd)
    argv[0] = str(c.VENV_BIN / "celery")
    return argv


def make_pdfs(n: int, directory: Path) -> list[Path]:
    """``n`` distinct one-page PDFs (both phases convert these very files)."""
    from tests import testdocs

    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        path = directory / f"doc-{i:06d}.pdf"
        salt = uuid.uuid4().hex
        testdocs.make_pdf(path, pages=1, text_of=lambda page, salt=salt: f"Page {page} {salt}")
        paths.append(path)
    return paths


def phase_celery(
    *,
    stack: c.Stack,
    name: str,
    task: str,
    queue: str,
    args: list[list[str]],
    procs: int,
    concurrency: int,
    timeout: float,
    extra_env: dict[str, str] | None = None,
) -> Phase:
    from tests.e2e import harness

    n = len(args)
    phase = Phase(name=name, n=n)
    c._rabbitmqctl("set_permissions", "-p", stack.vhost, "guest", ".*", ".*", ".*")
    broker = f"amqp://guest:guest@127.0.0.1:5672/{stack.vhost}"
    done_dir = Path(tempfile.mkdtemp(prefix="noop-", dir=stack.storage))
    os.environ["BENCH_BROKER_URL"] = broker
    import noop_celery

    # Celery prefers $CELERY_BROKER_URL (here: Quire's publisher) over the app's own setting.
    quire_broker = os.environ.pop("CELERY_BROKER_URL", None)
    try:
        noop_celery.app.conf.broker_url = broker
        t0 = time.perf_counter()
        for task_args in args:
            noop_celery.app.send_task(
                task, args=task_args, queue=queue, routing_key=queue, retry=False
            )
        publish_s = time.perf_counter() - t0
        noop_celery.app.pool.force_close_all()
        # The next phase publishes through a fresh pool (kombu and Celery keep the closed one).
        kombu.pools.reset()
        noop_celery.app._pool = None
        noop_celery.app.amqp._producer_pool = None
    finally:
        if quire_broker is not None:
            os.environ["CELERY_BROKER_URL"] = quire_broker
    phase.notes.append(
        f"published {n} messages with confirms in {publish_s:.1f} s ({n / publish_s:.0f}/s)"
    )
    env = {
        k: v
        for k, v in c.base_env().items()
        if not k.startswith(("CELERY_", "DATABASE_URL", "QUIRE_", "DJANGO_SETTINGS"))
    }
    env.update(PYTHONPATH=str(c.ROOT), BENCH_BROKER_URL=broker, BENCH_DONE_DIR=str(done_dir))
    env.update(extra_env or {})
    workers: list[harness.Proc] = []
    boot = time.time()
    cpu0 = _cpu()
    for i in range(procs):
        log = stack.storage / "logs" / f"noop{i}.log"
        with open(log, "ab") as out:
            popen = subprocess.Popen(
                _worker_argv(str(concurrency), f"{queue}{i}.%h", queue),
                cwd=c.ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        workers.append(harness.Proc(kind="noop", name=f"noop{i}", popen=popen, log=log))
    try:
        deadline = time.monotonic() + timeout
        lines: list[str] = []
        while time.monotonic() < deadline:
            lines = [ln for f in done_dir.glob("done-*.txt") for ln in f.read_text().splitlines()]
            if len(lines) >= n:
                break
            for w in workers:
                if w.popen.poll() is not None:
                    raise RuntimeError(f"{w.name} exited:\n{w.tail()}")
            time.sleep(0.2)
        cpu1 = _cpu()
        phase.worker_cpu_s = sum(c.tree_cpu_s(w.pid) for w in workers)
    finally:
        for w in workers:
            w.stop(timeout=10)
    stamps = [tuple(map(float, ln.split())) for ln in lines if ln.count(" ") == 1]
    phase.done = len(stamps)
    if stamps:
        phase.first_start = min(s for s, _ in stamps)
        phase.last_finish = max(f for _, f in stamps)
        phase.boot_to_last_s = phase.last_finish - boot
    phase.machine_cpu_s, phase.rabbitmq_cpu_s = cpu1[0] - cpu0[0], cpu1[1] - cpu0[1]
    return phase


def phase_plain(
    *, stack: c.Stack, pdfs: list[Path], procs: int, concurrency: int, timeout: float
) -> Phase:
    """The plain Celery conversion task over the same PDFs, marking rows of its own table."""
    import psycopg

    jobs = [(str(uuid.uuid4()), str(p)) for p in pdfs]
    with psycopg.connect(stack.db_url, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE bench_plain_job (id uuid PRIMARY KEY, source text NOT NULL,"
            " state text NOT NULL DEFAULT 'queued', text_path text, finished_at timestamptz)"
        )
        with conn.cursor().copy("COPY bench_plain_job (id, source) FROM STDIN") as copy:
            for row in jobs:
                copy.write_row(row)
    phase = phase_celery(
        stack=stack,
        name="plain celery",
        task="bench.convert",
        queue="bench.plain",
        args=[list(j) for j in jobs],
        procs=procs,
        concurrency=concurrency,
        timeout=timeout,
        extra_env={"BENCH_DB_URL": stack.db_url},
    )
    done = c.sql_scalar(stack.db_url, "SELECT count(*) FROM bench_plain_job WHERE state = 'done'")
    phase.notes.append(f"{done}/{len(jobs)} rows marked done by the task's UPDATE")
    return phase


#: ``--source``: the jobs' sources inline in Postgres (True) or in the artifact store (False)
SOURCE_INLINE = {"inline": True, "stored": False}
_source_inline = True


def _accept_all(*, pdfs: list[Path], threads: int, tenant: str) -> float:
    from django.db import connection

    def batch(paths: list[Path]) -> None:
        try:
            for path in paths:
                c.accept_file(path, tenant=tenant, inline=_source_inline)
        finally:
            connection.close()

    shares = [pdfs[i::threads] for i in range(threads)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        for f in [pool.submit(batch, share) for share in shares if share]:
            f.result()
    return time.perf_counter() - t0


def phase_quire(
    *,
    stack: c.Stack,
    pdfs: list[Path],
    reuse: str,
    tenant: str,
    procs: int,
    concurrency: int,
    accept_threads: int,
    timeout: float,
    sandbox: str = "on",
    name: str | None = None,
    env: dict[str, str] | None = None,
    profile: Path | None = None,
) -> Phase:
    """Accept ``pdfs`` as ``tenant``'s jobs, then start beat, sweeper and workers (converter reuse
    mode ``reuse``) and time them to the last finish; everything counted is ``tenant``'s, so
    phases can share a database (and its history). The processes are stopped at the end.
    ``env``: extra settings of every process of the phase (e.g. the S3 store's)."""
    n = len(pdfs)
    env = env or {}
    phase = Phase(name=name or f"quire[{reuse}]" + ("" if sandbox == "on" else " sandbox off"), n=n)
    accept_s = _accept_all(pdfs=pdfs, threads=accept_threads, tenant=tenant)
    unpublished = _scalar(
        stack.db_url,
        "SELECT count(*) FROM conversion_outbox WHERE published_at IS NULL"
        " AND job_id IN (SELECT id FROM conversion_job WHERE tenant = %(tenant)s)",
        tenant,
    )
    phase.notes.append(
        f"accepted {n} jobs through the service layer in {accept_s:.1f} s "
        f"({n / accept_s:.0f}/s, {accept_threads} threads); outbox rows unpublished: {unpublished}"
    )
    beat = stack.start("beat", **env)
    sweeper = stack.start("sweeper", **env)
    boot = time.time()
    cpu0 = _cpu()
    workers = [
        stack.start(
            "worker",
            ready=False,
            WORKER_CONCURRENCY=str(concurrency),
            QUIRE_CONVERTER_REUSE=reuse,
            QUIRE_SANDBOX=sandbox,
            **env,
        )
        for _ in range(procs)
    ]
    profiler = None
    if profile is not None:
        from _profile import Profiler

        slug = "".join(ch if ch.isalnum() else "_" for ch in phase.name).strip("_")
        profiler = Profiler(profile / slug)
        profiler.attach("beat", beat.pid)  # type: ignore[attr-defined]
        profiler.attach("sweeper", sweeper.pid)  # type: ignore[attr-defined]
        for i, w in enumerate(workers):
            profiler.attach(f"worker{i}", w.pid)  # type: ignore[attr-defined]
    deadline = time.monotonic() + timeout
    # Boot (imports, Django set-up, fork server) is a fixed cost that a small --n spreads over
    # few jobs: the steady figure counts worker CPU from the first claim on.
    booted_cpu = float("nan")
    while time.monotonic() < deadline:
        if any(w.popen.poll() is not None for w in workers):  # type: ignore[attr-defined]
            break
        claimed = _scalar(
            stack.db_url,
            "SELECT EXISTS (SELECT 1 FROM conversion_attempt WHERE job_id IN"
            " (SELECT id FROM conversion_job WHERE tenant = %(tenant)s))",
            tenant,
        )
        if claimed:
            booted_cpu = sum(c.tree_cpu_s(w.pid) for w in workers)  # type: ignore[attr-defined]
            break
        time.sleep(0.05)
    terminal = 0
    while time.monotonic() < deadline:
        terminal = int(
            _scalar(
                stack.db_url,
                "SELECT count(*) FROM conversion_job"
                " WHERE finished_at IS NOT NULL AND tenant = %(tenant)s",
                tenant,
            )
            or 0
        )
        if terminal >= n:
            break
        time.sleep(0.5)
    cpu1 = _cpu()
    phase.worker_cpu_s = sum(c.tree_cpu_s(w.pid) for w in workers)  # type: ignore[attr-defined]
    phase.steady_cpu_s = phase.worker_cpu_s - booted_cpu
    phase.machine_cpu_s, phase.rabbitmq_cpu_s = cpu1[0] - cpu0[0], cpu1[1] - cpu0[1]
    phase.done = terminal
    if profiler is not None:
        for summary in profiler.stop():
            phase.notes.append(f"profile: {summary}")
    stack.cluster.stop_all()  # type: ignore[attr-defined]
    import psycopg

    params = {"tenant": tenant}
    with psycopg.connect(stack.db_url) as conn:
        first_start, attempts = conn.execute(
            "SELECT extract(epoch FROM min(started_at)), count(*) FROM conversion_attempt"
            " WHERE job_id IN (SELECT id FROM conversion_job WHERE tenant = %(tenant)s)",
            params,
        ).fetchone()
        last_finish, succeeded = conn.execute(
            "SELECT extract(epoch FROM max(finished_at)),"
            " count(*) FILTER (WHERE state = 'succeeded')"
            " FROM conversion_job WHERE tenant = %(tenant)s",
            params,
        ).fetchone()
        outbox = conn.execute(
            "SELECT count(*) FROM conversion_outbox"
            " WHERE job_id IN (SELECT id FROM conversion_job WHERE tenant = %(tenant)s)",
            params,
        ).fetchone()[0]
    phase.first_start, phase.last_finish = float(first_start), float(last_finish)
    phase.boot_to_last_s = phase.last_finish - boot
    phase.notes.append(
        f"{succeeded}/{n} succeeded, {attempts} attempts (a re-run would show > {n}), "
        f"{outbox} outbox rows"
    )
    return phase


def _scalar(url: str, query: str, tenant: str) -> object:
    """One value of ``query`` (parameter ``tenant``), retried while Postgres is unreachable."""
    import psycopg

    deadline = time.monotonic() + 120
    while True:
        try:
            with psycopg.connect(url, autocommit=True) as conn:
                row = conn.execute(query, {"tenant": tenant}).fetchone()
                return row[0] if row else None
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def child_starts(*, n: int, mode: str) -> str:
    """Start ``n`` converter children (spawn + setup + the first answer, which the setup rides
    on) and end them (kill + reap), sandbox ``mode``; one line with p50 / p99 of each, in ms."""
    if str(c.ROOT) not in sys.path:
        sys.path.insert(0, str(c.ROOT))
    from conversion_jobs.converters import Limits, sandbox, sessions
    from conversion_jobs.converters.isolation import ChildSession

    os.environ[sandbox.MODE_ENV] = mode
    scratch = Path(tempfile.mkdtemp(prefix="quire-bench-starts-"))
    sandbox.configure(work_dir=scratch / "work")
    starts, ends = [], []
    try:
        # The fork server starts and preloads (its first answer comes after), not on the clock.
        ChildSession().close()
        for _ in range(n):
            t0 = time.perf_counter()
            session = ChildSession()
            session.setup(limits=Limits(), scratch_dir=scratch)
            # the setup travels with the first request: a child is started once it answered
            session.call("probe", {}, timeout_s=60, should_stop=lambda: False)
            t1 = time.perf_counter()
            session.close()
            t2 = time.perf_counter()
            starts.append((t1 - t0) * 1000)
            ends.append((t2 - t1) * 1000)
    finally:
        sessions.release_all()
        os.environ.pop(sandbox.MODE_ENV, None)
        import shutil

        shutil.rmtree(scratch, ignore_errors=True)
    return (
        f"child start (spawn + setup + first answer), sandbox {mode:<3}: "
        f"p50 {_percentile(starts, 0.5):6.2f} ms"
        f"  p99 {_percentile(starts, 0.99):6.2f} ms;  end (kill + reap): p50 "
        f"{_percentile(ends, 0.5):6.2f} ms  p99 {_percentile(ends, 0.99):6.2f} ms  (n={n})"
    )


def report(*, phases: list[Phase], load: str, layout: str, n: int) -> None:
    print()
    print(
        f"throughput: N={n}, layout {layout} (worker processes x pool processes); "
        f"load average at start {load}"
    )
    print()
    header = (
        f"{'phase':<28} {'done':>6} {'window s':>9} {'jobs/s':>8} {'boot->last s':>13} "
        f"{'worker CPU ms/job':>18} {'steady ms/job':>14} {'machine ms/job':>15} "
        f"{'rabbitmq ms/job':>16}"
    )
    print(header)
    print("-" * len(header))
    for p in phases:
        per = 1000 / p.done if p.done else float("nan")
        print(
            f"{p.name:<28} {p.done:>6} {p.window_s:>9.2f} {p.per_s:>8.1f} "
            f"{p.boot_to_last_s:>13.2f} {p.worker_cpu_s * per:>18.2f} "
            f"{p.steady_cpu_s * per:>14.2f} "
            f"{p.machine_cpu_s * per:>15.2f} {p.rabbitmq_cpu_s * per:>16.2f}"
        )
    print(
        "(CPU from worker spawn to the last completion. worker: the worker trees incl. reaped "
        "converter children, boot included; steady: the same from the first claim on, boot "
        "excluded (Quire phases); machine: all busy CPU of the shared host, Postgres included)"
    )
    for p in phases:
        for note in p.notes:
            print(f"  {p.name}: {note}")
    by = {p.name: p for p in phases}
    print()
    for mode, target in TARGETS.items():
        quire = by.get(f"quire[{mode}]")
        if quire is None:
            continue
        if "plain celery" in by:
            ratio = quire.per_s / by["plain celery"].per_s
            print(c.ratio_line(f"quire[{mode}] / plain celery task", ratio, target))
        if "celery no-op" in by:
            print(
                f"ratio {f'quire[{mode}] / celery no-op':<42} "
                f"{quire.per_s / by['celery no-op'].per_s:6.3f}   (no target)"
            )
    for mode in TARGETS:
        base = by.get(f"quire[{mode}]")
        if base is None:
            continue
        for suffix, label, target in (
            (" sandbox off", "sandbox on / off", TARGET_SANDBOX_RATIO),
            (" s3", "s3 / filesystem", c.S3_TARGET),
        ):
            other = by.get(f"quire[{mode}]{suffix}")
            if other is None:
                continue
            ratio = (base.per_s / other.per_s) if "sandbox" in suffix else other.per_s / base.per_s
            print(c.ratio_line(f"quire[{mode}] {label}", ratio, target))
    for p in phases:
        if "+" in p.name and p.name.split("+")[0] in by:
            ratio = p.per_s / by[p.name.split("+")[0]].per_s
            label = f"{p.name} / {p.name.split('+')[0]} (empty tables)"
            print(c.ratio_line(label, ratio, c.HISTORY_TARGET))
    print(f"load average at end {c.load_average()}")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=2000, help="jobs / messages per phase")
    parser.add_argument("--layout", choices=["1x2", "2x1"], default="1x2")
    parser.add_argument("--accept-threads", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per phase")
    parser.add_argument("--skip-baseline", action="store_true", help="no Celery phases")
    parser.add_argument(
        "--reuse", default="attempt", help="converter reuse modes, comma-separated: attempt,tenant"
    )
    parser.add_argument(
        "--history",
        type=int,
        default=0,
        help="also run the first reuse mode's Quire phase on a database holding this many "
        "finished jobs (bench/history.py) and print its ratio to the empty-table phase",
    )
    parser.add_argument("--keep", action="store_true", help="keep the database, storage, logs")
    parser.add_argument(
        "--sandbox",
        choices=["both", "on", "off"],
        default="both",
        help="converter sandbox of the Quire phases (both: on, plus one phase with it off)",
    )
    parser.add_argument(
        "--child-starts", type=int, default=300, help="converter child starts timed per setting"
    )
    parser.add_argument(
        "--storage",
        choices=["filesystem", "s3"],
        default="filesystem",
        help="s3: add the first reuse mode's Quire phase with the artifacts in S3 (SeaweedFS)",
    )
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="py-spy every Quire process of each phase (worker trees, sweeper, beat) into "
        "DIR/<phase>/: raw collapsed stacks (speedscope reads them) and a top-frames summary",
    )
    parser.add_argument(
        "--source",
        choices=sorted(SOURCE_INLINE),
        default="inline",
        help="the jobs' sources: inline in Postgres (ADR 0017 session 10) or in the store",
    )
    args = parser.parse_args()
    global _source_inline
    _source_inline = SOURCE_INLINE[args.source]
    procs, concurrency = (int(x) for x in args.layout.split("x"))
    modes = [m for m in args.reuse.split(",") if m]
    if unknown := set(modes) - set(TARGETS):
        parser.error(f"unknown reuse mode(s): {', '.join(sorted(unknown))}")
    load = c.load_average()
    print(f"load average at start {load}", flush=True)
    sandboxes = ["on", "off"] if args.sandbox == "both" else [args.sandbox]
    starts = [child_starts(n=args.child_starts, mode=m) for m in sandboxes if args.child_starts]
    for line in starts:
        print(line, flush=True)
    phases: list[Phase] = []
    pdf_dir = Path(tempfile.mkdtemp(prefix="quire-tp-pdfs-"))
    common = {"procs": procs, "concurrency": concurrency, "timeout": args.timeout}
    qcommon = {**common, "profile": args.profile}
    try:
        # One database and vhost for every phase (this process's Django settings and Celery app
        # are bound to them); each Quire phase has its own tenant and its own processes.
        with c.quire_stack(db_name=DB_NAME, keep=args.keep) as stack:
            pdfs = make_pdfs(args.n, pdf_dir)
            if not args.skip_baseline:
                noop_args = [[str(uuid.uuid4()), "1"] for _ in range(args.n)]
                phases.append(
                    phase_celery(
                        stack=stack,
                        name="celery no-op",
                        task="bench.noop",
                        queue="bench.noop",
                        args=noop_args,
                        **common,
                    )
                )
                print(f"celery no-op phase done: {phases[-1].per_s:.1f}/s", flush=True)
                phases.append(phase_plain(stack=stack, pdfs=pdfs, **common))
                print(f"plain celery phase done: {phases[-1].per_s:.1f}/s", flush=True)
            for mode in modes:
                with contextlib.suppress(KeyboardInterrupt):
                    phases.append(
                        phase_quire(
                            stack=stack,
                            pdfs=pdfs,
                            reuse=mode,
                            tenant=f"bench-{mode}",
                            accept_threads=args.accept_threads,
                            sandbox=sandboxes[0],
                            **qcommon,
                        )
                    )
                print(f"{phases[-1].name} phase done: {phases[-1].per_s:.1f}/s", flush=True)
            if "off" in sandboxes and sandboxes[0] == "on":
                phases.append(
                    phase_quire(
                        stack=stack,
                        pdfs=pdfs,
                        reuse=modes[0],
                        tenant=f"bench-{modes[0]}-sandbox-off",
                        accept_threads=args.accept_threads,
                        sandbox="off",
                        **qcommon,
                    )
                )
                print(f"{phases[-1].name} phase done: {phases[-1].per_s:.1f}/s", flush=True)
            if args.storage == "s3":
                with c.s3_server(stack.storage) as s3_env, c.storage_in_process(s3_env):
                    phases.append(
                        phase_quire(
                            stack=stack,
                            pdfs=pdfs,
                            reuse=modes[0],
                            tenant=f"bench-{modes[0]}-s3",
                            accept_threads=args.accept_threads,
                            sandbox=sandboxes[0],
                            name=f"quire[{modes[0]}] s3",
                            env=s3_env,
                            **qcommon,
                        )
                    )
                print(f"{phases[-1].name} phase done: {phases[-1].per_s:.1f}/s", flush=True)
            if args.history:
                seed_s = c.seed_history_db(stack.db_url, args.history)
                phase = phase_quire(
                    stack=stack,
                    pdfs=pdfs,
                    reuse=modes[0],
                    tenant="bench-history",
                    accept_threads=args.accept_threads,
                    sandbox=sandboxes[0],
                    **qcommon,
                )
                phase.name = f"quire[{modes[0]}]+{args.history // 1000}k"
                phase.notes.append(f"{args.history} finished jobs seeded in {seed_s:.0f} s first")
                phases.append(phase)
                print(f"{phase.name} phase done: {phase.per_s:.1f}/s", flush=True)
    finally:
        import shutil

        shutil.rmtree(pdf_dir, ignore_errors=True)
    report(phases=phases, load=load, layout=args.layout, n=args.n)
    for line in starts:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
