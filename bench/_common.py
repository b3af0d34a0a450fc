"""Shared benchmark helpers: a fresh Postgres database, a throwaway RabbitMQ vhost carrying the
production topology, gunicorn started from the Procfile's ``web`` command, synthetic PDFs, a
light keep-alive HTTP client, CPU accounting and percentiles.

Benchmarks run by hand (docs/TEST_STRATEGY.md §6); nothing here is imported by the product or the
tests.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

ROOT = Path(__file__).resolve().parent.parent
#: the checkout's environment, or the running interpreter's (a worktree shares one environment and
#: has no ``.venv`` of its own: ``throughput.py`` starts ``VENV_BIN / "celery"``)
VENV_BIN = ROOT / ".venv" / "bin"
if not (VENV_BIN / "python").exists():
    VENV_BIN = Path(sys.executable).parent
PYTHON = str(VENV_BIN / "python") if (VENV_BIN / "python").exists() else sys.executable
T = TypeVar("T")
PG_ADMIN_URL = os.environ.get("BENCH_PG_ADMIN_URL", "postgres://postgres@127.0.0.1:5432/postgres")

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from conversion_jobs.secret_policy import SECRET_VARIABLES, generated  # noqa: E402

# The production profile refuses development secrets (conversion_jobs/secret_policy.py): this
# process and every process it starts share random ones of this run, unless they are set.
os.environ.update({k: v for k, v in generated().items() if not os.environ.get(k)})


# -- processes ------------------------------------------------------------------------------------


def base_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PATH": f"{VENV_BIN}:{os.environ.get('PATH', '')}"}
    env.update(extra)
    return env


def best_effort(fn: Callable[..., T], *args: object) -> T | str:
    """``fn(*args)``, or a short error text: the host is shared, and a broker or database
    restarted by someone else must not throw away a finished measurement."""
    try:
        return fn(*args)
    except Exception as exc:
        msg = f"unavailable ({type(exc).__name__}: {str(exc).strip().splitlines()[0][:120]})"
        print(f"warning: {getattr(fn, '__name__', fn)}{args!r}: {msg}", file=sys.stderr)
        return msg


def run(cmd: list[str], *, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(
            f"{shlex.join(cmd)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
        )
    return done.stdout


def procfile_command(name: str) -> str:
    for line in (ROOT / "Procfile").read_text().splitlines():
        if line.startswith(f"{name}:"):
            return line.split(":", 1)[1].strip()
    raise KeyError(f"no {name!r} process in the Procfile")


#: The Procfile's ``web`` line before ADR 0016 (WSGI, gthread), kept to compare against.
GTHREAD_WEB_COMMAND = (
    "env CELERY_BROKER_WRITE_URL=${QUIRE_BROKER_PUBLISHER_URL:-} "
    "PROMETHEUS_MULTIPROC_DIR=${PROMETHEUS_MULTIPROC_DIR:-var/metrics} "
    "gunicorn project.wsgi:application --bind ${QUIRE_BIND:-127.0.0.1:8000} "
    "--workers ${WEB_CONCURRENCY:-6} --threads ${WEB_THREADS:-2} --worker-class gthread "
    "--timeout 60 --graceful-timeout 30 --no-control-socket"
)


def start_procfile(
    name: str, *, env: dict[str, str], log: Path, command: str | None = None
) -> subprocess.Popen:
    """The Procfile's ``name`` command (or ``command``), verbatim (bash expands its
    ``${VAR:-default}``), in its own session, output to ``log``."""
    with open(log, "wb") as fh:
        return subprocess.Popen(
            ["bash", "-c", "exec " + (command or procfile_command(name))],
            cwd=ROOT,
            env=env,
            stdout=fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def verdict(ok: bool) -> str:
    return "OK" if ok else "MISSED"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    def worker_pids(self) -> list[int]:
        out = subprocess.run(
            ["ps", "-o", "pid=", "--ppid", str(self.proc.pid)],
            capture_output=True,
            text=True,
            check=False,
        ).stdout
        return [int(p) for p in out.split()]


@contextlib.contextmanager
def gunicorn(
    *,
    env: dict[str, str],
    log: Path,
    ready_path: str = "/health/live",
    command: str | None = None,
) -> Iterator[Server]:
    """The Procfile's ``web`` command (or ``command``), verbatim (bash expands its
    ``${VAR:-default}``)."""
    port = free_port()
    env = {**env, "QUIRE_BIND": f"127.0.0.1:{port}"}
    proc = start_procfile("web", env=env, log=log, command=command)
    server = Server(proc=proc, port=port, log=log)
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"gunicorn exited ({proc.returncode}); see {log}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"http://127.0.0.1:{port}{ready_path}", timeout=2):
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"gunicorn did not become ready; see {log}")
            time.sleep(0.2)
        yield server
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # graceful: the arbiter stops its own workers
            try:
                proc.wait(timeout=35)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# -- Postgres -------------------------------------------------------------------------------------


#: The vhost whose users' permissions a throwaway vhost copies (this checkout's, when set).
REFERENCE_VHOST = os.environ.get("QUIRE_RMQ_VHOST", "quire")


def bench_db_name(base: str) -> str:
    """``base``, suffixed with this checkout's vhost (``QUIRE_RMQ_VHOST=quire_<name>`` ->
    ``<base>_<name>``) so parallel checkouts on one machine never share a bench database."""
    vhost = os.environ.get("QUIRE_RMQ_VHOST", "")
    suffix = vhost.removeprefix("quire").strip("_")
    return f"{base}_{suffix}" if suffix else base


def recreate_database(name: str) -> str:
    """Drop and create ``name``; returns its URL."""
    import psycopg

    if not re.fullmatch(r"[a-z_][a-z0-9_]*", name):
        raise ValueError("database name")
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {name}")
    return PG_ADMIN_URL.rsplit("/", 1)[0] + f"/{name}"


def drop_database(name: str) -> None:
    import psycopg

    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def sql_scalar(url: str, query: str) -> object:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(query).fetchone()
        return row[0] if row else None


# -- RabbitMQ -------------------------------------------------------------------------------------


def _rabbitmqctl(*args: str) -> str:
    return run(["rabbitmqctl", "--quiet", *args])


#: The vhost whose permissions a throwaway vhost copies (parallel checkouts each have their own).
TEMPLATE_VHOST = os.environ.get("QUIRE_RMQ_VHOST", "quire")


@contextlib.contextmanager
def throwaway_vhost(*, user: str, password: str) -> Iterator[str]:
    """A fresh vhost carrying ``deploy/rabbitmq/definitions.json`` (exchanges, quorum queue,
    DLX, bindings) with ``user`` granted exactly its permissions on vhost ``quire``; deleted
    afterwards, which also purges every message the benchmark published. Yields an AMQP URL.

    A separate vhost, not ``quire`` itself: other processes (tests, workers) may be using the
    shared ``conversion.v1`` queue, and a purge there would destroy their messages."""
    import amqp

    vhost = f"quire-bench-{uuid.uuid4().hex[:8]}"
    _rabbitmqctl("add_vhost", vhost)
    try:
        _rabbitmqctl("set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
        perms = None
        source = os.environ.get("QUIRE_RMQ_VHOST", "quire")  # where apply.sh granted them
        for line in _rabbitmqctl("list_user_permissions", user).splitlines():
            cols = line.split("\t")
            if cols and cols[0] == source:
                perms = cols[1:4]
        if perms is None:
            raise RuntimeError(
                f"{user} has no permissions on vhost {source}: run deploy/rabbitmq/apply.sh"
            )
        _rabbitmqctl("set_permissions", "-p", vhost, "--", user, *perms)
        defs = json.loads((ROOT / "deploy" / "rabbitmq" / "definitions.json").read_text())
        conn = amqp.Connection(
            "127.0.0.1:5672", userid="guest", password="guest", virtual_host=vhost
        )
        conn.connect()
        ch = conn.channel()
        for ex in defs["exchanges"]:
            ch.exchange_declare(
                ex["name"],
                ex["type"],
                durable=ex["durable"],
                auto_delete=ex["auto_delete"],
                arguments=ex["arguments"],
                passive=False,
            )
        for q in defs["queues"]:
            ch.queue_declare(
                q["name"],
                durable=q["durable"],
                auto_delete=q["auto_delete"],
                arguments=q["arguments"],
            )
        for b in defs["bindings"]:
            ch.queue_bind(
                b["destination"],
                b["source"],
                routing_key=b["routing_key"],
                arguments=b["arguments"],
            )
        conn.close()
        yield f"amqp://{user}:{password}@127.0.0.1:5672/{vhost}"
    finally:
        best_effort(_rabbitmqctl, "delete_vhost", vhost)


def queue_depth(vhost_url: str, queue: str) -> int:
    vhost = vhost_url.rsplit("/", 1)[1]
    for line in _rabbitmqctl("list_queues", "-p", vhost, "name", "messages").splitlines():
        cols = line.split("\t")
        if cols[0] == queue:
            return int(cols[1])
    return -1


# -- documents ------------------------------------------------------------------------------------

SLOT = b"@" * 32


def pdf_template(size: int = 10 * 1024) -> tuple[bytes, int]:
    """A valid one-page PDF of exactly ``size`` bytes whose text holds a 32-byte slot; returns
    (bytes, slot offset). Filling the slot with 32 hex digits makes a unique document whose
    xref offsets stay right."""

    def build(pad: int) -> bytes:
        text = b"BT /F1 12 Tf 72 720 Td (quire bench " + SLOT + b") Tj ET\n"
        stream = text + b"% " + b"q" * pad + b"\n"
        objs = [
            b"<< /Type /Catalog /Pages 2 0 R >>",
            b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
            b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R "
            b"/Resources << /Font << /F1 5 0 R >> >> >>",
            b"<< /Length %d >>\nstream\n" % len(stream) + stream + b"endstream",
            b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
        ]
        out = bytearray(b"%PDF-1.4\n")
        offsets = []
        for i, body in enumerate(objs, 1):
            offsets.append(len(out))
            out += b"%d 0 obj\n" % i + body + b"\nendobj\n"
        xref = len(out)
        out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objs) + 1)
        for off in offsets:
            out += b"%010d 00000 n \n" % off
        out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (
            len(objs) + 1,
            xref,
        )
        return bytes(out)

    pad = 0
    doc = build(pad)
    while len(doc) != size:  # the xref offsets' digits are fixed-width, so this converges
        pad += size - len(doc)
        doc = build(pad)
    return doc, doc.index(SLOT)


# -- HTTP client ----------------------------------------------------------------------------------


class HttpClient:
    """One keep-alive HTTP/1.1 connection; requests are prebuilt bytes. Much lighter on the
    client CPU than requests/httpx, so 16 of them do not compete with the server for 2 cores."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.sock: socket.socket | None = None
        self.buf = b""

    def _connect(self) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=30)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""
        return sock

    def request(self, raw: bytes) -> tuple[int, dict[bytes, bytes], bytes]:
        for attempt in (0, 1):
            if self.sock is None:
                self.sock = self._connect()
            try:
                self.sock.sendall(raw)
                return self._read_response()
            except (ConnectionError, TimeoutError, _Closed):
                self.close()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def _read_response(self) -> tuple[int, dict[bytes, bytes], bytes]:
        assert self.sock is not None
        while b"\r\n\r\n" not in self.buf:
            self._fill()
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        lines = head.split(b"\r\n")
        status = int(lines[0].split(b" ", 2)[1])
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip()
        length = int(headers.get(b"content-length", b"0"))
        while len(self.buf) < length:
            self._fill()
        body, self.buf = self.buf[:length], self.buf[length:]
        if headers.get(b"connection", b"").lower() == b"close":
            self.close()
        return status, headers, body

    def _fill(self) -> None:
        assert self.sock is not None
        chunk = self.sock.recv(65536)
        if not chunk:
            raise _Closed()
        self.buf += chunk

    def close(self) -> None:
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.close()
            self.sock = None


class _Closed(Exception):
    pass


def multipart(fields: list[tuple[str, bytes, str | None]], boundary: str) -> bytes:
    """``(name, value, filename or None)`` parts -> a multipart/form-data body."""
    out = bytearray()
    for name, value, filename in fields:
        out += f"--{boundary}\r\n".encode()
        if filename is None:
            out += f'Content-Disposition: form-data; name="{name}"\r\n\r\n'.encode()
        else:
            out += (
                f'Content-Disposition: form-data; name="{name}"; filename="{filename}"\r\n'
                "Content-Type: application/pdf\r\n\r\n"
            ).encode()
        out += value + b"\r\n"
    out += f"--{boundary}--\r\n".encode()
    return bytes(out)


# -- measurement ----------------------------------------------------------------------------------


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted list (q in 0..100)."""
    if not sorted_values:
        return float("nan")
    rank = max(1, -(-len(sorted_values) * q // 100))
    return sorted_values[int(rank) - 1]


CLK_TCK = os.sysconf("SC_CLK_TCK")


def proc_cpu_s(pid: int) -> float:
    """utime + stime of one process (seconds); 0 if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def machine_cpu() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine since boot."""
    vals = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = vals[3] + vals[4]
    return float(sum(vals) - idle), float(sum(vals))


def pids_named(pattern: str) -> list[int]:
    out = subprocess.run(
        ["pgrep", "-f", pattern], capture_output=True, text=True, check=False
    ).stdout
    return [int(p) for p in out.split()]


def py_spy_record(
    pids: list[int], *, seconds: float, out_dir: Path
) -> list[subprocess.Popen[bytes]]:
    """``py-spy record`` of each pid for ``seconds``: collapsed stacks of the thread holding the
    GIL (Python CPU time; waits on Postgres / RabbitMQ / fsync are not in it)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    spy = str(VENV_BIN / "py-spy") if (VENV_BIN / "py-spy").exists() else "py-spy"
    return [
        subprocess.Popen(
            [
                spy,
                "record",
                "--pid",
                str(pid),
                "--duration",
                str(int(seconds)),
                "--rate",
                "250",
                "--format",
                "raw",
                "--nonblocking",
                "--gil",
                "--output",
                str(out_dir / f"worker-{pid}.txt"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for pid in pids
    ]


# -- worker-side benchmarks (issue 3: throughput, latency, recovery) ------------------------------
# Real Procfile processes (tests/e2e/harness.py's Cluster: worker / sweeper / beat) on a fresh
# database and a throwaway vhost, each process as its least-privilege broker user, and this
# process set up as a Django client that accepts jobs through the service layer.

PUBLISHER = (
    os.environ.get("QUIRE_RMQ_PUBLISHER_USER", "quire_publisher"),
    os.environ.get("QUIRE_RMQ_PUBLISHER_PASSWORD", "quire-publisher-dev"),
)
WORKER = (
    os.environ.get("QUIRE_RMQ_WORKER_USER", "quire_worker"),
    os.environ.get("QUIRE_RMQ_WORKER_PASSWORD", "quire-worker-dev"),
)


def load_average() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} / {five:.2f} / {fifteen:.2f} (1 / 5 / 15 min, {os.cpu_count()} cores)"


def vhost_grant_like_quire(vhost: str, user: str) -> None:
    """Give ``user`` on ``vhost`` exactly the permissions it has on vhost ``quire``."""
    for line in _rabbitmqctl("list_user_permissions", user).splitlines():
        cols = line.split("\t")
        if cols and cols[0] == REFERENCE_VHOST:
            _rabbitmqctl("set_permissions", "-p", vhost, "--", user, *cols[1:4])
            return
    raise RuntimeError(f"{user} has no permissions on vhost quire: run deploy/rabbitmq/apply.sh")


@dataclass
class Stack:
    """A database + vhost + storage for Quire processes; ``cluster`` starts Procfile processes
    (``stack.start("worker")``) with their role's broker user."""

    db_url: str
    vhost: str
    storage: Path
    cluster: object  # tests.e2e.harness.Cluster

    def url(self, user: tuple[str, str]) -> str:
        return f"amqp://{user[0]}:{user[1]}@127.0.0.1:5672/{self.vhost}"

    def role_env(self, kind: str) -> dict[str, str]:
        """As tests/e2e/conftest.py: the Procfile maps QUIRE_BROKER_{PUBLISHER,WORKER}_URL onto
        Celery's read / write URLs per line (the worker consumes as the worker user; the sweeper
        consumes as the worker and publishes outbox rows as the publisher; beat only publishes)."""
        return {
            "CELERY_BROKER_URL": self.url(WORKER if kind in ("worker", "sweeper") else PUBLISHER),
            "QUIRE_BROKER_PUBLISHER_URL": self.url(PUBLISHER),
            "QUIRE_BROKER_WORKER_URL": self.url(WORKER),
        }

    def start(self, kind: str, *, ready: bool = True, **env: str) -> object:
        proc = self.cluster.start(kind, **{**self.role_env(kind), **env})  # type: ignore[attr-defined]
        if ready and kind == "worker":
            self.cluster.ready(proc, timeout=60)  # type: ignore[attr-defined]
        return proc


@contextlib.contextmanager
def quire_stack(*, db_name: str, keep: bool = False, **quire_env: str) -> Iterator[Stack]:
    """Fresh database ``db_name`` (migrated, beat schedule installed), a throwaway vhost with the
    production topology and both Quire users, temporary storage; this process becomes a Django
    client of it (publishing as ``quire_publisher``). ``quire_env``: extra settings (``QUIRE_*``)
    for this process and every started process. Everything is removed afterwards."""
    import shutil
    import tempfile

    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from tests.e2e import harness

    db_url = recreate_database(db_name)
    storage = Path(tempfile.mkdtemp(prefix="quire-bench-"))
    (storage / "logs").mkdir()
    cluster = None
    try:
        with throwaway_vhost(user=PUBLISHER[0], password=PUBLISHER[1]) as publisher_url:
            vhost = publisher_url.rsplit("/", 1)[1]
            vhost_grant_like_quire(vhost, WORKER[0])
            env = {
                k: v
                for k, v in base_env().items()
                if not k.startswith(("CELERY_", "DATABASE_URL", "QUIRE_", "DJANGO_SETTINGS"))
                or k in SECRET_VARIABLES
            }
            env.update(
                PYTHONPATH=str(ROOT),
                PYTHONUNBUFFERED="1",
                DJANGO_SETTINGS_MODULE="project.settings",
                DATABASE_URL=db_url,
                CELERY_BROKER_URL=publisher_url,
                QUIRE_STORAGE_DIR=str(storage / "storage"),
                QUIRE_WORK_DIR=str(storage / "work"),
                QUIRE_VAR_DIR=str(storage / "var"),
                QUIRE_TENANT_QUOTA=str(10**9),
                QUIRE_GLOBAL_CAPACITY=str(10**9),
                QUIRE_LOG_FORMAT="text",
                **quire_env,
            )
            run([PYTHON, "manage.py", "migrate", "--noinput", "-v", "0"], env=env)
            run([PYTHON, "manage.py", "install_beat_schedule"], env=env)
            os.environ.update({k: env[k] for k in env if k.startswith(("QUIRE_", "DJANGO_"))})
            os.environ.update(DATABASE_URL=db_url, CELERY_BROKER_URL=publisher_url)
            import django

            django.setup()
            process_env = {k: v for k, v in env.items() if k != "CELERY_BROKER_URL"}
            process_env["PROMETHEUS_MULTIPROC_DIR"] = str(storage / "metrics")
            cluster = harness.Cluster(log_dir=storage / "logs", env=process_env)
            stack = Stack(db_url=db_url, vhost=vhost, storage=storage, cluster=cluster)
            try:
                yield stack
            finally:
                cluster.stop_all()
                from django.db import connections

                connections.close_all()
    finally:
        if keep:
            print(f"kept: database {db_name}, storage and logs under {storage}", file=sys.stderr)
        else:
            shutil.rmtree(storage, ignore_errors=True)
            best_effort(drop_database, db_name)


def submit_job(*, tenant: str = "bench", pages: int = 1, options: dict | None = None) -> tuple:
    """Accept one job through the service layer, as tests/e2e/conftest.py ``submit`` does (a
    unique generated PDF, staged and hashed, ``conversion_job_accept``, whose on_commit fast
    path publishes it). Returns ``(job_id, committed_at)``: ``committed_at`` is the wall clock
    (``time.time()``) right after COMMIT returned, before the fast-path publish (an outer
    transaction whose first on_commit callback records it; the acceptance's own callbacks run
    after it, in registration order)."""
    import hashlib

    from django.db import transaction

    from conversion_jobs import storage
    from conversion_jobs.services.acceptance import StagedUpload, conversion_job_accept
    from tests import testdocs

    fh, staged = storage.stage()
    fh.close()
    salt = uuid.uuid4().hex
    testdocs.make_pdf(staged, pages=pages, text_of=lambda n: f"Page {n} {salt}")
    raw = staged.read_bytes()
    upload = StagedUpload(path=staged, sha256=hashlib.sha256(raw).hexdigest(), size=len(raw))
    stamp: list[float] = []
    with transaction.atomic():
        transaction.on_commit(lambda: stamp.append(time.time()))
        accepted = conversion_job_accept(
            tenant=tenant,
            actor="bench",
            upload=upload,
            output="text",
            raw_options=options or {},
            idempotency_key=None,
        )
    if not accepted.created:
        raise RuntimeError("a benchmark job was not new")
    return accepted.job.id, stamp[0]


def accept_file(
    path: Path,
    *,
    tenant: str = "bench",
    output: str = "text",
    options: dict | None = None,
    idempotency_key: str | None = None,
    inline: bool | None = None,
) -> object:
    """Accept the file ``path`` through the service layer (as tests/e2e/conftest.py ``submit``):
    copied into the artifact store's staging (filesystem or S3, per this process's settings),
    hashed, ``conversion_job_accept`` (whose on_commit fast path publishes it). Returns the job.
    ``inline``: hand the bytes over in memory, as the upload handler does for a small upload
    (an inline source); None: as the handler would decide (``QUIRE_INLINE_SOURCE_MAX_BYTES``)."""
    import hashlib
    import shutil

    from django.conf import settings

    from conversion_jobs import storage
    from conversion_jobs.services.acceptance import StagedUpload, conversion_job_accept

    raw = path.read_bytes()
    sha = hashlib.sha256(raw).hexdigest()
    if inline is None:
        inline = len(raw) <= settings.QUIRE.get("INLINE_SOURCE_MAX_BYTES", 0)
    if inline:
        upload = StagedUpload(path=None, sha256=sha, size=len(raw), content=raw)
    else:
        fh, staged = storage.stage()
        with fh, open(path, "rb") as data:
            shutil.copyfileobj(data, fh)
        upload = StagedUpload(path=staged, sha256=sha, size=len(raw))
    accepted = conversion_job_accept(
        tenant=tenant,
        actor="bench",
        upload=upload,
        output=output,
        raw_options=options or {},
        idempotency_key=idempotency_key,
    )
    if not accepted.created:
        raise RuntimeError("a benchmark job was not new")
    return accepted.job


def proc_cpu_with_children_s(pid: int) -> float:
    """utime + stime + cutime + cstime: the process and its reaped children (e.g. converter
    children a pool process has killed and waited for); 0 if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(f) for f in fields[11:15]) / CLK_TCK


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of ``pid`` and its live descendants, each with its reaped children (a
    prefork worker, its pool, the converter children they spawned and reaped)."""
    from tests.e2e import harness

    return sum(proc_cpu_with_children_s(p) for p in harness.process_tree(pid))


def sql_retry(url: str, query: str, *, for_s: float = 120.0) -> object:
    """``sql_scalar``, retried while Postgres is unreachable (someone on this shared host may be
    restarting it for an e2e test) for up to ``for_s`` seconds."""
    import psycopg

    deadline = time.monotonic() + for_s
    while True:
        try:
            return sql_scalar(url, query)
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)


#: Pids of the S3 servers ``s3_server`` runs now (the benchmarks measure their CPU).
S3_PIDS: list[int] = []


@contextlib.contextmanager
def s3_server(scratch: Path) -> Iterator[dict[str, str]]:
    """A real S3 server (SeaweedFS, as the tests use) for a ``--storage s3`` phase; yields the
    environment a Quire process needs to store its artifacts there (own key prefix)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from tests import s3server

    server = s3server.start(scratch / "s3server")
    if server.proc is not None:
        S3_PIDS.append(server.proc.pid)
    try:
        yield {**server.env(), "QUIRE_S3_PREFIX": f"bench-{uuid.uuid4().hex[:8]}"}
    finally:
        if server.proc is not None:
            S3_PIDS.remove(server.proc.pid)
        server.stop()


@contextlib.contextmanager
def storage_in_process(env: dict[str, str]) -> Iterator[None]:
    """Point this (Django-set-up) process's artifact store at ``env``'s S3 server meanwhile."""
    from django.conf import settings

    saved = dict(settings.QUIRE)
    os.environ.update({k: v for k, v in env.items() if k.startswith("AWS_")})
    settings.QUIRE["STORAGE"] = "s3"
    settings.QUIRE["S3"] = {
        **settings.QUIRE["S3"],
        "BUCKET": env["QUIRE_S3_BUCKET"],
        "ENDPOINT_URL": env["QUIRE_S3_ENDPOINT_URL"],
        "ADDRESSING_STYLE": env["QUIRE_S3_ADDRESSING_STYLE"],
        "PREFIX": env["QUIRE_S3_PREFIX"],
    }
    try:
        yield
    finally:
        settings.QUIRE.clear()
        settings.QUIRE.update(saved)


#: S3 artifact store / filesystem, same run (issue 14): one-page jobs, 200-page PNG, accept.
S3_TARGET = 0.8
#: The same phase with ``--history`` finished jobs in the tables / with empty
#: tables (docs/TEST_STRATEGY.md §6.1).
HISTORY_TARGET = 0.9


def ratio_line(label: str, ratio: float, target: float, extra: str = "") -> str:
    """``label  ratio  target >= t  OK|MISSED`` (``extra`` appended), one printed ratio."""
    return f"ratio {label:<52} {ratio:6.3f}   target >= {target}   {verdict(ratio >= target)}" + (
        f"   {extra}" if extra else ""
    )


def seed_history_db(db_url: str, jobs: int) -> float:
    """Seed ``jobs`` finished jobs into the Quire database ``db_url`` (bench/history.py, then
    VACUUM ANALYZE + CHECKPOINT, so the measured phase pays no first autovacuum pass); seconds."""
    import psycopg
    from history import seed_history

    t0 = time.perf_counter()
    with psycopg.connect(db_url, autocommit=True) as conn:
        seed_history(conn.cursor(), jobs=jobs, vacuum=True)
    return time.perf_counter() - t0
