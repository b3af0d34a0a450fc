"""Commit -> claim latency of Quire jobs, at idle and under an open-loop offered load (issue 3,
performance).

    .venv/bin/python bench/latency.py [--idle-jobs 200] [--rate 100] [--duration 20]

What runs: a fresh database ``quire_lat``, a throwaway vhost with the production topology, and
the Procfile's ``beat``, ``sweeper`` and ``worker`` (``WORKER_CONCURRENCY`` default 2, production
timings) as the least-privilege broker users. Jobs are one-page PDFs -> text, accepted through
the service layer (``conversion_job_accept``, as tests/e2e/conftest.py ``submit``); its on_commit
fast path publishes each.

* **commit**: the wall clock right after the acceptance transaction's COMMIT returned, taken by
  an on_commit callback registered before the acceptance's own (so before the fast-path
  publish). Also shown: from ``conversion_job.queued_at`` (set in the transaction, before the
  INSERT), which adds the transaction's own duration.
* **claim**: ``conversion_attempt.started_at`` of the job's first attempt (set by the worker inside
  the claim transaction, after the guarded UPDATE won). Same host, same clock.

Phases: a few warm-up jobs (discarded); **idle**: ``--idle-jobs`` jobs one at a time, each
submitted after the previous one finished; **load**: jobs offered at ``--rate`` per second for
``--duration`` seconds, open loop (submission i is due at t0 + i / rate whatever happened to the
others; ``--submitters`` threads submit, so a slow commit does not hold back the schedule unless
all are busy, and the achieved submit rate is printed). Targets at idle: p50 <= 15 ms,
p99 <= 100 ms.
"""

from __future__ import annotations

import argparse
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as c

DB_NAME = "quire_lat"
TARGETS = {"p50": 15.0, "p99": 100.0}


@dataclass
class Phase:
    name: str
    commits: dict[str, float] = field(default_factory=dict)  # job id -> committed at (epoch s)
    seconds: float = 0.0
    offered: float = 0.0
    late_submits: int = 0
    commit_ms: list[float] = field(default_factory=list)
    queued_ms: list[float] = field(default_factory=list)
    #: commit -> outbox row marked published (the fast path's publish + confirm) ...
    published_ms: list[float] = field(default_factory=list)
    #: ... and from there to the claim (delivery, prefork hand-off, claim transaction).
    delivered_ms: list[float] = field(default_factory=list)
    unclaimed: int = 0


def _wait_finished(db_url: str, ids: list[str], *, timeout: float, interval: float) -> int:
    """Poll until every job in ``ids`` has finished; returns how many have not."""
    if not ids:
        return 0
    id_list = ",".join(f"'{i}'" for i in ids)
    deadline = time.monotonic() + timeout
    left = len(ids)
    while time.monotonic() < deadline:
        left = int(
            c.sql_retry(
                db_url,
                f"SELECT count(*) FROM conversion_job WHERE id IN ({id_list}) "  # noqa: S608
                "AND finished_at IS NULL",
            )
            or 0
        )
        if not left:
            return 0
        time.sleep(interval)
    return left


def _latencies(db_url: str, phase: Phase) -> None:
    import psycopg

    with psycopg.connect(db_url) as conn:
        rows = conn.execute(
            "SELECT j.id::text, extract(epoch FROM j.queued_at), extract(epoch FROM a.started_at),"
            " extract(epoch FROM o.published_at)"
            " FROM conversion_job j LEFT JOIN conversion_attempt a"
            " ON a.job_id = j.id AND a.number = 1"
            " LEFT JOIN conversion_outbox o ON o.job_id = j.id AND o.generation = 1"
            " WHERE j.id = ANY(%s::uuid[])",
            (list(phase.commits),),
        ).fetchall()
    for job_id, queued, started, published in rows:
        if started is None:
            phase.unclaimed += 1
            continue
        phase.commit_ms.append((float(started) - phase.commits[job_id]) * 1000)
        phase.queued_ms.append((float(started) - float(queued)) * 1000)
        if published is not None:
            phase.published_ms.append((float(published) - phase.commits[job_id]) * 1000)
            phase.delivered_ms.append((float(started) - float(published)) * 1000)
    for values in (phase.commit_ms, phase.queued_ms, phase.published_ms, phase.delivered_ms):
        values.sort()


def run_idle(db_url: str, n: int, name: str = "idle") -> Phase:
    phase = Phase(name=name)
    t0 = time.perf_counter()
    for _ in range(n):
        job_id, committed = c.submit_job(tenant="bench")
        phase.commits[str(job_id)] = committed
        if _wait_finished(db_url, [str(job_id)], timeout=60, interval=0.005):
            raise RuntimeError(f"job {job_id} did not finish within 60 s")
    phase.seconds = time.perf_counter() - t0
    phase.offered = n / phase.seconds
    return phase


def run_load(db_url: str, *, rate: float, duration: float, submitters: int) -> Phase:
    from django.db import connection

    phase = Phase(name=f"load {rate:g}/s")
    due: queue.Queue[float | None] = queue.Queue()
    lock = threading.Lock()

    def submitter() -> None:
        try:
            while (at := due.get()) is not None:
                if time.perf_counter() - at > 0.05:
                    with lock:
                        phase.late_submits += 1
                job_id, committed = c.submit_job(tenant="bench")
                with lock:
                    phase.commits[str(job_id)] = committed
        finally:
            connection.close()

    threads = [threading.Thread(target=submitter, daemon=True) for _ in range(submitters)]
    for t in threads:
        t.start()
    total = int(rate * duration)
    t0 = time.perf_counter()
    for i in range(total):
        at = t0 + i / rate
        pause = at - time.perf_counter()
        if pause > 0:
            time.sleep(pause)
        due.put(at)
    for _ in threads:
        due.put(None)
    for t in threads:
        t.join()
    phase.seconds = time.perf_counter() - t0
    phase.offered = len(phase.commits) / phase.seconds
    left = _wait_finished(db_url, list(phase.commits), timeout=600, interval=0.5)
    if left:
        print(f"warning: {left} load jobs unfinished after 600 s", file=sys.stderr)
    return phase


def report(phases: list[Phase], *, load: str, concurrency: str) -> None:
    pct = c.percentile
    print()
    print(
        f"commit -> claim latency; worker WORKER_CONCURRENCY={concurrency}, production timings; "
        f"load average at start {load}"
    )
    print()
    header = (
        f"{'phase':<12} {'jobs':>5} {'submit/s':>9} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} "
        f"{'max ms':>8} | {'queued_at->claim p50':>21} {'p99':>8}"
    )
    print(header)
    print("-" * len(header))
    for p in phases:
        lat = p.commit_ms
        print(
            f"{p.name:<12} {len(lat):>5} {p.offered:>9.1f} {pct(lat, 50):>8.1f} "
            f"{pct(lat, 90):>8.1f} "
            f"{pct(lat, 99):>8.1f} {(lat[-1] if lat else float('nan')):>8.1f} | "
            f"{pct(p.queued_ms, 50):>21.1f} {pct(p.queued_ms, 99):>8.1f}"
        )
        print(
            f"  {p.name}: commit -> outbox marked published p50 {pct(p.published_ms, 50):.1f} / "
            f"p99 {pct(p.published_ms, 99):.1f} ms; published -> claim p50 "
            f"{pct(p.delivered_ms, 50):.1f} / p99 {pct(p.delivered_ms, 99):.1f} ms"
        )
        if p.unclaimed or p.late_submits:
            print(f"  {p.name}: {p.unclaimed} never claimed, {p.late_submits} submits > 50 ms late")
    idle = next((p for p in phases if p.name == "idle"), None)
    if idle is not None:
        p50, p99 = pct(idle.commit_ms, 50), pct(idle.commit_ms, 99)
        print()
        print(
            f"idle p50 {p50:7.1f} ms   target <= {TARGETS['p50']:.0f}    "
            f"{c.verdict(p50 <= TARGETS['p50'])}"
        )
        print(
            f"idle p99 {p99:7.1f} ms   target <= {TARGETS['p99']:.0f}   "
            f"{c.verdict(p99 <= TARGETS['p99'])}"
        )
    print(f"load average at end {c.load_average()}")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--idle-jobs", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument(
        "--rate", type=float, default=100.0, help="offered jobs/s in the load phase"
    )
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of offered load")
    parser.add_argument("--submitters", type=int, default=8, help="threads submitting under load")
    parser.add_argument("--concurrency", default="2", help="WORKER_CONCURRENCY of the one worker")
    parser.add_argument("--skip-load", action="store_true")
    parser.add_argument("--keep", action="store_true", help="keep the database, storage, logs")
    args = parser.parse_args()
    load = c.load_average()
    print(f"load average at start {load}", flush=True)
    phases: list[Phase] = []
    with c.quire_stack(db_name=DB_NAME, keep=args.keep) as stack:
        stack.start("beat")
        stack.start("sweeper")
        stack.start("worker", WORKER_CONCURRENCY=args.concurrency)
        run_idle(stack.db_url, args.warmup, name="warm-up")
        idle = run_idle(stack.db_url, args.idle_jobs)
        _latencies(stack.db_url, idle)
        phases.append(idle)
        print(f"idle done: p50 {c.percentile(idle.commit_ms, 50):.1f} ms", flush=True)
        if not args.skip_load:
            loaded = run_load(
                stack.db_url, rate=args.rate, duration=args.duration, submitters=args.submitters
            )
            _latencies(stack.db_url, loaded)
            phases.append(loaded)
    report(phases, load=load, concurrency=args.concurrency)
    return 0


if __name__ == "__main__":
    sys.exit(main())
