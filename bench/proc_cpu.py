"""Machine CPU per job by process kind over each ``bench/throughput.py`` phase (ADR 0017,
session 10): where a Quire job's CPU goes against the plain Celery task's, under real workers.

    # in one shell, before the benchmark (it samples until stopped):
    .venv/bin/python bench/proc_cpu.py sample /tmp/run.samples &
    .venv/bin/python bench/throughput.py --n 1000 --reuse attempt,tenant ... > /tmp/run.log
    kill %1
    .venv/bin/python bench/proc_cpu.py report /tmp/run.samples /tmp/run.log [--db quire_tp_x]

``sample`` reads every process's ``/proc/<pid>/stat`` five times a second (≈ 1 % of a core)
and writes one JSON line per pass; a new process gets a kind from its command line and its
parent's kind: ``<phase>:main`` (a Celery worker's main process: the consumer, its event loop,
task events, acks), ``<phase>:pool`` (its pool processes), ``<phase>:conv`` (their descendants:
the converter fork server and children), ``pg-backend`` (Postgres backends of the benchmark's
database), ``pg-other``, ``rabbitmq``, ``q-beat``, ``q-sweeper``, ``driver`` (throughput.py),
``other`` (whatever else shares the host). ``<phase>`` is ``plain`` / ``noop`` (the peers)
or ``q-<reuse mode>`` (``QUIRE_CONVERTER_REUSE`` of the worker's environment).

``report`` takes each phase's window from the benchmark's output (the first start to the last
completion: the phase's worker main process start, exact from ``/proc``, plus "boot->last s",
minus "window s") and prints each kind's CPU in it per job. A process that ended inside the
window counts with its last sample (≤ 0.2 s of its CPU may be missing); a converter child
that lived less than a sample apart is not seen at all, so ``:conv`` undercounts
``--reuse attempt`` (the throughput table's worker CPU counts reaped children; use that).
Own CPU only (utime + stime): children reaped by a sampled process are not added twice.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

CLK = os.sysconf("SC_CLK_TCK")
INTERVAL_S = 0.2
PHASES = {"plain celery": "plain", "quire[attempt]": "q-attempt", "quire[tenant]": "q-tenant"}


def _btime() -> int:
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("btime"):
            return int(line.split()[1])
    raise RuntimeError("no btime in /proc/stat")


def _stat(pid: int) -> tuple[int, int, int]:
    """(ppid, utime + stime in ticks, start time in ticks after boot)."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return int(fields[1]), int(fields[11]) + int(fields[12]), int(fields[19])


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _environ(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            items = fh.read().split(b"\0")
    except OSError:
        return {}
    pairs = (item.decode(errors="replace").split("=", 1) for item in items if b"=" in item)
    return {k: v for k, v in pairs}


def classify(pid: int, parent_kind: str, cmd: str, db: str) -> str:
    if "beam.smp" in cmd:
        return "rabbitmq"
    if cmd.startswith("postgres:"):
        return "pg-backend" if f" {db} " in cmd else "pg-other"
    if "celery" in cmd and (" worker" in cmd or " beat" in cmd):
        if "bench.noop_celery" in cmd:
            phase = "plain" if "bench.plain" in cmd else "noop"
        else:
            env = _environ(pid)
            if not env.get("DATABASE_URL", "").endswith(f"/{db}"):
                return "other"  # another checkout's worker, beat or sweeper on this host
            if " beat" in cmd:
                return "q-beat"
            if "quire.sweeps" in cmd:
                return "q-sweeper"
            phase = "q-" + env.get("QUIRE_CONVERTER_REUSE", "?")
        if parent_kind.startswith((phase + ":main", phase + ":pool")):
            return phase + ":pool"
        return phase + ":main"
    if parent_kind.endswith((":pool", ":conv")):
        return parent_kind.split(":")[0] + ":conv"
    if "throughput.py" in cmd:
        return "driver"
    if "proc_cpu.py" in cmd:
        return "sampler"
    return "other"


def sample(out: Path, db: str) -> None:
    btime = _btime()
    kinds: dict[int, str] = {}
    with open(out, "w") as fh:
        while True:
            now = time.time()
            snap: dict[int, list] = {}
            for name in os.listdir("/proc"):
                if not name.isdigit():
                    continue
                pid = int(name)
                try:
                    ppid, cpu, start = _stat(pid)
                except (OSError, ValueError, IndexError):
                    continue
                started = btime + start / CLK
                # A young process may not have exec'd yet (still its parent's command line).
                if pid not in kinds or (now - started < 3 and kinds[pid] in ("other", "driver")):
                    kinds[pid] = classify(pid, kinds.get(ppid, ""), _cmdline(pid), db)
                snap[pid] = [kinds[pid], cpu / CLK, started]
            for pid in [p for p in kinds if p not in snap]:
                del kinds[pid]
            fh.write(json.dumps({"t": now, "p": snap}) + "\n")
            fh.flush()
            time.sleep(max(0.0, INTERVAL_S - (time.time() - now)))


def report(samples_path: Path, log_path: Path) -> None:
    samples = [json.loads(line) for line in open(samples_path) if line.strip()]
    series: dict[str, list[tuple[float, float]]] = defaultdict(list)
    kind_of: dict[str, str] = {}
    start_of: dict[str, float] = {}
    for snap in samples:
        for pid, (kind, cpu, started) in snap["p"].items():
            key = f"{pid}@{started:.2f}"  # a pid is reused: its start time tells them apart
            series[key].append((snap["t"], cpu))
            kind_of[key], start_of[key] = kind, started

    def cpu_at(key: str, t: float) -> float:
        points = series[key]
        i = bisect.bisect_right([p[0] for p in points], t) - 1
        return points[i][1] if i >= 0 else 0.0

    log = log_path.read_text()
    rows = re.findall(
        r"^(plain celery|quire\[\w+\])\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s", log, re.M
    )
    for name, done_text, window_text, _per_s, boot_to_last in rows:
        prefix = PHASES.get(name)
        mains = sorted(start_of[k] for k, kind in kind_of.items() if kind == f"{prefix}:main")
        if prefix is None or not mains:
            continue
        end = mains[0] + float(boot_to_last)
        begin = end - float(window_text)
        done = int(done_text)
        total: dict[str, float] = defaultdict(float)
        for key, kind in kind_of.items():
            if start_of[key] > end:
                continue
            base = cpu_at(key, begin) if start_of[key] < begin else 0.0
            if kind.split(":")[0] in ("plain", "noop", "q-attempt", "q-tenant"):
                if not kind.startswith(prefix + ":"):
                    kind = "other phase"
            total[kind] += cpu_at(key, end) - base
        print(f"{name}: {done} jobs in {float(window_text):.2f} s, CPU ms/job by process kind")
        for kind in sorted(total, key=lambda k: -total[k]):
            if total[kind] * 1000 / done >= 0.005:
                print(f"   {kind:<14} {1000 * total[kind] / done:7.3f}")
        print(f"   {'all':<14} {1000 * sum(total.values()) / done:7.3f}")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("sample")
    s.add_argument("out", type=Path)
    s.add_argument(
        "--db",
        default=None,
        help="the benchmark's database (default: throughput.py's for this checkout's vhost)",
    )
    r = sub.add_parser("report")
    r.add_argument("samples", type=Path)
    r.add_argument("log", type=Path)
    args = parser.parse_args()
    if args.cmd == "sample":
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import _common as c

        sample(args.out, args.db or c.bench_db_name("quire_tp"))
    else:
        report(args.samples, args.log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
