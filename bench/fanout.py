"""One long document on many workers: fan-out speed-up, faults, size and cancel (issue 26,
ADR 0023).

    python bench/fanout.py [--pages 2000] [--dpi 100] [--size-pages 20000] [--cancel-runs 10]
                           [--skip speed,faults,size,cancel] [--db quire_cx_fanout]
                           [--outputs text,png] [--modes off,on,forced]
                           [--worker-env 'QUIRE_X=1;QUIRE_Y=2']

Everything runs through real processes on a fresh database ``--db``, a throwaway
RabbitMQ vhost with the production topology, the Procfile's ``worker``, ``sweeper`` and ``beat``.
Documents are generated here (tests/testdocs.py), never committed.

1. **Speed-up**: a ``--pages`` text PDF -> text, and the same -> PNG at ``--dpi``. One worker
   process with concurrency 2 (``WORKER_CONCURRENCY=2``), fan-out off (``QUIRE_FANOUT=false``),
   then the same stack with a worker with fan-out on (the default thresholds: the text job is
   not split, docs/OPERABILITY.md "Fan-out thresholds"), then (``forced``) one splitting text
   too (``QUIRE_FANOUT_MIN_PAGES=64``); each job's time is ``finished_at - created_at``
   (Postgres timestamps: dispatch, claim, pages, join and publish). Ratio = off / on; target
   >= 1.7 for PNG. The results are compared byte for byte with the unsplit run's. Every
   fanned-out job's timeline is printed (:func:`timeline`: plan, each range's publish, claim
   and end per worker slot, the idle gaps of each slot, the join).
2. **Faults**: the ``--pages`` text job (each page slowed by 10 ms so that it lasts long enough;
   fan-out forced for text, as in parts 3 and 4) on two workers of concurrency 1; a worker is
   killed with SIGKILL at 20 % and at 50 % of the pages (a new one started each time), and one
   is frozen (SIGSTOP) at 70 % until the job has ended without it, then thawed. Reported: the
   result against the unsplit run's (byte-identical), the ranges that ran again (only the
   killed and frozen workers'), pages written again (a checkpoint rewritten after the fault:
   must be 0 - a page checkpointed before a kill is never converted again), finalizers
   (``published`` and ``ranges_joined`` audit events: 1 each), and stale writes: the frozen
   worker's fenced statements after the thaw are refused (``quire_fenced_writes_refused_total``,
   from the processes' metric files) and the job's rows are unchanged (zero rows written).
3. **Size**: a ``--size-pages`` text PDF -> text, fan-out forced, one worker of concurrency 2;
   the peak RSS (VmHWM) of every process of the worker (main, pool processes, fork servers,
   converter children) sampled every 100 ms. Target: each <= 300 MB; the text is checked page
   by page.
4. **Cancel**: ``--cancel-runs`` text jobs of ``--pages`` pages (each page slowed by 50 ms,
   fan-out forced), two workers of concurrency 1; once two ranges run, the job is cancelled
   (the service the API calls); latency = until the job is ``cancelled``, no range is queued or
   running and no converter child is working. p50 / p99 / max; target p99 <= 2 s.

The machine is shared: the load average and the CPU the rest of the machine used during each
part are printed with it.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common
from _common import load_average, machine_cpu, percentile, quire_stack

FANOUT_ON = {"QUIRE_FANOUT": "true", "QUIRE_FANOUT_SLOTS": "2"}
FANOUT_OFF = {"QUIRE_FANOUT": "false"}
FAST = {"QUIRE_LEASE_S": "3", "QUIRE_HEARTBEAT_S": "0.5", "QUIRE_SWEEP_INTERVAL_S": "0.5"}


def _text_of(salt: str) -> Any:
    return lambda n: f"{salt} page {n}"


def _pdf(path: Path, pages: int, salt: str) -> Path:
    from tests import testdocs

    return testdocs.make_pdf(path, pages=pages, text_of=_text_of(salt))


def _accept(path: Path, *, tenant: str, output: str, options: dict | None = None) -> Any:
    return _common.accept_file(path, tenant=tenant, output=output, options=options, inline=False)


def _job(job_id: Any) -> Any:
    from conversion_jobs.models import ConversionJob

    return ConversionJob.objects.get(id=job_id)


def _wait_end(job_id: Any, timeout: float = 1800) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = _job(job_id)
        if job.state in ("succeeded", "partial", "failed", "cancelled"):
            return job
        time.sleep(0.2)
    raise TimeoutError(f"job {job_id} did not end")


def _result(job: Any) -> bytes:
    """The result as the web serves it."""
    from django.test import Client

    from tests.conftest import token

    response = Client().get(
        f"/api/v1/jobs/{job.id}/result", HTTP_AUTHORIZATION=f"Bearer {token(tenant=job.tenant)}"
    )
    if response.status_code != 200:
        raise RuntimeError(f"result: {response.status_code}")
    return b"".join(response.streaming_content)


class _Others:
    """The CPU the rest of the machine used while a part ran (busy jiffies not ours)."""

    def __enter__(self) -> _Others:
        self.load_before = load_average()
        self.busy0, self.total0 = machine_cpu()
        self.t0 = time.monotonic()
        self.own0 = _own_cpu()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.monotonic() - self.t0
        busy, total = machine_cpu()
        self.machine_busy = (busy - self.busy0) / max(1.0, total - self.total0)
        self.load_after = load_average()

    def line(self) -> str:
        return (
            f"machine busy {self.machine_busy:.0%} of {os.cpu_count()} cores; "
            f"load {self.load_before} -> {self.load_after}"
        )


def timeline(job_id: Any) -> str:
    """Where a fanned-out job's time went, from its rows (seconds from ``created_at``): the
    planner's attempt (claim, plan), each range's message (published; none for the range the
    planner kept), claim, end and worker slot, the join, and per slot its idle gaps (before its
    first range, between ranges, after its last until the publish)."""
    from conversion_jobs.models import (
        ConversionAttempt,
        ConversionOutbox,
        ExecutionAuditEvent,
        JobRange,
    )

    job = _job(job_id)
    t0 = job.created_at

    def at(when: Any) -> float | None:
        return None if when is None else (when - t0).total_seconds()

    def fmt(value: float | None) -> str:
        return "    -" if value is None else f"{value:5.2f}"

    events = {
        e.event_type: at(e.created_at)
        for e in ExecutionAuditEvent.objects.filter(job_id=job.id).order_by("seq")
    }
    attempts = list(ConversionAttempt.objects.filter(job_id=job.id).order_by("id"))
    published = {
        (o.range_first, o.range_generation): at(o.published_at)
        for o in ConversionOutbox.objects.filter(job_id=job.id, range_first__isnull=False)
    }
    first_message = (
        ConversionOutbox.objects.filter(job_id=job.id, range_first__isnull=True)
        .values_list("published_at", flat=True)
        .first()
    )
    lines = [
        f"    job: message published {fmt(at(first_message))}, planner claimed "
        f"{fmt(at(attempts[0].started_at) if attempts else None)}, fanned_out "
        f"{fmt(events.get('fanned_out'))}, ranges_joined {fmt(events.get('ranges_joined'))}, "
        f"finished {fmt(at(job.finished_at))} "
        f"(join {(at(job.finished_at) or 0) - (events.get('ranges_joined') or 0):.2f} s)",
        "    range       slot     published claimed  done   (s)  pages/s",
    ]
    slots: dict[str, list[tuple[float, float]]] = {}
    for r in JobRange.objects.filter(job_id=job.id).order_by("first_page"):
        claimed, done = at(r.claimed_at), at(r.updated_at)
        slot = r.worker.rsplit(":", 1)[-1]
        rate = (
            f"{(r.last_page - r.first_page + 1) / (done - claimed):8.1f}"
            if claimed is not None and done is not None and done > claimed
            else "       -"
        )
        lines.append(
            f"    {r.first_page:5}-{r.last_page:<5} {slot:>8} "
            f"{fmt(published.get((r.first_page, r.generation)))}   {fmt(claimed)}  {fmt(done)}"
            f"     {rate}"
        )
        if claimed is not None and done is not None:
            slots.setdefault(slot, []).append((claimed, done))
    plan = events.get("fanned_out") or 0.0
    joined = events.get("ranges_joined") or 0.0
    for slot, spans in sorted(slots.items()):
        spans.sort()
        gaps = [spans[0][0] - plan] + [b[0] - a[1] for a, b in itertools.pairwise(spans)]
        tail = joined - spans[-1][1]
        lines.append(
            f"    slot {slot}: {len(spans)} ranges, busy {sum(d - c for c, d in spans):.2f} s; "
            f"gaps: first {gaps[0]:.2f}, between {sum(gaps[1:]):.2f} "
            f"({', '.join(f'{g:.2f}' for g in gaps[1:])}), idle before the join {tail:.2f} s"
        )
    return "\n".join(lines)


def _own_cpu() -> float:
    return sum(os.times()[:4])


def _worker(stack: Any, **env: str) -> Any:
    return stack.start("worker", **{**FAST, **env})


#: Fan-out forced for every output (the text case's "what if": text's default threshold keeps a
#: 2,000-page text job unsplit, docs/OPERABILITY.md "Fan-out thresholds").
FANOUT_FORCED = {**FANOUT_ON, "QUIRE_FANOUT_MIN_PAGES": "64"}


def part_speed(stack: Any, args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    salt = uuid.uuid4().hex[:8]
    pdf = _pdf(scratch / "speed.pdf", args.pages, salt)
    wanted = args.outputs.split(",")
    cases = [
        (output, options)
        for output, options in (("text", {}), ("png", {"dpi": args.dpi}))
        if output in wanted
    ]
    out: dict[str, Any] = {"pdf": pdf, "salt": salt}
    timings: dict[tuple[str, str], float] = {}
    results: dict[tuple[str, str], bytes] = {}
    # "forced": text split at the default range sizes although its threshold says no (what
    # bounds it is printed with its timeline)
    modes = [
        (mode, env, [c for c in cases if mode != "forced" or c[0] == "text"])
        for mode, env in (("off", FANOUT_OFF), ("on", FANOUT_ON), ("forced", FANOUT_FORCED))
        if mode in args.modes.split(",") and (mode != "forced" or "text" in wanted)
    ]
    for mode, env, mode_cases in modes:
        worker = _worker(stack, WORKER_CONCURRENCY="2", **{**env, **args.worker_env})
        warm = _accept(
            _pdf(scratch / f"warm-{mode}.pdf", 4, uuid.uuid4().hex), tenant="warm", output="text"
        )
        _wait_end(warm.id)
        for output, options in mode_cases:
            cpu0 = _common.tree_cpu_s(worker.pid)
            with _Others() as others:
                job = _wait_end(_accept(pdf, tenant=f"t-{mode}", output=output, options=options).id)
            cpu = _common.tree_cpu_s(worker.pid) - cpu0
            if job.state != "succeeded":
                raise RuntimeError(f"{output} fan-out {mode}: {job.state} {job.error_code}")
            seconds = (job.finished_at - job.created_at).total_seconds()
            timings[(output, mode)] = seconds
            results[(output, mode)] = _result(job)
            from conversion_jobs.models import JobRange

            ranges = JobRange.objects.filter(job_id=job.id).count()
            print(
                f"  {output:4} fan-out {mode:6}: {seconds:7.2f} s  "
                f"({args.pages / seconds:7.1f} pages/s, {ranges} ranges; the worker's processes "
                f"used {cpu:.1f} CPU s = {cpu / others.wall:.2f} cores)  [{others.line()}]"
            )
            if ranges:
                print(timeline(job.id))
        worker.stop()  # type: ignore[attr-defined]
    for output, _options in cases:
        for mode in ("on", "forced"):
            if (output, "off") not in timings or (output, mode) not in timings:
                continue
            ratio = timings[(output, "off")] / timings[(output, mode)]
            identical = results[(output, "off")] == results[(output, mode)]
            label = f"speed-up {output} (fan-out off / {mode})"
            if output == "png":
                line = _common.ratio_line(label, ratio, 1.7)
            elif output == "text" and mode == "on":
                line = f"ratio {label:<52} {ratio:6.3f}   (default threshold: not split)"
            else:
                line = f"ratio {label:<52} {ratio:6.3f}   (no target: split at 64 pages)"
            print(f"{line}   results byte-identical: {identical}")
            out[f"{output}_{mode}"] = ratio
            out[f"{output}_{mode}_identical"] = identical
    out["text_result"] = results.get(("text", "off"))
    return out


def _refused_total(metrics_dir: Path) -> float:
    from prometheus_client import CollectorRegistry, multiprocess

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(metrics_dir))
    total = 0.0
    for metric in registry.collect():
        if metric.name == "quire_fenced_writes_refused":
            total += sum(s.value for s in metric.samples if s.name.endswith("_total"))
    return total


def _snapshot(job_id: Any) -> tuple:
    from conversion_jobs.models import JobRange, PageCheckpoint

    job = _job(job_id)
    return (
        job.state,
        job.state_version,
        job.pages_done,
        job.result_sha256,
        tuple(
            PageCheckpoint.objects.filter(job_id=job_id)
            .order_by("page_number")
            .values_list("page_number", "updated_at", "artifact_sha256")
        ),
        tuple(
            JobRange.objects.filter(job_id=job_id)
            .order_by("first_page")
            .values_list("first_page", "state", "generation", "updated_at")
        ),
    )


def part_faults(stack: Any, args: argparse.Namespace, scratch: Path, speed: dict) -> dict:
    from conversion_jobs.models import ExecutionAuditEvent, JobRange, PageCheckpoint

    if speed.get("text_result") is not None:
        pdf, salt, reference = speed["pdf"], speed["salt"], speed["text_result"]
    else:
        salt = uuid.uuid4().hex[:8]
        pdf = _pdf(scratch / "faults.pdf", args.pages, salt)
        reference = b"\f".join(_text_of(salt)(n).encode() for n in range(1, args.pages + 1))
    workers = [_worker(stack, WORKER_CONCURRENCY="1", **FANOUT_FORCED) for _ in range(2)]
    job = _accept(
        pdf,
        tenant="t-faults",
        output="text",
        options={"_test_fault": {"kind": "slow", "seconds": 0.01}},
    )

    def at(fraction: float) -> None:
        while _job(job.id).pages_done < fraction * args.pages:
            if _job(job.id).state not in ("queued", "running"):
                raise RuntimeError(f"the job ended early: {_job(job.id).state}")
            time.sleep(0.02)

    def held_by(proc: Any) -> set[int]:
        pids = {str(p) for p in proc.tree()}
        return {
            r.id
            for r in JobRange.objects.filter(job_id=job.id, state="running")
            if r.worker.rsplit(":", 1)[-1] in pids
        }

    def holding(proc: Any) -> set[int]:
        """Wait until ``proc`` holds a running range with a checkpointed page: its ranges."""
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and _job(job.id).state in ("queued", "running"):
            held = held_by(proc)
            if (
                held
                and PageCheckpoint.objects.filter(
                    job_id=job.id,
                    page_number__in=[
                        p
                        for r in JobRange.objects.filter(id__in=held)
                        for p in range(r.first_page, r.last_page + 1)
                    ],
                ).exists()
            ):
                return held
            time.sleep(0.01)
        running = list(
            JobRange.objects.filter(job_id=job.id, state="running").values_list("id", "worker")
        )
        raise TimeoutError(
            f"the worker {proc.name} never held a range: {_job(job.id).state}, running {running}, "
            f"its pids {sorted(proc.tree())}"
        )

    hit: set[int] = set()
    checkpointed: dict[int, Any] = {}
    for fraction in (0.2, 0.5):
        at(fraction)
        victim = workers.pop(0)
        hit |= holding(victim)
        victim.kill9()
        checkpointed.update(
            PageCheckpoint.objects.filter(job_id=job.id).values_list("page_number", "updated_at")
        )
        workers.append(_worker(stack, WORKER_CONCURRENCY="1", **FANOUT_FORCED))
        print(f"  kill -9 at {fraction:.0%}: ranges hit so far {sorted(hit)}")
    at(0.7)
    frozen = workers.pop(0)
    frozen_ranges = holding(frozen)
    hit |= frozen_ranges
    frozen.freeze()
    checkpointed.update(
        PageCheckpoint.objects.filter(job_id=job.id).values_list("page_number", "updated_at")
    )
    workers.append(_worker(stack, WORKER_CONCURRENCY="1", **FANOUT_FORCED))
    print(f"  SIGSTOP at 70%: worker held ranges {sorted(frozen_ranges)}")
    done = _wait_end(job.id)
    metrics_dir = stack.storage / "metrics"
    refused_before = _refused_total(metrics_dir)
    before = _snapshot(job.id)
    frozen.thaw()
    time.sleep(5)  # the thawed worker's heartbeat, its batch, its range end: all refused
    after = _snapshot(job.id)
    refused = _refused_total(metrics_dir) - refused_before
    ranges = list(JobRange.objects.filter(job_id=job.id))
    rerun = {r.id for r in ranges if r.generation > 1}
    pages_now = dict(
        PageCheckpoint.objects.filter(job_id=job.id).values_list("page_number", "updated_at")
    )
    rewritten = [p for p, at_ in checkpointed.items() if pages_now.get(p) != at_]
    identical = _result(done) == reference
    published = ExecutionAuditEvent.objects.filter(job_id=job.id, event_type="published").count()
    joined = ExecutionAuditEvent.objects.filter(job_id=job.id, event_type="ranges_joined").count()
    unfinished = sum(
        1
        for r in ranges
        if r.id in rerun
        for p in range(r.first_page, r.last_page + 1)
        if p not in checkpointed
    )
    ok = (
        done.state == "succeeded"
        and identical
        and rerun <= hit
        and not rewritten
        and published == 1
        and joined == 1
        and before == after
    )
    print(
        f"  state {done.state}; result byte-identical to the unsplit run: {identical}\n"
        f"  ranges run again: {len(rerun)} {sorted(rerun)} (the killed / frozen workers' ranges: "
        f"{sorted(hit)}); pages checkpointed before a fault and written again: {len(rewritten)}; "
        f"pages of the rerun ranges not checkpointed at their fault (at most these ran twice): "
        f"{unfinished}\n"
        f"  finalizers: published {published}, ranges_joined {joined}\n"
        f"  stale writes after the thaw: rows changed {0 if before == after else 'SOME'}, "
        f"fenced statements refused {refused:.0f}\n"
        f"  faults: {_common.verdict(ok)}"
    )
    for w in workers:
        w.stop()
    frozen.stop()
    return {"ok": ok}


def _tree_hwm(proc: Any) -> dict[int, int]:
    """VmHWM (bytes) of every process of ``proc``'s tree and of converter children."""
    out = {}
    for pid in proc.tree():
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    out[pid] = int(line.split()[1]) * 1024
    return out


def part_size(stack: Any, args: argparse.Namespace, scratch: Path) -> dict:
    salt = uuid.uuid4().hex[:8]
    started = time.monotonic()
    pdf = _pdf(scratch / "size.pdf", args.size_pages, salt)
    print(
        f"  generated {args.size_pages} pages ({pdf.stat().st_size / 1e6:.1f} MB) in "
        f"{time.monotonic() - started:.1f} s"
    )
    worker = _worker(stack, WORKER_CONCURRENCY="2", **FANOUT_FORCED)
    peaks: dict[int, int] = {}
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            for pid, hwm in _tree_hwm(worker).items():
                peaks[pid] = max(peaks.get(pid, 0), hwm)
            time.sleep(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    with _Others() as others:
        job = _wait_end(_accept(pdf, tenant="t-size", output="text").id, timeout=3600)
    stop.set()
    sampler.join()
    seconds = (job.finished_at - job.created_at).total_seconds()
    text = _result(job).split(b"\f") if job.state == "succeeded" else []
    correct = [t.decode() for t in text] == [
        _text_of(salt)(n) for n in range(1, args.size_pages + 1)
    ]
    top = max(peaks.values(), default=0)
    ok = job.state == "succeeded" and correct and top <= 300 * 1024 * 1024
    print(
        f"  {args.size_pages} pages -> text: {job.state} in {seconds:.1f} s, text correct: "
        f"{correct}; peak RSS per process: max {top / 2**20:.0f} MB over {len(peaks)} processes "
        f"(target <= 300 MB): {_common.verdict(ok)}  [{others.line()}]"
    )
    worker.stop()
    return {"ok": ok}


def _working_children(procs: list[Any]) -> list[int]:
    from tests.e2e import harness

    found = []
    for proc in procs:
        for pid in proc.tree():
            if harness.is_converter_child(pid):
                with contextlib.suppress(OSError):
                    if ".isolated-" in os.readlink(f"/proc/{pid}/cwd"):
                        found.append(pid)
    return found


def part_cancel(stack: Any, args: argparse.Namespace, scratch: Path) -> dict:
    from conversion_jobs.models import JobRange
    from conversion_jobs.services.cancellation import conversion_job_cancel

    workers = [_worker(stack, WORKER_CONCURRENCY="1", **FANOUT_FORCED) for _ in range(2)]
    latencies = []
    with _Others() as others:
        for run in range(args.cancel_runs):
            pdf = _pdf(scratch / f"cancel-{run}.pdf", args.pages, uuid.uuid4().hex[:8])
            job = _accept(
                pdf,
                tenant="t-cancel",
                output="text",
                options={"_test_fault": {"kind": "slow", "seconds": 0.05}},
            )
            deadline = time.monotonic() + 120
            while JobRange.objects.filter(job_id=job.id, state="running").count() < 2:
                if time.monotonic() > deadline:
                    raise TimeoutError("two ranges never ran")
                time.sleep(0.02)
            time.sleep(0.5)
            started = time.monotonic()
            conversion_job_cancel(job_id=job.id, tenant="t-cancel", actor="bench")
            while not (
                _job(job.id).state == "cancelled"
                and not JobRange.objects.filter(
                    job_id=job.id, state__in=["running", "queued"]
                ).exists()
                and not _working_children(workers)
            ):
                if time.monotonic() - started > 30:
                    raise TimeoutError("the cancel did not stop every range")
                time.sleep(0.01)
            latencies.append(time.monotonic() - started)
    latencies.sort()
    p99 = percentile(latencies, 99)
    ok = p99 <= 2.0
    print(
        f"  {len(latencies)} cancels: p50 {percentile(latencies, 50):.2f} s, p99 {p99:.2f} s, "
        f"max {latencies[-1]:.2f} s (target p99 <= 2 s, heartbeat 0.5 s): {_common.verdict(ok)}"
        f"  [{others.line()}]"
    )
    for w in workers:
        w.stop()
    return {"p99": p99, "ok": ok}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pages", type=int, default=2000)
    parser.add_argument("--dpi", type=int, default=100)
    parser.add_argument("--size-pages", type=int, default=20_000)
    parser.add_argument("--cancel-runs", type=int, default=10)
    parser.add_argument("--skip", default="")
    parser.add_argument("--keep", action="store_true")
    parser.add_argument(
        "--db", default=_common.bench_db_name("quire_cx_fanout"), help="the database to create"
    )
    parser.add_argument(
        "--outputs", default="text,png", help="speed-up: text, png or both (comma-separated)"
    )
    parser.add_argument(
        "--modes", default="off,on,forced", help="speed-up: fan-out off, on, forced (text)"
    )
    parser.add_argument(
        "--worker-env",
        default="",
        help="speed-up: extra worker settings, NAME=value;... (QUIRE_FANOUT_RANGE_TAPER=true)",
    )
    args = parser.parse_args()
    args.worker_env = dict(item.split("=", 1) for item in filter(None, args.worker_env.split(";")))
    skip = set(filter(None, args.skip.split(",")))
    os.environ["QUIRE_ENABLE_TEST_FAULTS"] = "1"
    print(f"bench/fanout.py: {args.pages} pages, PNG at {args.dpi} dpi; load {load_average()}")
    import tempfile

    scratch = Path(tempfile.mkdtemp(prefix="quire-fanout-"))
    # test faults (slow pages) are honoured by the workers too: QUIRE_* is not inherited
    with quire_stack(
        db_name=args.db, keep=args.keep, QUIRE_ENABLE_TEST_FAULTS="1", **FAST
    ) as stack:
        stack.start("sweeper")
        stack.start("beat")
        speed: dict[str, Any] = {}
        if "speed" not in skip:
            print("1. speed-up (one worker, concurrency 2)")
            speed = part_speed(stack, args, scratch)
        if "faults" not in skip:
            print("2. faults (kill -9 twice, SIGSTOP once)")
            part_faults(stack, args, scratch, speed)
        if "size" not in skip:
            print(f"3. size ({args.size_pages} pages)")
            part_size(stack, args, scratch)
        if "cancel" not in skip:
            print("4. cancel")
            part_cancel(stack, args, scratch)
    print(f"done; load {load_average()}")


if __name__ == "__main__":
    main()
