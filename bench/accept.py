"""Acceptance throughput over the real HTTP stack, against a same-run baseline (issue 2).

    .venv/bin/python bench/accept.py [--clients 16] [--warm 5] [--measure 20] [--idle-polls 1000]
                                     [--storage filesystem|s3] [--history N]

What runs:

* a fresh Postgres database ``quire_bench`` (dropped and migrated by this script);
* a throwaway RabbitMQ vhost carrying ``deploy/rabbitmq/definitions.json``, published to as the
  least-privilege ``quire_publisher`` (its ``quire`` permissions copied); deleting the vhost at
  the end purges everything published;
* the Procfile's ``web`` command (gunicorn + uvicorn workers, ADR 0016; ``WEB_CONCURRENCY``
  processes x ``WEB_THREADS`` sync threads);
* phase 1, baseline: a bare Django view that inserts one row (``bench/baseline_app``), served by
  the same command with the same request bytes;
* phase 2, gthread: Quire on the web command before ADR 0016 (WSGI, gunicorn gthread,
  ``WEB_CONCURRENCY`` x ``WEB_THREADS`` threads) for comparison (``--skip-gthread`` skips it);
* phase 3, asgi: Quire on the Procfile's command: ``POST /api/v1/jobs`` with a unique 10 KB PDF
  per request (``output=text``, an ``Idempotency-Key`` on every request), 10 % of requests
  replaying an earlier key + document. Tenant quota and global capacity are raised so nothing
  is rejected;
* phase 4, asgi+idle: phase 3 again on the same server while ``--idle-polls`` (1,000) long-polls
  (``?wait=30`` with a current ``If-None-Match``, re-sent when they time out) are held open
  (``--idle-polls 0`` skips it);
* phase 5, asgi-s3 (``--storage s3``, issue 14): phase 3 on a fresh server whose artifact store
  is a real S3 server (SeaweedFS, ``tests/s3server.py``, free loopback ports): ratio s3 /
  filesystem, target >= 0.8;
* phase 6, asgi+Nk (``--history N``, TEST_STRATEGY §6.1): N finished jobs seeded
  (``bench/history.py``, then VACUUM ANALYZE), phase 3 again on a fresh server: ratio to the empty
  tables, target >= 0.9. It runs last (the seed stays).

The 10 KB document is an inline source (stored in Postgres with the acceptance, ADR 0017
session 10); ``BENCH_SOURCE=stored`` sets ``QUIRE_INLINE_SOURCE_MAX_BYTES=0`` on every Quire web
so the store's put is measured (the S3 / filesystem ratio of phase 5 is a stored-path figure).

Every Quire phase starts from an empty job table (``TRUNCATE conversion_job CASCADE``; the
history phase truncates before it seeds): no worker runs, so a phase leaves thousands of live
jobs, which each web process's admission snapshot counts (at most every 0.25 s, ADR 0004).

Each phase: ``--clients`` threads on keep-alive connections, ``--warm`` seconds discarded, then
``--measure`` seconds measured. Prints accepted/s, p50/p99 latency, the ratio to the baseline,
and the CPU used by the client, gunicorn, Postgres, RabbitMQ and the whole machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as c

#: One database per checkout (QUIRE_RMQ_VHOST names it): parallel checkouts on one host must not
#: drop each other's benchmark database mid-run.
DB_NAME = c.bench_db_name("quire_bench")
BASELINE_SETTINGS = "bench.baseline_app.settings"
#: docs/TEST_STRATEGY.md §6.1 (ratio to the bare insert view, p99), issue 2 (rate), ADR 0016 (idle
#: long-polls).
TARGETS = {"accepted_per_s": 600.0, "p99_ms": 100.0, "ratio": 0.4, "idle_ratio": 0.9}


@dataclass
class PhaseResult:
    name: str
    seconds: float
    by_status: dict[int, int] = field(default_factory=dict)
    latencies_ms: list[float] = field(default_factory=list)
    new_latencies_ms: list[float] = field(default_factory=list)
    cpu: dict[str, float] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    def rate(self, status: int) -> float:
        return self.by_status.get(status, 0) / self.seconds

    def pct(self, q: float, *, new_only: bool = False) -> float:
        return c.percentile(self.new_latencies_ms if new_only else self.latencies_ms, q)


class RequestFactory:
    """Prebuilt request bytes: headers + multipart body around a unique 10 KB PDF."""

    def __init__(self, *, path: str, token: str, port: int) -> None:
        self.doc, self.slot = c.pdf_template(10 * 1024)
        self.path, self.token, self.port = path, token, port
        self.boundary = "quirebench" + uuid.uuid4().hex

    def build(self) -> bytes:
        uid = uuid.uuid4().hex.encode()
        doc = self.doc[: self.slot] + uid + self.doc[self.slot + len(uid) :]
        body = c.multipart([("output", b"text", None), ("file", doc, "bench.pdf")], self.boundary)
        head = (
            f"POST {self.path} HTTP/1.1\r\n"
            f"Host: 127.0.0.1:{self.port}\r\n"
            f"Authorization: Bearer {self.token}\r\n"
            f"Idempotency-Key: bench-{uid.decode()}\r\n"
            f"Content-Type: multipart/form-data; boundary={self.boundary}\r\n"
            f"Content-Length: {len(body)}\r\n"
            "Connection: keep-alive\r\n\r\n"
        )
        return head.encode() + body


class IdleLongPolls:
    """``count`` long-polls held open on a thread of their own (one asyncio loop, raw
    sockets): each waits ``?wait=30`` on a job that does not change and is sent again when it
    times out (304), so ``count`` are parked at any moment."""

    def __init__(self, *, port: int, token: str, job_ids: list[str], count: int) -> None:
        self.port, self.token, self.job_ids, self.count = port, token, job_ids, count
        self.answers: dict[int, int] = {}
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def __enter__(self) -> IdleLongPolls:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    async def _run(self) -> None:
        gate = asyncio.Semaphore(50)
        tasks = [asyncio.create_task(self._one(i, gate)) for i in range(self.count)]
        while not self._stop.is_set():
            await asyncio.sleep(0.2)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _one(self, i: int, gate: asyncio.Semaphore) -> None:
        job_id = self.job_ids[i % len(self.job_ids)]

        def request(etag: bytes) -> bytes:
            """Without an ETag yet the first long-poll parks on the representation it finds;
            then each sends back the ETag of the last answer (opaque: API_CONTRACT §2.2)."""
            condition = b"If-None-Match: " + etag + b"\r\n" if etag else b""
            return (
                (
                    f"GET /api/v1/jobs/{job_id}?wait=30 HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                    f"Authorization: Bearer {self.token}\r\n"
                ).encode()
                + condition
                + b"\r\n"
            )

        etag = b""
        raw = request(etag)
        while True:
            try:
                async with gate:
                    reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
                    writer.write(raw)
                    await writer.drain()
                while True:  # keep-alive: the next long-poll on the same connection
                    head = await reader.readuntil(b"\r\n\r\n")
                    status = int(head.split(b" ", 2)[1])
                    length = 0
                    for line in head.split(b"\r\n")[1:]:
                        name, _, value = line.partition(b":")
                        if name.strip().lower() == b"content-length":
                            length = int(value)
                        elif name.strip().lower() == b"etag":
                            etag = value.strip()
                    if length:
                        await reader.readexactly(length)
                    self.answers[status] = self.answers.get(status, 0) + 1
                    raw = request(etag)
                    writer.write(raw)
                    await writer.drain()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if len(self.errors) < 5:
                    self.errors.append(f"{type(exc).__name__}: {exc}")
                await asyncio.sleep(0.5)


def submit_one(factory: RequestFactory) -> str:
    http = c.HttpClient(factory.port)
    try:
        status, _, body = http.request(factory.build())
    finally:
        http.close()
    if status != 202:
        raise RuntimeError(f"could not submit a job to long-poll on: {status} {body[:200]!r}")
    return str(json.loads(body)["id"])


def drive(
    *,
    name: str,
    port: int,
    factories: list[RequestFactory],
    clients: int,
    warm: float,
    measure: float,
    replay: float,
    server: c.Server,
    ok: set[int],
    profile_dir: Path | None = None,
) -> PhaseResult:
    result = PhaseResult(name=name, seconds=measure)
    lock = threading.Lock()
    start_evt = threading.Event()
    t0 = 0.0
    stop_at = 0.0

    def client(i: int) -> None:
        rng = random.Random(i)
        http = c.HttpClient(port)
        factory = factories[i % len(factories)]
        sent: list[bytes] = []
        local: list[tuple[float, float, int, bool]] = []
        errors: list[str] = []
        start_evt.wait()
        while True:
            is_replay = bool(sent) and rng.random() < replay
            raw = rng.choice(sent) if is_replay else factory.build()
            began = time.perf_counter()
            if began >= stop_at:
                break
            try:
                status, _, body = http.request(raw)
            except Exception as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
                continue
            ended = time.perf_counter()
            if status not in ok and len(errors) < 5:
                errors.append(f"{status}: {body[:200]!r}")
            if not is_replay and status in ok:
                sent.append(raw)
                if len(sent) > 200:
                    sent.pop(0)
            local.append((began, (ended - began) * 1000, status, not is_replay))
        http.close()
        with lock:
            for began, ms, status, new in local:
                if t0 + warm <= began < stop_at:
                    result.by_status[status] = result.by_status.get(status, 0) + 1
                    result.latencies_ms.append(ms)
                    if new:
                        result.new_latencies_ms.append(ms)
            result.errors.extend(errors)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    t0 = time.perf_counter()
    stop_at = t0 + warm + measure
    start_evt.set()
    time.sleep(warm)
    snap0 = _cpu_snapshot(server)
    spies = (
        c.py_spy_record(server.worker_pids(), seconds=measure, out_dir=profile_dir)
        if profile_dir
        else []
    )
    time.sleep(measure)
    snap1 = _cpu_snapshot(server)
    for spy in spies:
        spy.wait()
    for t in threads:
        t.join()
    result.latencies_ms.sort()
    result.new_latencies_ms.sort()
    busy = snap1["machine_busy"] - snap0["machine_busy"]
    total = snap1["machine_total"] - snap0["machine_total"]
    ncpu = os.cpu_count() or 1
    for key in ("client", "gunicorn", "postgres", "rabbitmq", "s3"):
        result.cpu[key] = (snap1[key] - snap0[key]) / measure
    result.cpu["machine"] = busy / total * ncpu if total else float("nan")
    return result


def _cpu_snapshot(server: c.Server) -> dict[str, float]:
    busy, total = c.machine_cpu()
    return {
        "client": time.process_time(),
        "gunicorn": sum(c.proc_cpu_s(p) for p in [server.proc.pid, *server.worker_pids()]),
        "postgres": sum(c.proc_cpu_s(p) for p in c.pids_named("^postgres")),
        "rabbitmq": sum(c.proc_cpu_s(p) for p in c.pids_named("beam.smp")),
        "s3": sum(c.proc_cpu_s(p) for p in c.S3_PIDS),
        "machine_busy": busy,
        "machine_total": total,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--warm", type=float, default=5.0, help="seconds discarded per phase")
    parser.add_argument("--measure", type=float, default=20.0, help="seconds measured per phase")
    parser.add_argument("--replay", type=float, default=0.10, help="share of idempotent replays")
    parser.add_argument("--tenants", type=int, default=4)
    parser.add_argument("--skip-baseline", action="store_true")
    parser.add_argument("--skip-gthread", action="store_true", help="no pre-ADR-0016 phase")
    parser.add_argument(
        "--idle-polls", type=int, default=1000, help="long-polls held open in phase asgi+idle"
    )
    parser.add_argument("--keep", action="store_true", help="keep the database and storage")
    parser.add_argument(
        "--storage",
        choices=["filesystem", "s3"],
        default="filesystem",
        help="s3: add a Quire phase with the artifacts in S3 (SeaweedFS), print the ratio",
    )
    parser.add_argument(
        "--history",
        type=int,
        default=0,
        help="last, seed this many finished jobs (bench/history.py) and run the Quire phase "
        "again: prints the ratio to the empty tables (target >= 0.9)",
    )
    parser.add_argument(
        "--py-spy",
        type=Path,
        metavar="DIR",
        help="record the Quire phase's gunicorn workers with py-spy into DIR",
    )
    args = parser.parse_args()

    workers = os.environ.setdefault("WEB_CONCURRENCY", "2")
    threads = os.environ.setdefault("WEB_THREADS", "8")
    publisher = os.environ.get("QUIRE_RMQ_PUBLISHER_USER", "quire_publisher")
    password = os.environ.get("QUIRE_RMQ_PUBLISHER_PASSWORD", "quire-publisher-dev")
    load_before = os.getloadavg()
    facts: dict[str, object] = {}
    import resource

    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # the idle long-polls' sockets
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

    db_url = c.recreate_database(DB_NAME)
    storage = Path(tempfile.mkdtemp(prefix="quire-bench-"))
    env = c.base_env(
        DATABASE_URL=db_url,
        QUIRE_STORAGE_DIR=str(storage / "storage"),
        QUIRE_WORK_DIR=str(storage / "work"),
        QUIRE_VAR_DIR=str(storage / "var"),
        QUIRE_TENANT_QUOTA=str(10**9),
        QUIRE_GLOBAL_CAPACITY=str(10**9),
        QUIRE_LOG_LEVEL=os.environ.get("QUIRE_LOG_LEVEL", "WARNING"),
        WEB_CONCURRENCY=workers,
        WEB_THREADS=threads,
    )
    if os.environ.get("BENCH_SOURCE", "inline") == "stored":
        env["QUIRE_INLINE_SOURCE_MAX_BYTES"] = "0"
    env.pop("DJANGO_SETTINGS_MODULE", None)
    try:
        with c.throwaway_vhost(user=publisher, password=password) as broker_url:
            env["CELERY_BROKER_URL"] = broker_url
            c.run(
                [c.PYTHON, "manage.py", "migrate", "--noinput", "-v", "0"],
                env={**env, "DJANGO_SETTINGS_MODULE": BASELINE_SETTINGS},
            )
            tokens = [
                c.run(
                    [
                        c.PYTHON,
                        "manage.py",
                        "mint_token",
                        "--tenant",
                        f"bench-{n}",
                        "--scope",
                        "jobs:submit",
                    ],
                    env=env,
                ).strip()
                for n in range(args.tenants)
            ]
            baseline = None
            if not args.skip_baseline:
                with c.gunicorn(
                    env={**env, "DJANGO_SETTINGS_MODULE": BASELINE_SETTINGS},
                    log=storage / "gunicorn-baseline.log",
                ) as server:
                    factories = [
                        RequestFactory(path="/bench/baseline", token=t, port=server.port)
                        for t in tokens
                    ]
                    baseline = drive(
                        name="baseline",
                        port=server.port,
                        factories=factories,
                        clients=args.clients,
                        warm=args.warm,
                        measure=args.measure,
                        replay=0.0,
                        server=server,
                        ok={201},
                    )
            readers = [
                c.run(
                    [
                        c.PYTHON,
                        "manage.py",
                        "mint_token",
                        "--tenant",
                        f"bench-{n}",
                        "--scope",
                        "jobs:submit jobs:read",
                    ],
                    env=env,
                ).strip()
                for n in range(args.tenants)
            ]
            quire_env = {**env, "DJANGO_SETTINGS_MODULE": "project.settings"}

            def no_live_jobs() -> None:
                """Every Quire phase starts from an empty job table: no worker runs here, so
                each phase leaves thousands of live jobs, and the acceptance pre-check's
                admission count reads every live job per request; without this a later phase
                (S3, +history) would pay for the earlier phases' backlog."""
                import psycopg

                with psycopg.connect(db_url, autocommit=True) as conn:
                    conn.execute("TRUNCATE conversion_job CASCADE")

            def quire_phase(
                name: str, server: c.Server, spy: Path | None = None, fresh: bool = True
            ) -> PhaseResult:
                if fresh:
                    no_live_jobs()
                return drive(
                    name=name,
                    port=server.port,
                    factories=[
                        RequestFactory(path="/api/v1/jobs", token=t, port=server.port)
                        for t in tokens
                    ],
                    clients=args.clients,
                    warm=args.warm,
                    measure=args.measure,
                    replay=args.replay,
                    server=server,
                    ok={200, 202},
                    profile_dir=spy,
                )

            gthread = idle = s3 = history = None
            if not args.skip_gthread:
                with c.gunicorn(
                    env=quire_env,
                    log=storage / "gunicorn-gthread.log",
                    command=c.GTHREAD_WEB_COMMAND,
                ) as server:
                    gthread = quire_phase("gthread", server)
            with c.gunicorn(env=quire_env, log=storage / "gunicorn-quire.log") as server:
                quire = quire_phase("asgi", server, args.py_spy)
                if args.idle_polls:
                    factory = RequestFactory(
                        path="/api/v1/jobs", token=readers[0], port=server.port
                    )
                    no_live_jobs()
                    job_ids = [submit_one(factory) for _ in range(20)]
                    with IdleLongPolls(
                        port=server.port, token=readers[0], job_ids=job_ids, count=args.idle_polls
                    ) as polls:
                        time.sleep(5)  # all parked
                        idle = quire_phase("asgi+idle", server, fresh=False)
                    idle.errors.extend(f"long-poll: {e}" for e in polls.errors)
                    facts["idle_answers"] = dict(polls.answers)
            if args.storage == "s3":
                with (
                    c.s3_server(storage) as s3_env,
                    c.gunicorn(
                        env={**quire_env, **s3_env, "QUIRE_UPLOAD_DIR": str(storage / "uploads")},
                        log=storage / "gunicorn-quire-s3.log",
                    ) as server,
                ):
                    s3 = quire_phase("asgi-s3", server, args.py_spy / "s3" if args.py_spy else None)
            if args.history:
                no_live_jobs()
                seed_s = c.seed_history_db(db_url, args.history)
                print(f"seeded {args.history} finished jobs in {seed_s:.0f} s", flush=True)
                with c.gunicorn(env=quire_env, log=storage / "gunicorn-history.log") as server:
                    history = quire_phase(f"asgi+{args.history // 1000}k", server, fresh=False)
            time.sleep(1.0)
            jobs = c.best_effort(c.sql_scalar, db_url, "SELECT count(*) FROM conversion_job")
            unpublished = c.best_effort(
                c.sql_scalar,
                db_url,
                "SELECT count(*) FROM conversion_outbox WHERE published_at IS NULL",
            )
            queued_msgs = c.best_effort(c.queue_depth, broker_url, "conversion.v1")
    finally:
        if not args.keep:
            shutil.rmtree(storage, ignore_errors=True)
            c.best_effort(c.drop_database, DB_NAME)

    facts |= {
        "workers": workers,
        "threads": threads,
        "clients": args.clients,
        "warm": args.warm,
        "measure": args.measure,
        "load": load_before[0],
        "jobs": jobs,
        "unpublished": unpublished,
        "queued_msgs": queued_msgs,
        "kept": storage if args.keep else None,
        "idle_polls": args.idle_polls,
        "history": args.history,
    }
    report(
        baseline=baseline,
        gthread=gthread,
        quire=quire,
        idle=idle,
        s3=s3,
        history=history,
        facts=facts,
    )
    return 0


def _row(r: PhaseResult) -> str:
    new_status, replay_status = (201, None) if r.name == "baseline" else (202, 200)
    replays = r.rate(replay_status) if replay_status else 0.0
    ok = r.rate(new_status) + replays
    bad = sum(n for s, n in r.by_status.items() if s not in (new_status, replay_status))
    worst = r.latencies_ms[-1] if r.latencies_ms else float("nan")
    return (
        f"{r.name:<10} {ok:>8.1f} {r.rate(new_status):>8.1f} {replays:>9.1f} "
        f"{r.pct(50):>8.1f} {r.pct(99):>8.1f} {worst:>8.1f} {bad + len(r.errors):>7}"
    )


def _cpu_row(r: PhaseResult) -> str:
    cpu = r.cpu
    per_s = sum(r.by_status.values()) / r.seconds or float("nan")
    return (
        f"{r.name:<10} {cpu['client']:>7.2f} {cpu['gunicorn']:>9.2f} {cpu['postgres']:>9.2f} "
        f"{cpu['rabbitmq']:>9.2f} {cpu['machine']:>8.2f} "
        f"{cpu['gunicorn'] / per_s * 1000:>16.2f} {cpu['postgres'] / per_s * 1000:>16.2f}"
    )


def report(
    *,
    baseline: PhaseResult | None,
    gthread: PhaseResult | None,
    quire: PhaseResult,
    idle: PhaseResult | None,
    s3: PhaseResult | None,
    history: PhaseResult | None,
    facts: dict[str, object],
) -> None:
    print()
    print(
        f"WEB_CONCURRENCY={facts['workers']} WEB_THREADS={facts['threads']} (asgi: uvicorn "
        "workers with that many sync threads each; gthread: that many threads); "
        f"clients={facts['clients']}; warm {facts['warm']:g} s + measure {facts['measure']:g} s "
        f"per phase; cores={os.cpu_count()}; load average before {facts['load']:.2f}"
    )
    print()
    header = (
        f"{'phase':<10} {'ok/s':>8} {'new/s':>8} {'replay/s':>9} {'p50 ms':>8} {'p99 ms':>8} "
        f"{'max ms':>8} {'errors':>7}"
    )
    print(header)
    print("-" * len(header))
    rows = [r for r in (baseline, gthread, quire, idle, s3, history) if r is not None]
    for r in rows:
        print(_row(r))
    print()
    print("CPU (cores busy over the measured window):")
    print(
        f"{'phase':<10} {'client':>7} {'web':>9} {'postgres':>9} {'rabbitmq':>9} "
        f"{'machine':>8} {'web ms/req':>16} {'postgres ms/req':>16}"
    )
    for r in rows:
        print(_cpu_row(r))
    print("(postgres / rabbitmq / machine include whatever else runs on this host)")
    print()
    accepted = quire.rate(202)
    p50, p99 = quire.pct(50), quire.pct(99)
    base = baseline.rate(201) if baseline else 0.0
    ratio = accepted / base if base else float("nan")
    print(
        f"accepted jobs/s          {accepted:8.1f}   target >= {TARGETS['accepted_per_s']:.0f}   "
        f"{c.verdict(accepted >= TARGETS['accepted_per_s'])}"
    )
    print(
        f"p50 / p99 latency (all)  {p50:5.1f} / {p99:5.1f} ms   "
        f"target p99 <= {TARGETS['p99_ms']:.0f}   {c.verdict(p99 <= TARGETS['p99_ms'])}"
    )
    new50, new99 = quire.pct(50, new_only=True), quire.pct(99, new_only=True)
    print(f"p50 / p99 latency (new)  {new50:5.1f} / {new99:5.1f} ms")
    print(
        f"ratio to baseline        {ratio:8.2f}   target >= {TARGETS['ratio']}   "
        f"{c.verdict(ratio >= TARGETS['ratio'])}"
    )
    if gthread is not None:
        old = gthread.rate(202)
        print(
            f"asgi vs gthread          {accepted:8.1f} vs {old:.1f} accepted/s = "
            f"{accepted / old if old else float('nan'):.2f}x; p99 {p99:.1f} vs "
            f"{gthread.pct(99):.1f} ms"
        )
    if idle is not None:
        held = idle.rate(202)
        idle_ratio = held / accepted if accepted else float("nan")
        print(
            f"with {facts.get('idle_polls')} idle long-polls {held:8.1f} accepted/s = "
            f"{idle_ratio:.2f}x without   target >= {TARGETS['idle_ratio']}   "
            f"{c.verdict(idle_ratio >= TARGETS['idle_ratio'])}; p99 {idle.pct(99):.1f} ms; "
            f"long-poll answers {facts.get('idle_answers')}"
        )
    if s3 is not None:
        s3_ratio = s3.rate(202) / accepted if accepted else float("nan")
        print(
            c.ratio_line(
                "asgi-s3 / asgi (artifacts in S3 / filesystem)",
                s3_ratio,
                c.S3_TARGET,
                f"{s3.rate(202):.1f} accepted/s, p99 {s3.pct(99):.1f} ms, S3 server "
                f"{s3.cpu['s3'] / (sum(s3.by_status.values()) / s3.seconds) * 1000:.2f} "
                "ms CPU/req",
            )
        )
    if history is not None:
        h_ratio = history.rate(202) / accepted if accepted else float("nan")
        print(
            c.ratio_line(
                f"{history.name} / asgi ({facts['history']} finished jobs / empty)",
                h_ratio,
                c.HISTORY_TARGET,
                f"{history.rate(202):.1f} accepted/s, p99 {history.pct(99):.1f} ms",
            )
        )
    print(
        f"database: {facts['jobs']} jobs, {facts['unpublished']} outbox rows unpublished; "
        f"conversion.v1 holds {facts['queued_msgs']} messages"
    )
    for r in rows:
        for err in r.errors[:5]:
            print(f"  {r.name} error: {err}")
    if facts.get("kept"):
        print(f"kept: database {DB_NAME}, storage and gunicorn logs under {facts['kept']}")


if __name__ == "__main__":
    sys.exit(main())
