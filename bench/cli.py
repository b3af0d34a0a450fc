"""The ``quire`` CLI (client/, issue 27): crash and re-run, and submit throughput, against a live
stack in the production profile.

    QUIRE_RMQ_VHOST=<your vhost> .venv/bin/python bench/cli.py [--files 300] [--corrupt 10]
        [--kills 3] [--concurrency 16] [--seed 27] [--throughput-files 600]
        [--skip-crash] [--skip-throughput]

What runs:

* a fresh Postgres database (``quire_bench_cli`` suffixed with the vhost's name, dropped and
  migrated here) and the vhost ``QUIRE_RMQ_VHOST`` (topology and users applied by
  deploy/rabbitmq/apply.sh; its queues are purged first, so it must be this checkout's own);
* the Procfile's ``web`` (WEB_CONCURRENCY=2), ``worker`` (2 slots), ``sweeper`` and ``beat``;
* **crash and re-run**: a directory of ``--files`` documents (PDF 1-3 pages, DOCX, PNG with
  text; ``--corrupt`` of them truncated PDFs, which the server accepts and fails with
  ``invalid_input``), all unique. After a warm-up (one file of each kind, its own tenant), one
  uninterrupted ``quire submit --concurrency N`` (tenant A) is timed; then the same directory
  for tenant B into a fresh output directory, the CLI killed with SIGKILL ``--kills`` times at
  random moments (uniform in 5-30 % of the uninterrupted time after each start) and re-run to
  completion. Checked: exactly ``--files`` jobs of tenant B in the database, every good file's
  output on disk with the sha256 the server recorded, every corrupt one listed with
  ``invalid_input``, exit code 2. Printed: the total wall time of the interrupted runs over the
  uninterrupted one (target <= 1.2);
* **throughput**: ``bench/accept.py --skip-baseline --skip-gthread --idle-polls 0 --replay 0``
  (its own database and vhost, 16 clients, one-page 10 KB PDFs) for the server's accept rate,
  then on a web-only server of the same shape (no worker, quota raised, as accept.py runs it)
  ``quire submit --concurrency 16 --json`` of ``--throughput-files`` unique one-page 10 KB PDFs:
  the submit rate is read from the ``submitted`` events between the 10th percentile and the
  last; target >= 0.8 x the accept rate.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _common as c

QUIRE = str(c.VENV_BIN / "quire")
VHOST = os.environ.get("QUIRE_RMQ_VHOST", "quire")
DB_NAME = c.bench_db_name("quire_bench_cli")
PUB = ("quire_publisher", os.environ.get("QUIRE_RMQ_PUBLISHER_PASSWORD", "quire-publisher-dev"))
WRK = ("quire_worker", os.environ.get("QUIRE_RMQ_WORKER_PASSWORD", "quire-worker-dev"))
TARGETS = {"crash_ratio": 1.2, "submit_ratio": 0.8}


def sha256_file(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def amqp(user: tuple[str, str]) -> str:
    return f"amqp://{user[0]}:{user[1]}@127.0.0.1:5672/{VHOST}"


def make_corpus(root: Path, *, files: int, corrupt: int, seed: int) -> list[str]:
    """``files`` unique documents; returns the names of the corrupt ones."""
    from tests import testdocs

    rng = random.Random(seed)
    root.mkdir(parents=True)
    bad = []
    for i in range(corrupt):
        name = f"damaged-{i:03d}.pdf"
        testdocs.make_truncated_pdf(root / name, pages=3 + i, keep_fraction=0.4 + 0.02 * i)
        bad.append(name)
    for i in range(files - corrupt):
        kind = rng.choices(["pdf", "docx", "png"], weights=[6, 2, 2])[0]
        tag = f"{seed}-{i}"
        if kind == "pdf":
            pages = rng.randint(1, 3)
            testdocs.make_pdf(
                root / f"doc-{i:03d}.pdf", pages=pages, text_of=lambda n, t=tag: f"Doc {t} p{n}"
            )
        elif kind == "docx":
            testdocs.make_docx(
                root / f"memo-{i:03d}.docx", paragraphs=[f"Memo {tag}", "Second line"]
            )
        else:
            testdocs.make_png(root / f"scan-{i:03d}.png", text=f"SCAN {tag}")
    return bad


class Stack:
    """The Procfile's processes on the bench database and this checkout's vhost."""

    def __init__(self, work: Path, db_url: str, *, kinds: tuple[str, ...], **extra: str) -> None:
        self.port = c.free_port()
        self.env = c.base_env(
            DATABASE_URL=db_url,
            QUIRE_BROKER_PUBLISHER_URL=amqp(PUB),
            QUIRE_BROKER_WORKER_URL=amqp(WRK),
            QUIRE_STORAGE_DIR=str(work / "storage"),
            QUIRE_WORK_DIR=str(work / "work"),
            QUIRE_VAR_DIR=str(work / "var"),
            PROMETHEUS_MULTIPROC_DIR=str(work / "metrics"),
            QUIRE_BIND=f"127.0.0.1:{self.port}",
            QUIRE_LOG_LEVEL="WARNING",
            QUIRE_LOG_FORMAT="text",
            WEB_CONCURRENCY="2",
            WEB_THREADS="8",
            WORKER_CONCURRENCY="2",
            **extra,
        )
        self.env.pop("DJANGO_SETTINGS_MODULE", None)
        (work / "metrics").mkdir(parents=True, exist_ok=True)
        self.work = work
        self.procs: list[subprocess.Popen[bytes]] = []
        for kind in kinds:
            role = WRK if kind in ("worker", "sweeper") else PUB
            env = {**self.env, "CELERY_BROKER_URL": amqp(role)}
            self.procs.append(c.start_procfile(kind, env=env, log=work / f"{kind}.log"))
        deadline = time.monotonic() + 90
        # a web without worker and beat is never "ready" (sweeps, sandbox): it must answer
        path = "/health/ready" if "beat" in kinds else "/health/live"
        while not _ready(self.port, path):
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the stack did not become ready; see {work}")
            time.sleep(0.5)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def token(self, tenant: str) -> str:
        return c.run(
            [
                c.PYTHON,
                "manage.py",
                "mint_token",
                "--tenant",
                tenant,
                "--ttl",
                "36000",
                "--scope",
                "jobs:submit",
                "jobs:read",
                "jobs:cancel",
            ],
            env=self.env,
        ).strip()

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _ready(port: int, path: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def timed_run(
    stack: Stack, tenant: str, argv: list[str], log: Path, *, kill_after: float | None
) -> tuple[float, int | None]:
    """One CLI run: (seconds, exit code; None when killed)."""
    token_env = {**os.environ, "QUIRE_URL": stack.url, "QUIRE_TOKEN": stack.token(tenant)}
    with open(log, "ab") as out:
        started = time.monotonic()
        proc = subprocess.Popen(
            [QUIRE, *argv],
            env=token_env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            code: int | None = proc.wait(timeout=kill_after)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
        return time.monotonic() - started, code


def crash_phase(args: argparse.Namespace, work: Path, db_url: str) -> dict[str, object]:
    corpus = work / "corpus"
    bad = make_corpus(corpus, files=args.files, corrupt=args.corrupt, seed=args.seed)
    warm = work / "warm"
    warm.mkdir()
    for name in (
        next(corpus.glob("doc-*.pdf")),
        next(corpus.glob("memo-*.docx")),
        next(corpus.glob("scan-*.png")),
    ):
        shutil.copy(name, warm / name.name)
    stack = Stack(work / "stack", db_url, kinds=("web", "worker", "sweeper", "beat"))
    try:
        argv = ["submit", "--output", "text", "--concurrency", str(args.concurrency)]
        seconds, code = timed_run(
            stack,
            "bench-warm",
            [*argv, str(warm), "--out", str(work / "out-warm")],
            work / "warm.log",
            kill_after=None,
        )
        print(f"warm-up: {seconds:.1f} s, exit {code}", flush=True)
        base_s, base_code = timed_run(
            stack,
            "bench-a",
            [*argv, str(corpus), "--out", str(work / "out-a")],
            work / "run-a.log",
            kill_after=None,
        )
        print(f"uninterrupted: {base_s:.1f} s, exit {base_code}", flush=True)
        rng = random.Random(args.seed)
        segments: list[tuple[float, int | None]] = []
        for _ in range(args.kills):
            at = rng.uniform(0.05, 0.30) * base_s
            seconds, code = timed_run(
                stack,
                "bench-b",
                [*argv, str(corpus), "--out", str(work / "out-b")],
                work / "run-b.log",
                kill_after=at,
            )
            segments.append((seconds, code))
            print(
                f"interrupted run: killed after {seconds:.1f} s"
                if code is None
                else f"run ended by itself after {seconds:.1f} s",
                flush=True,
            )
        seconds, final_code = timed_run(
            stack,
            "bench-b",
            [*argv, str(corpus), "--out", str(work / "out-b")],
            work / "run-b.log",
            kill_after=None,
        )
        segments.append((seconds, final_code))
        print(f"final run: {seconds:.1f} s, exit {final_code}", flush=True)
        total = sum(s for s, _ in segments)
        jobs = c.sql_scalar(db_url, "SELECT count(*) FROM conversion_job WHERE tenant = 'bench-b'")
        rows = _results(db_url, "bench-b")
        out = work / "out-b"
        good = [p for p in sorted(corpus.iterdir()) if p.name not in bad]
        verified = 0
        for src in good:
            result = out / f"{src.name}.txt"
            if result.is_file() and sha256_file(result) == rows.get(sha256_file(src)):
                verified += 1
        log = (work / "run-b.log").read_text(errors="replace").splitlines()
        # the final run's summary: its last "quire: n/m succeeded" line and what follows
        ends = [i for i, x in enumerate(log) if x.startswith("quire: ") and "succeeded" in x]
        summary = log[ends[-1] :] if ends else []
        listed = sum(1 for name in bad if any(name in x and "invalid_input" in x for x in summary))
        return {
            "uninterrupted_s": base_s,
            "interrupted_total_s": total,
            "segments": segments,
            "ratio": total / base_s,
            "jobs": jobs,
            "verified": verified,
            "good": len(good),
            "corrupt_listed": listed,
            "exit_code": final_code,
            "base_exit_code": base_code,
        }
    finally:
        stack.stop()


def _results(db_url: str, tenant: str) -> dict[str, str]:
    import psycopg

    with psycopg.connect(db_url) as conn:
        return {
            src: res
            for src, res in conn.execute(
                "SELECT source_sha256, result_sha256 FROM conversion_job WHERE tenant = %s",
                (tenant,),
            )
            if res
        }


def accept_rate(args: argparse.Namespace) -> float:
    out = c.run(
        [
            c.PYTHON,
            "bench/accept.py",
            "--skip-baseline",
            "--skip-gthread",
            "--idle-polls",
            "0",
            "--replay",
            "0",
            "--clients",
            str(args.concurrency),
            "--warm",
            "3",
            "--measure",
            "10",
        ],
        env=c.base_env(),
    )
    for line in out.splitlines():
        if line.startswith("accepted jobs/s"):
            return float(line.split()[2])
    raise RuntimeError(f"no accepted jobs/s in accept.py's output:\n{out}")


def submit_rate(args: argparse.Namespace, work: Path, db_url: str) -> tuple[float, float]:
    docs = work / "onepage"
    docs.mkdir(parents=True)
    template, slot = c.pdf_template(10 * 1024)
    for i in range(args.throughput_files):
        unique = f"{args.seed:08x}{time.time_ns() % 2**32:08x}{i:016x}".encode()
        (docs / f"p{i:05d}.pdf").write_bytes(template[:slot] + unique + template[slot + 32 :])
    stack = Stack(
        work / "web-only",
        db_url,
        kinds=("web",),
        QUIRE_TENANT_QUOTA=str(10**9),
        QUIRE_GLOBAL_CAPACITY=str(10**9),
    )
    try:
        env = {**os.environ, "QUIRE_URL": stack.url, "QUIRE_TOKEN": stack.token("bench-rate")}
        proc = subprocess.Popen(
            [
                QUIRE,
                "submit",
                str(docs),
                "--output",
                "text",
                "--out",
                str(work / "out-rate"),
                "--concurrency",
                str(args.concurrency),
                "--json",
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        stamps: list[float] = []
        cpu_at: list[float] = []
        assert proc.stdout is not None
        deadline = time.monotonic() + 300
        for line in proc.stdout:
            if json.loads(line).get("event") == "submitted":
                stamps.append(time.monotonic())
                if len(stamps) in (args.throughput_files // 10 + 1, args.throughput_files):
                    cpu_at.append(c.proc_cpu_s(proc.pid))
                if len(stamps) == args.throughput_files:
                    break
            if time.monotonic() > deadline:
                break
        os.killpg(proc.pid, signal.SIGKILL)  # no worker: the jobs stay queued
        proc.wait()
    finally:
        stack.stop()
    first = stamps[len(stamps) // 10]
    counted = len(stamps) - 1 - len(stamps) // 10
    cpu_ms = (cpu_at[1] - cpu_at[0]) / counted * 1000 if len(cpu_at) == 2 else float("nan")
    return counted / (stamps[-1] - first), cpu_ms


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def line(label: str, value: str, ok: bool | None = None) -> None:
    print(f"  {label:<26}{value}" + ("" if ok is None else f"   {c.verdict(ok)}"))


def report_crash(args: argparse.Namespace, r: dict[str, Any]) -> None:
    print()
    print(
        f"crash and re-run ({args.files} files, {args.corrupt} corrupt, {args.kills} x kill -9,"
        f" --concurrency {args.concurrency})"
    )
    line("jobs on the server", f"{r['jobs']} (expected {args.files})", r["jobs"] == args.files)
    line("outputs verified", f"{r['verified']}/{r['good']}", r["verified"] == r["good"])
    line(
        "corrupt listed",
        f"{r['corrupt_listed']}/{args.corrupt} with invalid_input",
        r["corrupt_listed"] == args.corrupt,
    )
    line(
        "exit code",
        f"{r['exit_code']} (uninterrupted run: {r['base_exit_code']})",
        r["exit_code"] == 2,
    )
    segs = " + ".join(
        f"{s:.1f}{'' if code is not None else ' (killed)'}" for s, code in r["segments"]
    )
    line("wall time", f"uninterrupted {r['uninterrupted_s']:.1f} s")
    line("", f"interrupted {segs} = {r['interrupted_total_s']:.1f} s")
    target = TARGETS["crash_ratio"]
    line("ratio", f"{r['ratio']:.2f}   target <= {target}", r["ratio"] <= target)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--files", type=int, default=300)
    parser.add_argument("--corrupt", type=int, default=10)
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seed", type=int, default=27)
    parser.add_argument("--throughput-files", type=int, default=600)
    parser.add_argument("--rounds", type=int, default=3, help="throughput rounds, alternated")
    parser.add_argument("--skip-crash", action="store_true")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args()
    if VHOST == "quire":
        print(
            "set QUIRE_RMQ_VHOST to this checkout's own vhost (its queues are purged)",
            file=sys.stderr,
        )
        return 1
    for queue in ("conversion.v1", "conversion.v1.dead", "quire.sweeps"):
        c.best_effort(c.run, ["rabbitmqctl", "--quiet", "purge_queue", "-p", VHOST, queue])
    work = Path(tempfile.mkdtemp(prefix="quire-bench-cli-"))
    db_url = c.recreate_database(DB_NAME)
    c.run(
        [c.PYTHON, "manage.py", "migrate", "--noinput", "-v", "0"],
        env=c.base_env(DATABASE_URL=db_url),
    )
    c.run([c.PYTHON, "manage.py", "install_beat_schedule"], env=c.base_env(DATABASE_URL=db_url))
    print(
        f"bench/cli.py: vhost {VHOST}, database {DB_NAME}, work {work}; cores={os.cpu_count()}, "
        f"load average {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    failed = False
    try:
        if not args.skip_crash:
            r = crash_phase(args, work, db_url)
            ok = (
                r["jobs"] == args.files
                and r["verified"] == r["good"]
                and r["corrupt_listed"] == args.corrupt
                and r["exit_code"] == 2
            )
            failed |= not ok
            report_crash(args, r)
        if not args.skip_throughput:
            # alternated rounds, medians: a shared machine's load moves between two phases.
            # The order alternates too (accept first, then the CLI first): whichever runs second
            # starts while Postgres still writes out the first one's burst (accept.py drops its
            # database when it ends, and a DROP DATABASE checkpoints), which put the CLI at a
            # systematic disadvantage when it always came second.
            pairs = []
            for n in range(args.rounds):
                if n % 2 == 0:
                    server = accept_rate(args)
                    rate, cpu_ms = submit_rate(args, work / f"round-{n}", db_url)
                else:
                    rate, cpu_ms = submit_rate(args, work / f"round-{n}", db_url)
                    server = accept_rate(args)
                pairs.append((server, rate, cpu_ms))
                print(
                    f"round {n + 1} ({'accept first' if n % 2 == 0 else 'CLI first'}): "
                    f"accept.py {server:.1f} jobs/s, quire submit {rate:.1f} "
                    f"files/s ({cpu_ms:.1f} ms CLI CPU per file), ratio {rate / server:.2f}",
                    flush=True,
                )
            ratios = sorted(r / a for a, r, _ in pairs)
            ratio = ratios[len(ratios) // 2]
            print()
            print(f"throughput (--concurrency {args.concurrency}, one-page 10 KB PDFs)")
            line(
                "bench/accept.py accepted", f"median {median([a for a, _, _ in pairs]):.1f} jobs/s"
            )
            line("quire submit", f"median {median([r for _, r, _ in pairs]):.1f} files/s")
            line("CLI CPU per file", f"median {median([m for _, _, m in pairs]):.1f} ms")
            target = TARGETS["submit_ratio"]
            line(
                "ratio (median of rounds)",
                f"{ratio:.2f} (rounds {', '.join(f'{r:.2f}' for r in ratios)})"
                f"   target >= {target}",
                ratio >= target,
            )
    finally:
        c.best_effort(c.drop_database, DB_NAME)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"kept {work}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
