"""Whole-service page throughput, worker memory and DOCX overhead (issue 4, performance).

    .venv/bin/python bench/pages.py [--pages 200] [--split 2] [--rounds 5] [--rss-pages 300]
                                    [--docx-runs 3]
                                    [--skip throughput,rss,docx,engine]
                                    [--sandbox both|on|off] [--storage filesystem|s3]
                                    [--profile DIR]

Everything runs through real processes: a fresh database ``quire_cx_pages``, a throwaway RabbitMQ
vhost carrying the production topology (publisher and worker users with exactly their ``quire``
permissions), and the Procfile's ``worker`` command. Jobs are accepted through the service layer
(``conversion_job_accept``, whose on_commit fast path publishes with confirms) -- the HTTP layer
is ``bench/accept.py``'s subject, not this one's.

1. **Throughput**: one ``--pages`` text PDF, converted to ``text`` and to ``png`` at 150 dpi.
   Service: one worker (Procfile, ``--concurrency 2`` = 2 worker processes), warmed by two small
   jobs; the document is submitted as ``--split`` jobs with ``options.pages`` ranges (2 jobs:
   "1-100" and "101-200"), so both worker processes are busy; pages/s = pages / (last job's
   ``finished_at`` - first job's ``created_at``), Postgres timestamps, so it includes dispatch,
   claim, checkpoints, finalization (text join / PNG ZIP) and publication. Baseline, in the same
   run: ``bench/pages_converter.py``'s direct loop (2 processes, each pypdfium2 over half the
   pages, writing files). Ratio = service / direct. ``--rounds`` (default 5) alternates the two
   that many times, each round on a fresh PDF, and reports the medians. ``--sandbox both``
   (default) runs it with the converter sandbox on, then off (ratio on / off of the
   service/direct ratios, target >= 0.95);
   ``--storage s3`` runs it once more (first sandbox setting) with every artifact in a real S3
   server (SeaweedFS, ``tests/s3server.py``): ratio s3 / filesystem pages/s, target >= 0.8.
2. **Peak RSS**: a worker with ``WORKER_CONCURRENCY=1`` converts a ``--rss-pages`` PDF to PNG at
   150 dpi; every 50 ms the driver samples ``/proc/<pid>/status`` (VmHWM, VmRSS) of the celery
   main process, its pool process, the pool's converter fork server (zygote) and its children.
3. **DOCX -> PDF overhead**: a ~5-page DOCX. ``soffice --headless --convert-to pdf`` alone with a
   fresh profile directory (what the service does: a private profile per conversion) and with a
   reused profile; then the service, accept -> succeeded (Postgres timestamps): the first DOCX
   job of a freshly started worker (cold) and later jobs (warm). Overhead = service - soffice
   alone (fresh profile).
4. **Warm LibreOffice engine** (ADR 0019, ``--engine-parts e2e,rate,rss``): 5-page DOCX -> PDF
   end to end with a warm engine vs soffice alone (fresh process), docs/s engine off vs warm,
   the worker tree's RSS after 10 and after ``--engine-rss`` conversions.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import (
    PUBLISHER,
    PYTHON,
    ROOT,
    S3_TARGET,
    WORKER,
    accept_file,
    base_env,
    bench_db_name,
    drop_database,
    ratio_line,
    recreate_database,
    run,
    s3_server,
    start_procfile,
    storage_in_process,
    throwaway_vhost,
    verdict,
    vhost_grant_like_quire,
)

# -- the service ----------------------------------------------------------------------------------


@dataclass
class Service:
    env: dict[str, str]
    worker_broker_url: str
    scratch: Path
    procs: list[subprocess.Popen[bytes]]

    def worker(self, *, concurrency: int, **extra: str) -> subprocess.Popen[bytes]:
        log = self.scratch / f"worker-{len(self.procs)}.log"
        env = {
            **self.env,
            "CELERY_BROKER_URL": self.worker_broker_url,
            "QUIRE_BROKER_WORKER_URL": self.worker_broker_url,
            "WORKER_CONCURRENCY": str(concurrency),
            "PORT": f"bench{uuid.uuid4().hex[:8]}",
            **extra,
        }
        proc = start_procfile("worker", env=env, log=log)
        proc.log = log  # type: ignore[attr-defined]
        self.procs.append(proc)
        deadline = time.monotonic() + 60
        while "ready." not in log.read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"worker did not start; see {log}")
            time.sleep(0.1)
        return proc

    def stop(self, proc: subprocess.Popen[bytes]) -> None:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@contextlib.contextmanager
def service(db_name: str, *, keep: bool = False, **settings_env: str) -> Iterator[Service]:
    """Database + throwaway vhost + Django set up in this process (for submitting and reading)."""
    scratch = Path(tempfile.mkdtemp(prefix=f"{db_name}-"))
    (scratch / "metrics").mkdir()
    url = recreate_database(db_name)
    try:
        with throwaway_vhost(user=PUBLISHER[0], password=PUBLISHER[1]) as publisher_url:
            vhost = publisher_url.rsplit("/", 1)[1]
            vhost_grant_like_quire(vhost, WORKER[0])
            env = base_env(
                DATABASE_URL=url,
                CELERY_BROKER_URL=publisher_url,
                DJANGO_SETTINGS_MODULE="project.settings",
                PYTHONPATH=str(ROOT),
                QUIRE_STORAGE_DIR=str(scratch / "storage"),
                QUIRE_WORK_DIR=str(scratch / "work"),
                QUIRE_VAR_DIR=str(scratch / "var"),
                QUIRE_TENANT_QUOTA="1000000",
                QUIRE_GLOBAL_CAPACITY="1000000",
                QUIRE_LOG_FORMAT="text",
                # the Procfile's default var/metrics is shared with everything else on the host
                PROMETHEUS_MULTIPROC_DIR=str(scratch / "metrics"),
                **settings_env,
            )
            run([PYTHON, "manage.py", "migrate", "--noinput"], env=env)
            os.environ.update(env)
            import django

            django.setup()
            svc = Service(
                env=env,
                worker_broker_url=f"amqp://{WORKER[0]}:{WORKER[1]}@127.0.0.1:5672/{vhost}",
                scratch=scratch,
                procs=[],
            )
            try:
                yield svc
            finally:
                for proc in svc.procs:
                    svc.stop(proc)
                from django.db import connections

                connections.close_all()
    finally:
        if not keep:
            drop_database(db_name)
            shutil.rmtree(scratch, ignore_errors=True)


def submit(path: Path, *, output: str, options: dict | None = None) -> Any:
    return accept_file(path, output=output, options=options, idempotency_key=uuid.uuid4().hex)


def wait_terminal(job_ids: list, *, timeout: float = 900) -> list:
    from django.db import OperationalError, connections

    from conversion_jobs.models import ConversionJob

    deadline = time.monotonic() + timeout
    while True:
        try:
            jobs = list(ConversionJob.objects.filter(id__in=job_ids))
        except OperationalError:  # Postgres restarted (someone else's outage test): poll again
            connections.close_all()
            time.sleep(0.5)
            continue
        if all(j.finished_at is not None for j in jobs) and len(jobs) == len(job_ids):
            return jobs
        if time.monotonic() > deadline:
            raise RuntimeError(f"jobs not finished: {[(j.id, j.state) for j in jobs]}")
        time.sleep(0.05)


def unique_pdf(path: Path, pages: int) -> Path:
    from pages_converter import page_text

    from tests import testdocs

    salt = uuid.uuid4().hex[:8]
    text = page_text(40)
    return testdocs.make_pdf(path, pages=pages, text_of=lambda n: f"{salt} " + text(n))


# -- 1. throughput --------------------------------------------------------------------------------


def throughput(
    svc: Service,
    *,
    pages: int,
    split: int,
    outputs: list[str],
    rounds: int = 1,
    sandbox: str = "on",
    storage: str = "filesystem",
    profile: Path | None = None,
    **worker_env: str,
) -> list[dict]:
    """``rounds``: per output, the direct loop and the service alternated that many times, each
    round on a fresh PDF; one row per output with the per-round medians (a 200-page text round
    takes about 0.3 s, so one round is at the mercy of a shared machine's next 0.3 s).
    ``worker_env``: extra settings of the worker (e.g. the S3 store's, with ``storage="s3"``
    and this process's store pointed there too: ``storage_in_process``). ``profile``: py-spy the
    worker tree while the service converts (``_profile.Profiler``, one file per output and
    round)."""
    worker = svc.worker(concurrency=2, QUIRE_SANDBOX=sandbox, **worker_env)
    warm = [submit(unique_pdf(svc.scratch / f"warm{i}.pdf", 2), output="png") for i in range(2)]
    wait_terminal([j.id for j in warm])
    rows = []
    for output in outputs:
        per_round = [
            _throughput_round(
                svc,
                worker,
                pages=pages,
                split=split,
                output=output,
                sandbox=sandbox,
                storage=storage,
                profile=None if profile is None else profile / f"{output}-{sandbox}-{storage}-{r}",
            )
            for r in range(rounds)
        ]
        median = {
            key: statistics.median(row[key] for row in per_round)
            for key in per_round[0]
            if isinstance(per_round[0][key], float)
        }
        rows.append({**per_round[0], **median, "rounds": [row["ratio"] for row in per_round]})
        if rounds > 1:
            print(
                f"throughput {output}, sandbox {sandbox}, {storage}, median of {rounds} rounds: "
                f"direct {median['direct_pages_s']:.1f} pages/s, service "
                f"{median['service_pages_s']:.1f} pages/s, ratio service / direct "
                f"{median['ratio']:.2f} (rounds: "
                + ", ".join(f"{row['ratio']:.2f}" for row in per_round)
                + f"; target >= {TARGET_DIRECT_RATIO}) "
                f"{verdict(median['ratio'] >= TARGET_DIRECT_RATIO)}",
                flush=True,
            )
    svc.stop(worker)
    return rows


def _throughput_round(
    svc: Service,
    worker: subprocess.Popen[bytes],
    *,
    pages: int,
    split: int,
    output: str,
    sandbox: str,
    storage: str,
    profile: Path | None,
) -> dict:
    """The direct loop, then the service, over one fresh ``pages``-page PDF."""
    import pages_converter

    source = unique_pdf(svc.scratch / f"doc-{output}-{uuid.uuid4().hex[:8]}.pdf", pages)
    direct = pages_converter.run_pair(
        "direct", source=source, output=output, pages=pages, scratch=svc.scratch / "direct"
    )
    size = pages // split
    ranges = [(i * size + 1, pages if i == split - 1 else (i + 1) * size) for i in range(split)]
    options = {"dpi": 150} if output == "png" else {}
    profiler = None
    if profile is not None:
        from _profile import Profiler

        profiler = Profiler(profile)
        profiler.attach("worker", worker.pid)
        time.sleep(1.0)  # py-spy attaches to the tree before the clock starts
    cpu_before = _tree_cpu_s(worker.pid), _s3_cpu_s()
    jobs = [
        submit(source, output=output, options={**options, "pages": f"{a}-{b}"}) for a, b in ranges
    ]
    done = wait_terminal([j.id for j in jobs])
    if profiler is not None:
        for summary in profiler.stop():
            print(f"profile: {summary}", flush=True)
    worker_ms = (_tree_cpu_s(worker.pid) - cpu_before[0]) * 1000 / pages
    s3_ms = (_s3_cpu_s() - cpu_before[1]) * 1000 / pages
    if any(j.state != "succeeded" for j in done):
        raise RuntimeError(f"{output}: {[(j.state, j.error_code) for j in done]}")
    first, last = min(j.created_at for j in done), max(j.finished_at for j in done)
    service_pps = pages / (last - first).total_seconds()
    row = {
        "sandbox": sandbox,
        "storage": storage,
        "output": output,
        "direct_pages_s": float(direct["pages_s"]),
        "service_pages_s": service_pps,
        "ratio": service_pps / direct["pages_s"],
        "jobs": [f"{a}-{b}" for a, b in ranges],
        "worker_cpu_ms_page": worker_ms,
        "direct_cpu_ms_page": float(direct["cpu_ms"]),
        "s3_cpu_ms_page": s3_ms,
    }
    print(
        f"throughput {output}, sandbox {sandbox}, {storage}: direct "
        f"{direct['pages_s']:.1f} pages/s, service {service_pps:.1f} pages/s "
        f"({split} jobs {row['jobs']}), worker tree CPU {worker_ms:.2f} ms/page "
        f"(direct {direct['cpu_ms']:.2f})"
        + (f", S3 server CPU {s3_ms:.2f} ms/page" if storage == "s3" else "")
        + ", "
        f"ratio service / direct {row['ratio']:.2f} (target >= {TARGET_DIRECT_RATIO}) "
        f"{verdict(row['ratio'] >= TARGET_DIRECT_RATIO)}",
        flush=True,
    )
    print(f"  timeline {output}: {_timeline(done)}", flush=True)
    return row


def _timeline(jobs: list) -> str:
    """Per job, in ms from the first job's ``created_at``: accepted, claimed (its attempt's
    ``started_at``), finished; where a run's wall clock goes besides the pages."""
    from conversion_jobs.models import ConversionAttempt

    t0 = min(j.created_at for j in jobs)
    claimed = {
        a.job_id: a.started_at
        for a in ConversionAttempt.objects.filter(job_id__in=[j.id for j in jobs])
    }

    def ms(at: Any) -> str:
        return f"{(at - t0).total_seconds() * 1000:.1f}" if at is not None else "?"

    return "; ".join(
        f"job {j.options.get('pages')}: accepted {ms(j.created_at)}, claimed "
        f"{ms(claimed.get(j.id))}, finished {ms(j.finished_at)} ms"
        for j in sorted(jobs, key=lambda j: j.created_at)
    )


def _tree_cpu_s(pid: int) -> float:
    """CPU seconds of ``pid`` and its living descendants, each with the CPU of the children it
    has reaped (so converter children that came and went are counted by their reaper)."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for each in [pid, *_descendants(pid)]:
        try:
            fields = Path(f"/proc/{each}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += sum(int(fields[i]) for i in (11, 12, 13, 14)) / tick
    return total


def _s3_cpu_s() -> float:
    from _common import S3_PIDS

    return sum(_tree_cpu_s(pid) for pid in S3_PIDS)


#: 200-page PDF, service / a direct pypdfium2 loop with the same process count
#: (docs/TEST_STRATEGY.md §6.1).
TARGET_DIRECT_RATIO = 0.85
#: Sandboxed page throughput within 5 % of unsandboxed (issue 10).
TARGET_SANDBOX_RATIO = 0.95


def sandbox_ratios(rows: list[dict]) -> None:
    """Per output: service pages/s sandboxed / unsandboxed, and the same for the service /
    direct ratios (which cancel the drift of a shared machine between the two runs)."""
    by = {(row["sandbox"], row["output"]): row for row in rows if row["storage"] == "filesystem"}
    for output in dict.fromkeys(row["output"] for row in rows):
        on, off = by.get(("on", output)), by.get(("off", output))
        if on is None or off is None:
            continue
        raw = on["service_pages_s"] / off["service_pages_s"]
        normalised = on["ratio"] / off["ratio"]
        verdict = "met" if normalised >= TARGET_SANDBOX_RATIO else "NOT met"
        print(
            f"sandbox on / off, {output}: pages/s {raw:.3f}; service/direct ratios "
            f"{on['ratio']:.2f} / {off['ratio']:.2f} = {normalised:.3f} "
            f"(target >= {TARGET_SANDBOX_RATIO}: {verdict})",
            flush=True,
        )


def storage_ratios(rows: list[dict]) -> None:
    """Per output: service pages/s with the artifacts in S3 / on the filesystem (same sandbox
    setting), and the service/direct ratios of both."""
    by = {(row["storage"], row["output"]): row for row in rows if row["storage"] == "s3"}
    for fs in rows:
        s3 = by.get(("s3", fs["output"]))
        if fs["storage"] != "filesystem" or s3 is None or s3["sandbox"] != fs["sandbox"]:
            continue
        ratio = s3["service_pages_s"] / fs["service_pages_s"]
        print(
            ratio_line(
                f"{fs['output']} s3 / filesystem (pages/s)",
                ratio,
                S3_TARGET,
                f"filesystem {fs['service_pages_s']:.1f}, s3 {s3['service_pages_s']:.1f} pages/s;"
                f" service/direct {fs['ratio']:.2f} / {s3['ratio']:.2f}",
            ),
            flush=True,
        )


# -- 2. peak RSS ----------------------------------------------------------------------------------


def _status_kb(pid: int, field: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _children(pid: int) -> list[int]:
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    out = []
    for tid in tasks:
        with contextlib.suppress(OSError):
            out += [int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
    return out


def _named(pids: list[int], name: str) -> list[int]:
    found = []
    for pid in pids:
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/comm").read_text().strip() == name:
                found.append(pid)
    return found


def _descendants(pid: int) -> list[int]:
    out = []
    for child in _children(pid):
        out += [child, *_descendants(child)]
    return out


def peak_rss(svc: Service, *, pages: int) -> dict:
    main = svc.worker(concurrency=1)
    source = unique_pdf(svc.scratch / "rss.pdf", pages)
    hwm: dict[str, dict[int, int]] = {"main": {}, "pool": {}, "zygote": {}, "converter": {}}
    peak_sum = [0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            total = 0
            hwm["main"][main.pid] = _status_kb(main.pid, "VmHWM")
            for pool in _children(main.pid):
                hwm["pool"][pool] = max(hwm["pool"].get(pool, 0), _status_kb(pool, "VmHWM"))
                total += _status_kb(pool, "VmRSS")
                # The fork server (inside bwrap when sandboxed), then the children it forked.
                for zygote in _named(_descendants(pool), "quire-zygote"):
                    kb = _status_kb(zygote, "VmHWM")
                    hwm["zygote"][zygote] = max(hwm["zygote"].get(zygote, 0), kb)
                    total += _status_kb(zygote, "VmRSS")
                    for child in _descendants(zygote):
                        kb = _status_kb(child, "VmHWM")
                        hwm["converter"][child] = max(hwm["converter"].get(child, 0), kb)
                        total += _status_kb(child, "VmRSS")
            peak_sum[0] = max(peak_sum[0], total)
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    job = submit(source, output="png", options={"dpi": 150})
    (done,) = wait_terminal([job.id])
    stop.set()
    sampler.join()
    if done.state != "succeeded":
        raise RuntimeError(f"rss job {done.state} {done.error_code}")
    svc.stop(main)
    mb = 1024.0
    pool = max(hwm["pool"].values()) / mb
    zyg = max(hwm["zygote"].values()) / mb
    conv = max(hwm["converter"].values()) / mb
    out = {
        "main_mb": max(hwm["main"].values()) / mb,
        "pool_mb": pool,
        "zygote_mb": zyg,
        "converter_mb": conv,
        "pool_plus_converter_mb": pool + zyg + conv,
        "peak_simultaneous_rss_mb": peak_sum[0] / mb,
        "seconds": (done.finished_at - done.created_at).total_seconds(),
    }
    print(
        f"peak RSS ({pages}-page PDF -> PNG 150 dpi, {out['seconds']:.1f} s): main "
        f"{out['main_mb']:.0f} MB, pool process {pool:.0f} MB, zygote {zyg:.0f} MB, converter "
        f"child {conv:.0f} MB, pool + zygote + child {pool + zyg + conv:.0f} MB (HWM sum, shared "
        f"copy-on-write pages counted twice), peak simultaneous RSS pool + zygote + children "
        f"{out['peak_simultaneous_rss_mb']:.0f} MB",
        flush=True,
    )
    return out


# -- 3. DOCX -> PDF -------------------------------------------------------------------------------


def _docx(path: Path) -> Path:
    from tests import testdocs

    salt = uuid.uuid4().hex
    text = " ".join(["The quick brown fox jumps over the lazy dog."] * 12)
    return testdocs.make_docx(
        path,
        paragraphs=[f"{salt} section {i}. {text}" for i in range(5)],
        page_break_after_each=True,
    )


def soffice_alone(doc: Path, *, profile: Path, outdir: Path) -> float:
    outdir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    subprocess.run(
        [
            "soffice", "--headless", "--norestore", "--nologo", "--nodefault", "--nolockcheck",
            f"-env:UserInstallation={profile.resolve().as_uri()}",
            "--convert-to", "pdf", "--outdir", str(outdir), str(doc),
        ],
        env={"PATH": os.environ["PATH"], "HOME": str(profile.parent), "LANG": "C.UTF-8",
             "SAL_USE_VCLPLUGIN": "svp"},
        stdin=subprocess.DEVNULL, capture_output=True, check=True,
    )  # fmt: skip
    elapsed = time.monotonic() - started
    if not (outdir / (doc.stem + ".pdf")).is_file():
        raise RuntimeError("soffice produced no PDF")
    return elapsed


def docx_overhead(svc: Service, *, runs: int) -> dict:
    base = svc.scratch / "soffice"
    base.mkdir(parents=True, exist_ok=True)
    fresh = [
        soffice_alone(_docx(base / f"f{i}.docx"), profile=base / f"p-fresh-{i}", outdir=base / "o")
        for i in range(runs)
    ]
    reused = [
        soffice_alone(_docx(base / f"r{i}.docx"), profile=base / "p-reused", outdir=base / "o")
        for i in range(runs + 1)
    ][1:]
    worker = svc.worker(concurrency=1)
    times = []
    for i in range(runs + 1):
        job = submit(_docx(svc.scratch / f"svc{i}.docx"), output="pdf")
        (done,) = wait_terminal([job.id])
        if done.state != "succeeded":
            raise RuntimeError(f"docx job {done.state} {done.error_code}")
        times.append((done.finished_at - done.created_at).total_seconds())
    svc.stop(worker)
    alone_fresh, alone_reused = statistics.median(fresh), statistics.median(reused)
    out = {
        "pages": done.source_page_count,
        "soffice_fresh_profile_s": fresh,
        "soffice_reused_profile_s": reused,
        "service_cold_s": times[0],
        "service_warm_s": times[1:],
        "overhead_cold_s": times[0] - alone_fresh,
        "overhead_warm_s": statistics.median(times[1:]) - alone_fresh,
    }
    print(
        f"DOCX -> PDF ({out['pages']} pages): soffice alone fresh profile "
        f"{', '.join(f'{t:.2f}' for t in fresh)} s (median {alone_fresh:.2f}), reused profile "
        f"{', '.join(f'{t:.2f}' for t in reused)} s (median {alone_reused:.2f}); service cold "
        f"{times[0]:.2f} s, warm {', '.join(f'{t:.2f}' for t in times[1:])} s; overhead over "
        f"soffice alone (fresh profile): cold {out['overhead_cold_s']:+.2f} s, warm "
        f"{out['overhead_warm_s']:+.2f} s (warm vs reused-profile soffice: "
        f"{statistics.median(times[1:]) - alone_reused:+.2f} s)",
        flush=True,
    )
    return out


# -- 4. warm LibreOffice engine (ADR 0019) --------------------------------------------------------


def _rss_tree_kb(pid: int) -> int:
    """Resident memory of ``pid``'s whole tree (worker, pool, fork server, engine host, soffice)."""
    return sum(_status_kb(p, "VmRSS") for p in [pid, *_descendants(pid)])


def _docx_batch(svc: Service, name: str, n: int) -> list:
    return [submit(_docx(svc.scratch / f"{name}-{i}.docx"), output="pdf") for i in range(n)]


def _rate(jobs: list) -> float:
    bad = [(j.state, j.error_code) for j in jobs if j.state != "succeeded"]
    if bad:
        raise RuntimeError(f"docx jobs did not succeed: {bad[:3]}")
    span = max(j.finished_at for j in jobs) - min(j.created_at for j in jobs)
    return len(jobs) / span.total_seconds()


def office_engine(
    svc: Service,
    *,
    runs: int,
    batch: int,
    rss_conversions: int,
    parts: set[str],
    rss_max_conversions: int = 1000,
) -> dict:
    """Warm engine vs LibreOffice alone (fresh process), throughput engine off vs on with the
    Procfile's worker, and the worker tree's RSS after 10 and after ``rss_conversions``.
    ``parts``: which of ``e2e``, ``rate``, ``rss`` to run."""
    out: dict = {}
    if "e2e" in parts:
        out.update(_engine_e2e(svc, runs=runs))
    if "rate" in parts:
        out.update(_engine_rate(svc, batch=batch))
    if "rss" in parts:
        out.update(
            _engine_rss(svc, rss_conversions=rss_conversions, max_conversions=rss_max_conversions)
        )
    return out


def _engine_e2e(svc: Service, *, runs: int) -> dict:
    base = svc.scratch / "soffice-engine"
    base.mkdir(parents=True, exist_ok=True)
    fresh = [
        soffice_alone(_docx(base / f"f{i}.docx"), profile=base / f"p{i}", outdir=base / "o")
        for i in range(runs)
    ]
    alone = statistics.median(fresh)
    # (a) end to end, one job at a time, warm engine
    worker = svc.worker(concurrency=1, QUIRE_OFFICE_ENGINE="warm")
    wait_terminal([j.id for j in _docx_batch(svc, "warmup", 2)])
    times = []
    for i in range(runs):
        (done,) = wait_terminal([submit(_docx(svc.scratch / f"e2e{i}.docx"), output="pdf").id])
        if done.state != "succeeded":
            raise RuntimeError(f"docx job {done.state} {done.error_code}")
        times.append((done.finished_at - done.created_at).total_seconds())
    svc.stop(worker)
    median = statistics.median(times)
    p95 = sorted(times)[max(0, round(0.95 * len(times)) - 1)]
    print(
        f"warm engine, 5-page DOCX -> PDF end to end: median {median:.3f} s, p95 {p95:.3f} s; "
        f"soffice alone fresh {', '.join(f'{t:.2f}' for t in fresh)} s (median {alone:.2f}); "
        f"median ratio {median / alone:.2f} (target <= 0.4) {verdict(median / alone <= 0.4)}, "
        f"p95 ratio {p95 / alone:.2f} (target <= 0.6) {verdict(p95 / alone <= 0.6)}",
        flush=True,
    )
    return {"soffice_fresh_s": fresh, "service_warm_s": times, "median_ratio": median / alone,
            "p95_ratio": p95 / alone}  # fmt: skip


def _engine_rate(svc: Service, *, batch: int) -> dict:
    """(b) documents per second, the Procfile's worker (concurrency 2), engine off vs on."""
    rates = {}
    for mode in ("fresh", "warm"):
        worker = svc.worker(concurrency=2, QUIRE_OFFICE_ENGINE=mode)
        wait_terminal([j.id for j in _docx_batch(svc, f"warm-{mode}", 2)])
        rates[mode] = _rate(wait_terminal([j.id for j in _docx_batch(svc, mode, batch)]))
        svc.stop(worker)
        print(f"{batch} DOCX -> PDF, engine {mode}: {rates[mode]:.2f} docs/s", flush=True)
    ratio = rates["warm"] / rates["fresh"]
    print(
        f"{batch} DOCX -> PDF, Procfile worker (concurrency 2): engine off "
        f"{rates['fresh']:.2f} docs/s, warm {rates['warm']:.2f} docs/s; ratio "
        f"{ratio:.2f} (target >= 2.5) {verdict(ratio >= 2.5)}",
        flush=True,
    )
    return {"docs_per_s": rates, "throughput_ratio": ratio}


def _engine_rss(svc: Service, *, rss_conversions: int, max_conversions: int) -> dict:
    """(c) RSS of the worker's tree with a warm engine after 10 and after rss_conversions. With
    ``max_conversions`` above ``rss_conversions`` one engine serves them all (what is measured
    is LibreOffice's own creep); with the default (50) the engine has just been recycled at 200
    and the figure says what a worker carries in production."""
    worker = svc.worker(
        concurrency=1,
        QUIRE_OFFICE_ENGINE="warm",
        QUIRE_OFFICE_ENGINE_MAX_CONVERSIONS=str(max_conversions),
    )
    wait_terminal([j.id for j in _docx_batch(svc, "rss10", 10)])
    rss_10 = _rss_tree_kb(worker.pid)
    wait_terminal([j.id for j in _docx_batch(svc, "rssN", rss_conversions - 10)])
    rss_n = _rss_tree_kb(worker.pid)
    svc.stop(worker)
    out = {"rss_kb": {"after_10": rss_10, f"after_{rss_conversions}": rss_n}}
    out["rss_ratio"] = rss_n / rss_10
    print(
        f"worker tree RSS with a warm engine (recycled every {max_conversions}): after 10 "
        f"conversions {rss_10 / 1024:.0f} MB, after "
        f"{rss_conversions} {rss_n / 1024:.0f} MB; ratio {out['rss_ratio']:.2f} (target <= 1.2) "
        f"{verdict(out['rss_ratio'] <= 1.2)}",
        flush=True,
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pages", type=int, default=200)
    parser.add_argument("--split", type=int, default=2)
    parser.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="throughput: direct and service alternated this many times per output, medians",
    )
    parser.add_argument("--rss-pages", type=int, default=300)
    parser.add_argument("--docx-runs", type=int, default=3)
    parser.add_argument("--outputs", default="text,png")
    parser.add_argument("--engine-runs", type=int, default=10)
    parser.add_argument("--engine-batch", type=int, default=20)
    parser.add_argument("--engine-rss", type=int, default=200)
    parser.add_argument("--engine-parts", default="e2e,rate,rss")
    parser.add_argument(
        "--engine-rss-max-conversions",
        type=int,
        default=1000,
        help="engine recycling for the RSS part (above --engine-rss: one engine serves all)",
    )
    parser.add_argument("--skip", default="")
    parser.add_argument("--keep", action="store_true")
    parser.add_argument(
        "--sandbox",
        choices=["both", "on", "off"],
        default="both",
        help="converter sandbox setting(s) for the throughput part (both: on, then off)",
    )
    parser.add_argument(
        "--storage",
        choices=["filesystem", "s3"],
        default="filesystem",
        help="s3: run the throughput part once more with the artifacts in S3 (SeaweedFS)",
    )
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="py-spy the worker tree during each throughput run into this directory "
        "(BENCH_PROFILE_GIL=1: only GIL-holding threads)",
    )
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    print(f"load at start: {os.getloadavg()}", flush=True)
    with service(bench_db_name("quire_cx_pages"), keep=args.keep) as svc:
        if "throughput" not in skip:
            modes = ["on", "off"] if args.sandbox == "both" else [args.sandbox]
            part = {
                "pages": args.pages,
                "split": args.split,
                "rounds": args.rounds,
                "outputs": args.outputs.split(","),
                "profile": args.profile,
            }
            rows = [row for mode in modes for row in throughput(svc, sandbox=mode, **part)]
            if args.storage == "s3":
                with s3_server(svc.scratch) as env, storage_in_process(env):
                    rows += throughput(svc, sandbox=modes[0], storage="s3", **part, **env)
            sandbox_ratios(rows)
            storage_ratios(rows)
        if "rss" not in skip:
            peak_rss(svc, pages=args.rss_pages)
        if "docx" not in skip:
            docx_overhead(svc, runs=args.docx_runs)
        if "engine" not in skip:
            office_engine(
                svc,
                runs=args.engine_runs,
                batch=args.engine_batch,
                rss_conversions=args.engine_rss,
                parts=set(args.engine_parts.split(",")),
                rss_max_conversions=args.engine_rss_max_conversions,
            )
    print(f"load at end: {os.getloadavg()}", flush=True)


if __name__ == "__main__":
    main()
