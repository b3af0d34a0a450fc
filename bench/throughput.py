"""Worker throughput: N trivial Quire jobs vs N plain-Celery no-op tasks, same broker, same run
(issue 3, performance).

    .venv/bin/python bench/throughput.py [--n 5000] [--layout 1x2|2x1] [--accept-threads 4]
        [--sandbox both|on|off] [--child-starts 300]

What runs:

* a fresh Postgres database ``quire_tp`` and a throwaway RabbitMQ vhost with the production
  topology (``deploy/rabbitmq/definitions.json``); Quire processes use the least-privilege users;
* phase **celery** (baseline): ``--n`` messages published with confirms (persistent, a durable
  quorum queue ``bench.noop``) by a bare Celery app (``bench/noop_celery.py``: acks_late,
  prefetch 1, results ignored), *then* a worker started with the Procfile ``worker`` command's
  flags (``-E``, ``--prefetch-multiplier 1``, …), only ``-A`` / ``-Q`` changed; the task is a
  no-op that appends its start / finish time to a per-process file;
* phase **quire**: ``--n`` one-page PDFs (a few hundred bytes, text output) accepted through the
  service layer (``conversion_job_accept``, as tests/e2e/conftest.py ``submit``; its on_commit
  fast path publishes each), all accepted *before* any worker starts; then ``beat``,
  ``sweeper`` and the ``worker`` from the Procfile (production settings) run them to the end.

``--layout 1x2`` (default): one worker process with ``WORKER_CONCURRENCY=2`` (two pool
processes); ``2x1``: two worker processes with one pool process each. Both phases use the same.

Measured window, both phases: first task start (Quire: the first ``conversion_attempt.started_at``;
Celery: the first no-op's start) to the last completion (Quire: the last
``conversion_job.finished_at``; Celery: the last no-op's finish). Worker boot is outside it and
printed separately. jobs/s = N / window; the ratio Quire / Celery has a target of >= 0.7.

Converter sandbox (issue 10, docs/adr/0013-converter-sandbox.md): ``--sandbox both`` (default)
runs the quire phase twice in the same run, each in a fresh stack, with ``QUIRE_SANDBOX=on`` and
``=off``; the ratio on / off has a target of >= 0.9 (the Quire / Celery ratio uses the sandboxed
phase). Before the phases, ``--child-starts`` converter children are started in this process
with each setting, and their start (spawn from the fork server + setup: private directory,
limits) and end (kill + reap + group check) times are printed as p50 / p99.
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

DB_NAME = c.bench_db_name("quire_tp")
TARGET_RATIO = 0.7
TARGET_SANDBOX_RATIO = 0.9


@dataclass
class Phase:
    name: str
    n: int
    done: int = 0
    first_start: float = float("nan")
    last_finish: float = float("nan")
    boot_to_last_s: float = float("nan")
    worker_cpu_s: float = float("nan")
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


def _worker_argv(layout_concurrency: str, hostname: str) -> list[str]:
    """The Procfile worker command with this app and queue."""
    cmd = c.procfile_command("worker")
    cmd = cmd[cmd.index("celery ") :]  # without the ``env VAR=…`` prefix (Quire's broker URLs)
    cmd = cmd.replace("-A project", "-A bench.noop_celery").replace(
        "-Q conversion.v1", "-Q bench.noop"
    )
    cmd = cmd.replace("${WORKER_CONCURRENCY:-2}", layout_concurrency)
    cmd = cmd.replace("worker.%h.${PORT:-0}", hostname)
    argv = shlex.split(cmd)
    argv[0] = str(c.VENV_BIN / "celery")
    return argv


def phase_celery(*, stack: c.Stack, n: int, procs: int, concurrency: int, timeout: float) -> Phase:
    from tests.e2e import harness

    phase = Phase(name="celery no-op", n=n)
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
        for _ in range(n):
            noop_celery.app.send_task("bench.noop", args=[str(uuid.uuid4()), 1], retry=False)
        publish_s = time.perf_counter() - t0
        noop_celery.app.pool.force_close_all()
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
    workers: list[harness.Proc] = []
    boot = time.time()
    cpu0 = _cpu()
    for i in range(procs):
        log = stack.storage / "logs" / f"noop{i}.log"
        with open(log, "ab") as out:
            popen = subprocess.Popen(
                _worker_argv(str(concurrency), f"noop{i}.%h"),
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


def _accept_all(*, n: int, threads: int) -> float:
    from django.db import connection

    def batch(count: int) -> None:
        try:
            for _ in range(count):
                c.submit_job(tenant="bench")
        finally:
            connection.close()

    share = [n // threads + (1 if i < n % threads else 0) for i in range(threads)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        for f in [pool.submit(batch, k) for k in share if k]:
            f.result()
    return time.perf_counter() - t0


def phase_quire(
    *,
    stack: c.Stack,
    n: int,
    procs: int,
    concurrency: int,
    accept_threads: int,
    timeout: float,
    sandbox: str = "on",
    first: bool = True,
) -> Phase:
    """``n`` one-page jobs accepted, then run by ``procs`` workers with ``QUIRE_SANDBOX=sandbox``
    (stopped at the end). Only jobs created by this phase count (phases share one stack)."""
    phase = Phase(name=f"quire sandbox {sandbox}", n=n)
    since = c.sql_retry(stack.db_url, "SELECT extract(epoch FROM now())")
    mine = f"created_at >= to_timestamp({float(since):.6f})"
    accept_s = _accept_all(n=n, threads=accept_threads)
    unpublished = c.sql_scalar(
        stack.db_url,
        "SELECT count(*) FROM conversion_outbox o JOIN conversion_job j ON j.id = o.job_id"  # noqa: S608 - a number from Postgres
        f" WHERE o.published_at IS NULL AND j.{mine}",
    )
    phase.notes.append(
        f"accepted {n} jobs through the service layer in {accept_s:.1f} s "
        f"({n / accept_s:.0f}/s, {accept_threads} threads); outbox rows unpublished: {unpublished}"
    )
    if first:
        stack.start("beat")
        stack.start("sweeper")
    boot = time.time()
    cpu0 = _cpu()
    workers = [
        stack.start(
            "worker", ready=False, WORKER_CONCURRENCY=str(concurrency), QUIRE_SANDBOX=sandbox
        )
        for _ in range(procs)
    ]
    deadline = time.monotonic() + timeout
    terminal = 0
    while time.monotonic() < deadline:
        terminal = int(
            c.sql_retry(
                stack.db_url,
                f"SELECT count(*) FROM conversion_job WHERE finished_at IS NOT NULL AND {mine}",  # noqa: S608 - a number from Postgres
            )
            or 0
        )
        if terminal >= n:
            break
        time.sleep(0.5)
    cpu1 = _cpu()
    phase.worker_cpu_s = sum(c.tree_cpu_s(w.pid) for w in workers)  # type: ignore[attr-defined]
    phase.machine_cpu_s, phase.rabbitmq_cpu_s = cpu1[0] - cpu0[0], cpu1[1] - cpu0[1]
    phase.done = terminal
    for worker in workers:
        worker.stop()  # type: ignore[attr-defined]
    import psycopg

    with psycopg.connect(stack.db_url) as conn:
        first_start, attempts = conn.execute(
            "SELECT extract(epoch FROM min(a.started_at)), count(*) FROM conversion_attempt a"  # noqa: S608 - a number from Postgres
            f" JOIN conversion_job j ON j.id = a.job_id WHERE j.{mine}"
        ).fetchone()
        last_finish, succeeded = conn.execute(
            "SELECT extract(epoch FROM max(finished_at)),"  # noqa: S608 - a number from Postgres
            " count(*) FILTER (WHERE state = 'succeeded')"
            f" FROM conversion_job WHERE {mine}"
        ).fetchone()
    phase.first_start, phase.last_finish = float(first_start), float(last_finish)
    phase.boot_to_last_s = phase.last_finish - boot
    phase.notes.append(
        f"{succeeded}/{n} succeeded, {attempts} attempts (a re-run would show > {n})"
    )
    return phase


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def child_starts(*, n: int, mode: str) -> str:
    """Start ``n`` converter children (spawn + setup) and end them (kill + reap), sandbox
    ``mode``; one line with p50 / p99 of each, in ms."""
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
            session.setup(limits=Limits(), scratch_dir=scratch, should_stop=lambda: False)
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
        f"child start (spawn + setup), sandbox {mode:<3}: p50 {_percentile(starts, 0.5):6.2f} ms"
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
        f"{'phase':<18} {'done':>6} {'window s':>9} {'jobs/s':>8} {'boot->last s':>13} "
        f"{'worker CPU ms/job':>18} {'machine ms/job':>15} {'rabbitmq ms/job':>16}"
    )
    print(header)
    print("-" * len(header))
    for p in phases:
        per = 1000 / p.done if p.done else float("nan")
        print(
            f"{p.name:<18} {p.done:>6} {p.window_s:>9.2f} {p.per_s:>8.1f} "
            f"{p.boot_to_last_s:>13.2f} {p.worker_cpu_s * per:>18.2f} "
            f"{p.machine_cpu_s * per:>15.2f} {p.rabbitmq_cpu_s * per:>16.2f}"
        )
    print(
        "(CPU from worker spawn to the last completion. worker: the worker trees incl. reaped "
        "converter children, boot included; machine: all busy CPU of the shared host, Postgres "
        "included)"
    )
    for p in phases:
        for note in p.notes:
            print(f"  {p.name}: {note}")
    by = {p.name: p for p in phases}
    quire = by.get("quire sandbox on") or by.get("quire sandbox off")
    if quire is not None and "celery no-op" in by:
        ratio = quire.per_s / by["celery no-op"].per_s
        print()
        print(
            f"ratio {quire.name} / celery   {ratio:6.3f}   target >= {TARGET_RATIO}   "
            f"{c.verdict(ratio >= TARGET_RATIO)}"
        )
    if "quire sandbox on" in by and "quire sandbox off" in by:
        ratio = by["quire sandbox on"].per_s / by["quire sandbox off"].per_s
        print(
            f"ratio sandbox on / off   {ratio:6.3f}   target >= {TARGET_SANDBOX_RATIO}   "
            f"{c.verdict(ratio >= TARGET_SANDBOX_RATIO)}"
        )
    print(f"load average at end {c.load_average()}")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=5000, help="jobs / messages per phase")
    parser.add_argument("--layout", choices=["1x2", "2x1"], default="1x2")
    parser.add_argument("--accept-threads", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per phase")
    parser.add_argument("--skip-baseline", action="store_true")
    parser.add_argument("--keep", action="store_true", help="keep the database, storage, logs")
    parser.add_argument(
        "--sandbox",
        choices=["both", "on", "off"],
        default="both",
        help="converter sandbox setting(s) of the quire phase (both: on, then off)",
    )
    parser.add_argument(
        "--child-starts", type=int, default=300, help="converter child starts timed per setting"
    )
    args = parser.parse_args()
    procs, concurrency = (int(x) for x in args.layout.split("x"))
    load = c.load_average()
    print(f"load average at start {load}", flush=True)
    modes = ["on", "off"] if args.sandbox == "both" else [args.sandbox]
    starts = [child_starts(n=args.child_starts, mode=m) for m in modes if args.child_starts]
    for line in starts:
        print(line, flush=True)
    phases: list[Phase] = []
    # One stack for every phase (Django in this process is set up once); the quire phases only
    # count their own jobs and stop their workers.
    with c.quire_stack(db_name=DB_NAME, keep=args.keep) as stack:
        if not args.skip_baseline:
            phases.append(
                phase_celery(
                    stack=stack,
                    n=args.n,
                    procs=procs,
                    concurrency=concurrency,
                    timeout=args.timeout,
                )
            )
            print(f"celery phase done: {phases[-1].per_s:.1f}/s", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            for index, mode in enumerate(modes):
                phase = phase_quire(
                    stack=stack,
                    n=args.n,
                    procs=procs,
                    concurrency=concurrency,
                    accept_threads=args.accept_threads,
                    timeout=args.timeout,
                    sandbox=mode,
                    first=index == 0,
                )
                phases.append(phase)
                print(f"{phase.name} done: {phase.per_s:.1f}/s", flush=True)
    report(phases=phases, load=load, layout=args.layout, n=args.n)
    for line in starts:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
