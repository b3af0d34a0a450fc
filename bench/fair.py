"""Fair dispatch (issue 24; docs/ARCHITECTURE.md §2b, ADR 0021): Flood, Weights, One long job
and Idle latency, each against a baseline measured in the same run.

    .venv/bin/python bench/fair.py [--a-jobs 1000] [--b-jobs 20] [--idle-jobs 100]
                                   [--weights-s 120] [--long-pages 2000] [--only flood,...]

Each configuration runs in a child process with its own stack (``_common.quire_stack``: a
fresh database, a throwaway vhost with the production topology, the Procfile's ``beat``,
``sweeper`` and ``worker`` as the least-privilege users). Jobs are accepted through the service
layer in the parent of the stack, as ``bench/latency.py`` does.

* **Idle latency**: commit -> claim p50 / p99 of ``--idle-jobs`` one-page PDF -> text jobs, one
  at a time (``bench/latency.py``'s idle phase), fair dispatch off (the fast path as it was)
  and on, interleaved job by job on one stack (the switch is this process's, which runs every
  commit's fast path). ``--fast-path background`` (the default since session 15): the commit
  hands its row to the web's background publisher thread, as a served web does; ``inline``:
  the fast path on the committing thread.
* **Flood** (one worker, ``WORKER_CONCURRENCY=2``: two worker processes): B alone first (the
  idle baseline: ``--b-jobs`` one-page jobs submitted at once, p95 of submit -> succeeded); A
  alone (``--a-jobs`` 10-page PNG jobs, pages/s from its first submit to its last finish); then
  the flood: A's jobs again and, ``--b-delay`` s after A began, B's. Targets: B p95 <= 3 x B
  alone, A pages/s >= 0.9 x A alone.
* **Weights**: tenant A weight 3, B weight 1, both submit far more 5-page jobs than the window
  converts; share of pages checkpointed in ``--weights-s`` seconds (the first 5 s excluded).
  Target 75 % ± 5.
* **One long job** (one worker, ``WORKER_CONCURRENCY=1``): B alone (``--long-b-jobs``
  one-page jobs, p95), then A's one ``--long-pages``-page PNG job and, once it runs, B's jobs
  again. Targets: B p95 <= 3 x B alone; A succeeds with every page converted once
  (one ``done`` checkpoint per page, each written by exactly one generation).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as c

ROOT = Path(__file__).resolve().parents[1]
RESULT = "FAIR-RESULT "


def le_line(label: str, ratio: float, target: float) -> str:
    """``c.ratio_line`` for a ratio that must stay at or below its target."""
    return f"ratio {label:<52} {ratio:6.3f}   target <= {target}   {c.verdict(ratio <= target)}"


def _make_pdf(pages: int) -> Path:
    import uuid

    from tests import testdocs

    path = Path(tempfile.mkstemp(suffix=".pdf")[1])
    salt = uuid.uuid4().hex
    testdocs.make_pdf(path, pages=pages, text_of=lambda n: f"Page {n} {salt}")
    return path


def _submit(*, tenant: str, pages: int, output: str, options: dict | None = None) -> tuple:
    path = _make_pdf(pages)
    try:
        at = time.time()
        job = c.accept_file(path, tenant=tenant, output=output, options=options)
        return str(job.id), at
    finally:
        path.unlink(missing_ok=True)


def _finished(db_url: str, ids: list[str], *, timeout: float) -> dict[str, tuple]:
    """Wait for every job; job id -> (finished epoch, state)."""
    import psycopg

    deadline = time.monotonic() + timeout
    with psycopg.connect(db_url, autocommit=True) as conn:
        while True:
            rows = conn.execute(
                "SELECT id::text, extract(epoch FROM finished_at), state FROM conversion_job"
                " WHERE id = ANY(%s::uuid[]) AND finished_at IS NOT NULL",
                (ids,),
            ).fetchall()
            if len(rows) == len(ids):
                return {r[0]: (float(r[1]), r[2]) for r in rows}
            if time.monotonic() > deadline:
                raise RuntimeError(f"{len(ids) - len(rows)} jobs unfinished after {timeout} s")
            time.sleep(0.05)


def _b_burst(
    db_url: str, n: int, *, tenant: str = "tenant-b", sent: list[tuple] | None = None
) -> list[float]:
    """``n`` one-page jobs submitted back to back; sorted seconds submit -> finished.
    ``sent``: gets each (job id, submit epoch, accepted epoch)."""
    submitted = []
    for _ in range(n):
        job_id, at = _submit(tenant=tenant, pages=1, output="text")
        submitted.append((job_id, at))
        if sent is not None:
            sent.append((job_id, at, time.time()))
    done = _finished(db_url, [s[0] for s in submitted], timeout=600)
    return sorted(done[i][0] - at for i, at in submitted)


def _pages_per_s(db_url: str, submitted: list[tuple], pages: int) -> float:
    done = _finished(db_url, [s[0] for s in submitted], timeout=3600)
    first = min(at for _, at in submitted)
    last = max(f for f, _ in done.values())
    return len(submitted) * pages / (last - first)


def _a_flood(n: int, *, dpi: int) -> list[tuple]:
    return [
        _submit(tenant="tenant-a", pages=10, output="png", options={"dpi": dpi}) for _ in range(n)
    ]


def _flood_profile(db_url: str, out: str, b_sent: list[tuple], a_submitted: float) -> None:
    """Where each of B's jobs spent its time in the flood (``--profile-out``): its rows' times
    (commit -> picked -> confirmed -> claimed -> finished), the slot that freed before its
    pick, and every attempt of the run, as JSON for bench/JOURNAL.md's analysis."""
    import psycopg

    with psycopg.connect(db_url, autocommit=True) as conn:
        b_rows = conn.execute(
            "SELECT j.id::text, extract(epoch FROM j.created_at), extract(epoch FROM j.queued_at),"
            " extract(epoch FROM j.dispatched_at), extract(epoch FROM o.created_at),"
            " extract(epoch FROM o.published_at), o.publish_attempts, o.last_error_code,"
            " extract(epoch FROM a.started_at), extract(epoch FROM a.finished_at),"
            " extract(epoch FROM j.finished_at), a.worker"
            " FROM conversion_job j JOIN conversion_outbox o ON o.job_id = j.id"
            " JOIN conversion_attempt a ON a.job_id = j.id WHERE j.id = ANY(%s::uuid[])",
            ([b[0] for b in b_sent],),
        ).fetchall()
        attempts = conn.execute(
            "SELECT j.tenant, a.worker, extract(epoch FROM a.started_at),"
            " extract(epoch FROM a.finished_at), a.outcome, a.pages_converted,"
            " extract(epoch FROM j.created_at)"
            " FROM conversion_attempt a JOIN conversion_job j ON j.id = a.job_id"
            " ORDER BY a.started_at"
        ).fetchall()
    Path(out).write_text(
        json.dumps(
            {
                "b_sent": b_sent,
                "a_submitted": a_submitted,
                "b_rows": [[float(x) if hasattr(x, "is_finite") else x for x in r] for r in b_rows],
                "attempts": [
                    [float(x) if hasattr(x, "is_finite") else x for x in r] for r in attempts
                ],
            }
        )
    )


# --- the phases (each in its own stack, in a child process) ---------------------------------


def phase_idle(args: argparse.Namespace) -> dict:
    """Fair dispatch off and on interleaved job by job on one stack (the machine is shared and
    its load moves: two stacks one after the other measured the load as much as the change).
    The switch is this process's, which runs every acceptance and so every commit's fast path;
    the workers keep their after-attempt relay pass in both halves."""
    import latency
    from django.conf import settings

    with c.quire_stack(db_name=c.bench_db_name("quire_fair_idle")) as stack:
        stack.start("beat")
        stack.start("sweeper")
        stack.start("worker", WORKER_CONCURRENCY="2")
        latency.run_idle(stack.db_url, 5, name="warm-up")
        halves = {"off": latency.Phase(name="off"), "on": latency.Phase(name="on")}
        from conversion_jobs.services import broker, fair

        spent: dict[str, list[float]] = {"pick": [], "publish_off": [], "publish_on": []}
        real_pick, real_publish = fair.pick, broker.publish_conversion

        def timed_pick(**kw: object) -> object:
            t = time.perf_counter()
            try:
                return real_pick(**kw)  # type: ignore[arg-type]
            finally:
                spent["pick"].append((time.perf_counter() - t) * 1000)

        def timed_publish(**kw: object) -> object:
            t = time.perf_counter()
            try:
                return real_publish(**kw)  # type: ignore[arg-type]
            finally:
                on = settings.QUIRE["FAIR_DISPATCH"]
                spent["publish_on" if on else "publish_off"].append(
                    (time.perf_counter() - t) * 1000
                )

        fair.pick, broker.publish_conversion = timed_pick, timed_publish
        if args.fast_path == "background":
            # as the web runs it: the commit hands its row to the background publisher's thread
            from conversion_jobs.services import publisher

            settings.QUIRE["FAST_PUBLISH"] = "background"
            assert publisher.enable() is not None
        for i in range(2 * args.idle_jobs):
            name = ("off", "on")[i % 2]
            settings.QUIRE["FAIR_DISPATCH"] = name == "on"
            one = latency.run_idle(stack.db_url, 1, name=name)
            halves[name].commits.update(one.commits)
        out = {}
        for name, half in halves.items():
            latency._latencies(stack.db_url, half)
            out[name] = {
                "p50": c.percentile(half.commit_ms, 50),
                "p99": c.percentile(half.commit_ms, 99),
                "n": len(half.commit_ms),
                "published_p50": c.percentile(half.published_ms, 50),
                "published_p99": c.percentile(half.published_ms, 99),
                "delivered_p50": c.percentile(half.delivered_ms, 50),
                "delivered_p99": c.percentile(half.delivered_ms, 99),
            }
        for key, values in spent.items():
            values.sort()
            out["off"][f"{key}_ms_p50"] = c.percentile(values, 50) if values else float("nan")
        return out


def phase_flood(args: argparse.Namespace) -> dict:
    with c.quire_stack(db_name=c.bench_db_name("quire_fair_flood")) as stack:
        stack.start("beat")
        stack.start("sweeper")
        stack.start("worker", WORKER_CONCURRENCY="2")
        _b_burst(stack.db_url, 4)  # warm-up
        b_alone = _b_burst(stack.db_url, args.b_jobs)
        a_alone = _pages_per_s(stack.db_url, _a_flood(args.a_jobs, dpi=args.dpi), 10)
        t0 = time.monotonic()
        flood: list[tuple] = []
        # A submits from this thread; B's burst starts b_delay s after A's first submit
        import threading

        from django.db import connections

        b_lat: list[float] = []
        b_sent: list[tuple] = []

        def b_side() -> None:
            try:
                time.sleep(max(0.0, args.b_delay - (time.monotonic() - t0)))
                b_lat.extend(_b_burst(stack.db_url, args.b_jobs, sent=b_sent))
            finally:
                connections.close_all()

        b = threading.Thread(target=b_side)
        b.start()
        flood = _a_flood(args.a_jobs, dpi=args.dpi)
        a_submitted = time.time()
        a_flood = _pages_per_s(stack.db_url, flood, 10)
        b.join()
        if args.profile_out:
            _flood_profile(stack.db_url, args.profile_out, b_sent, a_submitted)
        return {
            "b_alone_p95": c.percentile(b_alone, 95),
            "b_flood_p95": c.percentile(sorted(b_lat), 95),
            "a_alone_pps": a_alone,
            "a_flood_pps": a_flood,
        }


def phase_weights(args: argparse.Namespace) -> dict:
    import psycopg

    with c.quire_stack(db_name=c.bench_db_name("quire_fair_weights")) as stack:
        from conversion_jobs.models import TenantShare

        TenantShare.objects.update_or_create(tenant="tenant-a", defaults={"weight": 3})
        TenantShare.objects.update_or_create(tenant="tenant-b", defaults={"weight": 1})
        stack.start("beat")
        stack.start("sweeper")
        # more work than the window converts, both tenants, submitted before it opens and before
        # the worker starts: once the relay wakes on every freed slot, the workers convert
        # faster than this process submits, and a backlog submitted to running workers is gone
        # before the window opens (session 14)
        jobs = args.weights_jobs
        for _ in range(jobs):
            _submit(tenant="tenant-a", pages=5, output="png", options={"dpi": args.dpi})
            _submit(tenant="tenant-b", pages=5, output="png", options={"dpi": args.dpi})
        stack.start("worker", WORKER_CONCURRENCY="2")
        time.sleep(5)
        with psycopg.connect(stack.db_url, autocommit=True) as conn:
            start = conn.execute("SELECT now()").fetchone()[0]
            time.sleep(args.weights_s)
            rows = conn.execute(
                "SELECT j.tenant, count(*) FROM page_checkpoint p JOIN conversion_job j"
                " ON j.id = p.job_id WHERE p.state = 'done' AND p.updated_at >= %s"
                " GROUP BY j.tenant",
                (start,),
            ).fetchall()
            started = conn.execute(
                "SELECT j.tenant, count(*) FROM conversion_attempt a JOIN conversion_job j"
                " ON j.id = a.job_id WHERE a.started_at >= %s GROUP BY j.tenant",
                (start,),
            ).fetchall()
            left = conn.execute(
                "SELECT j.tenant, count(*) FROM conversion_job j WHERE j.state = 'queued'"
                " GROUP BY j.tenant"
            ).fetchall()
        pages = dict(rows)
        return {"pages": pages, "queued_at_end": dict(left), "attempts_started": dict(started)}


def phase_long(args: argparse.Namespace) -> dict:
    import psycopg

    env = {"QUIRE_FAIR_SLICE_S": str(args.slice_s)}
    with c.quire_stack(db_name=c.bench_db_name("quire_fair_long"), **env) as stack:
        stack.start("beat")
        stack.start("sweeper")
        stack.start("worker", WORKER_CONCURRENCY="1")
        _b_burst(stack.db_url, 3)
        b_alone = _b_burst(stack.db_url, args.long_b_jobs)
        long_id, _at = _submit(
            tenant="tenant-a", pages=args.long_pages, output="png", options={"dpi": args.dpi}
        )
        with psycopg.connect(stack.db_url, autocommit=True) as conn:
            while (
                conn.execute(
                    "SELECT state FROM conversion_job WHERE id = %s", (long_id,)
                ).fetchone()[0]
                != "running"
            ):
                time.sleep(0.05)
            time.sleep(2)  # A holds the only worker
            b_during = _b_burst(stack.db_url, args.long_b_jobs)
            done = _finished(stack.db_url, [long_id], timeout=3600)
            checks = conn.execute(
                "SELECT count(*), count(DISTINCT page_number),"
                " count(*) FILTER (WHERE state = 'done') FROM page_checkpoint WHERE job_id = %s",
                (long_id,),
            ).fetchone()
            attempts = conn.execute(
                "SELECT outcome, count(*), sum(pages_converted) FROM conversion_attempt"
                " WHERE job_id = %s GROUP BY outcome",
                (long_id,),
            ).fetchall()
            range_yields = conn.execute(
                "SELECT count(*) FROM execution_audit_event WHERE job_id = %s"
                " AND event_type = 'range_yielded'",
                (long_id,),
            ).fetchone()[0]
        return {
            "range_yields": range_yields,
            "b_alone_p95": c.percentile(b_alone, 95),
            "b_during_p95": c.percentile(b_during, 95),
            "long_state": done[long_id][1],
            "pages": checks[0],
            "distinct_pages": checks[1],
            "done_pages": checks[2],
            "attempts": {o: [n, int(p or 0)] for o, n, p in attempts},
        }


PHASES = {"idle": phase_idle, "flood": phase_flood, "weights": phase_weights, "long": phase_long}


def _child(args: argparse.Namespace) -> int:
    result = PHASES[args.phase](args)
    print(RESULT + json.dumps(result), flush=True)
    return 0


def _run_child(phase: str, argv: list[str], **env: str) -> dict:
    import os

    cmd = [sys.executable, str(Path(__file__).resolve()), "--phase", phase, *argv]
    out = subprocess.run(
        cmd, env={**os.environ, **env}, capture_output=True, text=True, cwd=ROOT, check=False
    )
    for line in out.stdout.splitlines():
        if line.startswith(RESULT):
            return dict(json.loads(line[len(RESULT) :]))
    raise RuntimeError(f"phase {phase} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--phase", choices=list(PHASES), help=argparse.SUPPRESS)
    parser.add_argument("--only", default="idle,flood,weights,long")
    parser.add_argument("--idle-jobs", type=int, default=100)
    parser.add_argument(
        "--fast-path",
        choices=("background", "inline"),
        default="background",
        help="idle: the web's background publisher (as served) or the inline fast path",
    )
    parser.add_argument("--a-jobs", type=int, default=1000)
    parser.add_argument("--b-jobs", type=int, default=20)
    parser.add_argument("--b-delay", type=float, default=5.0)
    parser.add_argument("--dpi", type=int, default=72, help="PNG dpi of A's pages")
    parser.add_argument("--weights-s", type=float, default=120.0)
    parser.add_argument("--weights-jobs", type=int, default=300)
    parser.add_argument("--long-pages", type=int, default=2000)
    parser.add_argument("--long-b-jobs", type=int, default=10)
    parser.add_argument(
        "--profile-out", default="", help="flood: write B's per-job timings here (JSON)"
    )
    parser.add_argument("--slice-s", type=float, default=2.0, help="QUIRE_FAIR_SLICE_S (long)")
    args = parser.parse_args()
    if args.phase:
        return _child(args)
    passthrough = [a for a in sys.argv[1:] if not a.startswith("--only")]
    if "--only" in sys.argv:
        i = sys.argv.index("--only")
        passthrough = sys.argv[1:i] + sys.argv[i + 2 :]
    only = set(args.only.split(","))
    print(f"load average at start {c.load_average()}", flush=True)
    ok = True
    if "idle" in only:
        both = _run_child("idle", passthrough)
        off, on = both["off"], both["on"]
        print(
            f"Idle commit->claim ({on['n']} jobs each): fair off p50 {off['p50']:.1f} ms"
            f" p99 {off['p99']:.1f} ms; fair on p50 {on['p50']:.1f} ms p99 {on['p99']:.1f} ms"
        )
        # (the background publisher publishes on its own channel, not broker.publish_conversion:
        # only the inline fast path's publish is timed)
        publish = (
            " publish p50 fair off {publish_off_ms_p50:.2f} / on {publish_on_ms_p50:.2f} ms;"
            if args.fast_path == "inline"
            else ""
        )
        print(
            ("  in this process: pick p50 {pick_ms_p50:.2f} ms;" + publish).format(**off)
            + f" fast path: {args.fast_path}"
        )
        for name, r in (("off", off), ("on", on)):
            print(
                f"  fair {name}: commit -> marked sent p50 {r['published_p50']:.1f} /"
                f" p99 {r['published_p99']:.1f} ms; -> claim p50 {r['delivered_p50']:.1f} /"
                f" p99 {r['delivered_p99']:.1f} ms"
            )
        for q in ("p50", "p99"):
            ratio = on[q] / off[q]
            ok &= ratio <= 1.10
            print(le_line(f"idle {q} fair on / off", ratio, 1.10))
    if "flood" in only:
        r = _run_child("flood", passthrough)
        b_ratio = r["b_flood_p95"] / r["b_alone_p95"]
        a_ratio = r["a_flood_pps"] / r["a_alone_pps"]
        print(
            f"Flood ({args.a_jobs} A jobs x 10 PNG pages at {args.dpi} dpi, {args.b_jobs} B"
            f" one-page jobs {args.b_delay:g} s later): B p95 alone {r['b_alone_p95']:.2f} s,"
            f" during the flood {r['b_flood_p95']:.2f} s; A pages/s alone"
            f" {r['a_alone_pps']:.1f}, in the flood {r['a_flood_pps']:.1f}"
        )
        print(le_line("flood B p95 / B alone", b_ratio, 3.0))
        print(c.ratio_line("flood A pages/s / A alone", a_ratio, 0.9))
        ok &= b_ratio <= 3.0 and a_ratio >= 0.9
    if "weights" in only:
        r = _run_child("weights", passthrough)
        a, b = r["pages"].get("tenant-a", 0), r["pages"].get("tenant-b", 0)
        share = a / max(1, a + b)
        print(
            f"Weights 3:1 over {args.weights_s:g} s: A {a} pages, B {b} pages, A's share"
            f" {share:.1%} (still queued at the end: {r['queued_at_end']}; attempts started in"
            f" the window: {r['attempts_started']})"
        )
        good = 0.70 <= share <= 0.80 and all(v > 0 for v in r["queued_at_end"].values())
        print(f"weights A share {share:.3f}   target 0.75 ± 0.05   {c.verdict(good)}")
        ok &= good
    if "long" in only:
        r = _run_child("long", passthrough)
        ratio = r["b_during_p95"] / r["b_alone_p95"]
        once = r["pages"] == r["distinct_pages"] == r["done_pages"] == args.long_pages
        print(
            f"One long job ({args.long_pages} PNG pages, 1 worker, concurrency 1, slice"
            f" {args.slice_s:g} s): B p95 alone {r['b_alone_p95']:.2f} s, during"
            f" {r['b_during_p95']:.2f} s; A {r['long_state']}, {r['done_pages']} pages done"
            f" ({r['distinct_pages']} distinct), attempts {r['attempts']},"
            f" range yields {r['range_yields']}"
        )
        print(le_line("long B p95 / B alone", ratio, 3.0))
        print(f"every page converted once: {c.verdict(once and r['long_state'] == 'succeeded')}")
        ok &= ratio <= 3.0 and once
    print(f"load average at end {c.load_average()}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
