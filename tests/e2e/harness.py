"""Process harness for the e2e tests: real RabbitMQ (least-privilege users), real ``celery``
worker / sweeper / beat processes started from the Procfile's commands, real signals.

Nothing here is a mock: processes are started with ``subprocess``, frozen with SIGSTOP, killed
with SIGKILL, and their logs are kept under the test's tmp dir (tails printed on failure).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import amqp

from conversion_jobs.converters import zygote
from conversion_jobs.secret_policy import SECRET_VARIABLES

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
PROCFILE = REPO / "Procfile"
APPLY = REPO / "deploy" / "rabbitmq" / "apply.sh"

RMQ_HOST = os.environ.get("QUIRE_RMQ_HOST", "127.0.0.1")
RMQ_PORT = int(os.environ.get("QUIRE_RMQ_PORT", "5672"))
#: QUIRE_RMQ_VHOST lets parallel runs (e.g. two checkouts) each use a vhost of their own.
VHOST = os.environ.get("QUIRE_RMQ_VHOST", "quire")
ADMIN = (
    os.environ.get("QUIRE_RMQ_ADMIN_USER", "guest"),
    os.environ.get("QUIRE_RMQ_ADMIN_PASSWORD", "guest"),
)
USERS = {
    "publisher": (
        os.environ.get("QUIRE_RMQ_PUBLISHER_USER", "quire_publisher"),
        os.environ.get("QUIRE_RMQ_PUBLISHER_PASSWORD", "quire-publisher-dev"),
    ),
    "worker": (
        os.environ.get("QUIRE_RMQ_WORKER_USER", "quire_worker"),
        os.environ.get("QUIRE_RMQ_WORKER_PASSWORD", "quire-worker-dev"),
    ),
}
CONVERSION_QUEUE = "conversion.v1"
DEAD_QUEUE = "conversion.v1.dead"
SWEEP_QUEUE = "quire.sweeps"
QUEUES = (CONVERSION_QUEUE, DEAD_QUEUE, SWEEP_QUEUE)

#: Short timings so crashes and recoveries happen within seconds.
TEST_TIMINGS = {
    "QUIRE_LEASE_S": "3",
    "QUIRE_HEARTBEAT_S": "0.5",
    "QUIRE_SWEEP_INTERVAL_S": "0.5",
    "QUIRE_BACKOFF_BASE_S": "0.5",
    "QUIRE_DISPATCH_TIMEOUT_S": "5",
    # The retry and cancel tests crash converters on purpose, more often than a quarantine
    # allows; the quarantine's own tests (test_quarantine_e2e.py) set it back to 2.
    "QUIRE_QUARANTINE_AFTER_CRASHES": "1000",
    # The retry e2e test fails a page on three attempts: the page budget must not end it first.
    "QUIRE_PAGE_MAX_ATTEMPTS": "10",
}


def broker_url(role: str, *, port: int | None = None) -> str:
    user, password = USERS[role]
    return f"amqp://{user}:{password}@{RMQ_HOST}:{port or RMQ_PORT}/{VHOST}"


# --- waiting ------------------------------------------------------------------------------------


def wait_until(
    predicate: Callable[[], Any], *, timeout: float, interval: float = 0.1, what: str = "condition"
) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail with ``what`` at the timeout,
    naming the last call's error (None: the last call answered, falsy)."""
    deadline = time.monotonic() + timeout
    last_exc: BaseException | None = None
    while True:
        try:
            value = predicate()
            if value:
                return value
            last_exc = None
        except Exception as exc:  # e.g. a database restarting under the predicate
            last_exc = exc
        if time.monotonic() > deadline:
            raise AssertionError(
                f"timed out after {timeout:g}s waiting for {what} (last error: {last_exc!r})"
            )
        time.sleep(interval)


# --- RabbitMQ -----------------------------------------------------------------------------------


def amqp_connection(role: str, *, port: int | None = None, vhost: str = VHOST) -> amqp.Connection:
    user, password = USERS[role]
    conn = amqp.Connection(
        host=f"{RMQ_HOST}:{port or RMQ_PORT}",
        userid=user,
        password=password,
        virtual_host=vhost,
        connect_timeout=5,
        confirm_publish=True,
    )
    conn.connect()
    return conn


def rabbitmqctl(*args: str, timeout: float = 120) -> str:
    """Broker administration goes through the CLI (Erlang cookie, we run on the broker host):
    no Quire user may purge or inspect the dead-letter queue, and guest has no access to the
    ``quire`` vhost. ``RABBITMQCTL`` names another CLI (as for deploy/rabbitmq/apply.sh), e.g.
    the ``docker exec`` wrapper of tests/containers_plugin.py."""
    proc = subprocess.run(
        [os.environ.get("RABBITMQCTL", "rabbitmqctl"), "--quiet", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"rabbitmqctl {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc.stdout


def topology_ensure() -> str:
    """Run deploy/rabbitmq/apply.sh (idempotent). Returns its output; raises if the topology is
    not usable afterwards (the users cannot log in or a queue is missing)."""
    proc = subprocess.run(
        ["bash", str(APPLY)], capture_output=True, text=True, timeout=300, check=False
    )
    output = proc.stdout + proc.stderr
    try:
        for role in USERS:
            amqp_connection(role).close()
        depths = queue_depths()
        missing = [q for q in QUEUES if q not in depths]
        assert not missing, f"queues missing: {missing}"
    except Exception as exc:
        raise RuntimeError(
            f"RabbitMQ topology unusable after apply.sh (rc={proc.returncode}): {exc}\n{output}"
        ) from exc
    return output


def queue_depths(vhost: str = VHOST) -> dict[str, int]:
    """Ready + unacknowledged messages per queue of the vhost, as ``rabbitmqctl list_queues``
    reports them. For a quorum queue (``conversion.v1``) RabbitMQ 3.10 reports the counts of
    its last statistics tick (every 5 s): up to 5 s old, e.g. still the messages a purge
    removed. Wait on it with a timeout; for a reading of now, :func:`ready_now`."""
    out = rabbitmqctl("list_queues", "-p", vhost, "--no-table-headers", "name", "messages")
    depths = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            depths[parts[0]] = int(parts[1])
    return depths


def queue_depth(name: str) -> int:
    return queue_depths()[name]


def ready_now(name: str, *, vhost: str = VHOST) -> int:
    """The messages ready in queue ``name`` now (a passive declare, which needs no permission:
    the queue answers it itself, quorum queues included). Unacknowledged ones not counted."""
    conn = amqp_connection("publisher", vhost=vhost)
    try:
        return int(conn.channel().queue_declare(name, passive=True).message_count)
    finally:
        conn.close()


def queues_purge(*names: str, node: str | None = None, port: int | None = None) -> None:
    """Empty the queues (all of the vhost's by default). The worker user purges what it may
    read (``queue.purge`` needs read permission), over AMQP in milliseconds; the dead-letter
    queue, which no Quire user may read, goes through the CLI - an Erlang VM started for one
    command, about a second of CPU - and only when a passive declare (no permission needed)
    says it holds something. Before, every e2e test's setup paid three CLI runs. ``node`` /
    ``port``: another node than the shared one (tests/e2e/private_services.py)."""
    conn = amqp_connection("worker", port=port)
    try:
        channel = conn.channel()
        for name in names or QUEUES:
            if name != DEAD_QUEUE:
                channel.queue_purge(name)
            elif channel.queue_declare(name, passive=True).message_count:
                rabbitmqctl(*(["-n", node] if node else []), "purge_queue", "-p", VHOST, name)
    finally:
        conn.close()


def publish_raw(
    body: bytes | str,
    *,
    headers: dict[str, Any] | None = None,
    content_type: str = "application/json",
    copies: int = 1,
) -> None:
    """Publish ``copies`` identical persistent messages to conversion.v1 as the least-privilege
    publisher, with publisher confirms."""
    conn = amqp_connection("publisher")
    try:
        channel = conn.channel()
        for _ in range(copies):
            msg = amqp.Message(
                body,
                content_type=content_type,
                content_encoding="utf-8",
                application_headers=headers or {},
                delivery_mode=2,
            )
            channel.basic_publish(msg, exchange="quire.conversion", routing_key=CONVERSION_QUEUE)
    finally:
        conn.close()


def publish_task(
    *, job_id: Any, generation: Any, copies: int = 1, args: list[Any] | None = None
) -> None:
    """A Celery protocol-2 message for ``run_conversion`` (what the outbox publishes), raw."""
    task_id = str(uuid.uuid4())
    headers = {
        "lang": "py",
        "task": "tasks.conversion.run_conversion",
        "id": task_id,
        "root_id": task_id,
        "parent_id": None,
        "group": None,
        "retries": 0,
        "argsrepr": "",
        "kwargsrepr": "{}",
        "origin": "e2e",
        "ignore_result": True,
    }
    body = json.dumps([args if args is not None else [str(job_id), generation], {}, {}])
    publish_raw(body, headers=headers, copies=copies)


# --- PostgreSQL ---------------------------------------------------------------------------------


def postgres_version() -> str:
    versions = sorted(p.name for p in Path("/etc/postgresql").iterdir() if p.name.isdigit())
    return versions[-1]


def database_url_for(name: str, base: str) -> str:
    parts = urlsplit(base)
    return urlunsplit((parts.scheme, parts.netloc, f"/{name}", parts.query, parts.fragment))


# --- processes ----------------------------------------------------------------------------------


def process_env(**extra: str) -> dict[str, str]:
    """The environment of a Quire process started by a test: this one's, minus its own
    service and Quire settings but with its secrets (the run's, tests/services.py
    secrets_env), plus short timings and test faults; ``extra`` on top."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("CELERY_", "DATABASE_URL", "QUIRE_", "PYTEST_"))
        or k in SECRET_VARIABLES
    }
    env.update(TEST_TIMINGS)
    env.update(
        PATH=f"{VENV_BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}",
        PYTHONPATH=str(REPO),
        PYTHONUNBUFFERED="1",
        DJANGO_SETTINGS_MODULE="project.settings",
        QUIRE_ENABLE_TEST_FAULTS="1",
        QUIRE_LOG_FORMAT="text",
        # Some tests read a task's outcome ('lost', 'duplicate') from Celery's "succeeded in"
        # line, which production keeps at WARNING (ADR 0017, session 4).
        QUIRE_TASK_LOG_LEVEL="INFO",
        # As in-process (tests/conftest.py _fair_capacity): fair dispatch with a fixed 10,000
        # slots, so a test without workers still sees its rows published; the fair dispatch
        # tests pass QUIRE_FAIR_CAPACITY="0" (the slots the workers announce).
        QUIRE_FAIR_CAPACITY="10000",
    )
    env.update(extra)
    return env


def accept_path(
    path: Path,
    *,
    tenant: str,
    output: str = "text",
    options: dict[str, Any] | None = None,
    metadata: dict[str, Any] | None = None,
) -> Any:
    """Accept the file ``path`` through the service layer, staged in the artifact store (its
    on_commit fast path publishes as this process's broker user): the acceptance."""
    import hashlib
    import shutil

    from conversion_jobs import storage
    from conversion_jobs.services.acceptance import StagedUpload, conversion_job_accept

    fh, staged = storage.stage()
    with fh, open(path, "rb") as data:
        shutil.copyfileobj(data, fh)
    raw = path.read_bytes()
    upload = StagedUpload(path=staged, sha256=hashlib.sha256(raw).hexdigest(), size=len(raw))
    return conversion_job_accept(
        tenant=tenant,
        actor="e2e",
        upload=upload,
        output=output,
        raw_options=options or {},
        idempotency_key=None,
        raw_metadata=metadata,
    )


def procfile_command(kind: str, env: dict[str, str]) -> list[str]:
    """The Procfile's command for ``kind`` with ``${VAR:-default}`` expanded from ``env``."""
    for line in PROCFILE.read_text().splitlines():
        name, _, command = line.partition(":")
        if name.strip() == kind:
            break
    else:
        raise KeyError(kind)

    def expand(match: re.Match[str]) -> str:
        # The shell forms the Procfile uses: ${VAR}, ${VAR:-default}, ${VAR:?message}.
        var, op, arg = match.group(1), match.group(2), match.group(3) or ""
        if env.get(var):
            return env[var]
        if op == ":?":
            raise KeyError(f"{kind}: {var} is required ({arg})")
        return arg if op == ":-" else ""

    expanded = re.sub(r"\$\{(\w+)(?:(:-|:\?)([^}]*))?\}", expand, command.strip())
    # ... and $(( a + b )), the worker's pool size (its slots plus its spares)
    expanded = re.sub(
        r"\$\(\(\s*(\d+)\s*\+\s*(\d+)\s*\)\)",
        lambda m: str(int(m.group(1)) + int(m.group(2))),
        expanded,
    )
    return shlex.split(expanded)


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry.name}/stat").read_bytes()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2 :].split()
        if fields[0] in (b"Z", b"X"):
            continue
        tree.setdefault(int(fields[1]), []).append(int(entry.name))
    return tree


def is_converter_child(pid: int) -> bool:
    """A converter child (forked by a worker's zygote, so named by ``/proc/<pid>/comm``: its
    command line is the zygote's)."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip() == zygote.CHILD_NAME
    except OSError:
        return False


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its live descendants (converter children live in their own groups)."""
    tree, out, todo = _children(), [], [pid]
    while todo:
        current = todo.pop()
        out.append(current)
        todo.extend(tree.get(current, []))
    return out


#: Procfile kinds that use no broker (the webhook notifier: ADR 0020)
NO_BROKER = frozenset({"notifier"})


@dataclass
class Proc:
    kind: str
    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    frozen: bool = False
    #: the HTTP port of a ``web`` process
    port: int = 0

    @property
    def pid(self) -> int:
        return self.popen.pid

    def tree(self) -> list[int]:
        return process_tree(self.pid) if self.popen.poll() is None else []

    def signal_tree(self, sig: int) -> None:
        for pid in self.tree():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def kill9(self) -> None:
        """SIGKILL the whole tree at once (main process, pool children, converter children)."""
        self.signal_tree(signal.SIGKILL)
        self.popen.wait(timeout=10)

    def freeze(self) -> None:
        self.signal_tree(signal.SIGSTOP)
        self.frozen = True

    def thaw(self) -> None:
        self.signal_tree(signal.SIGCONT)
        self.frozen = False

    def stop(self, timeout: float = 3.0) -> None:
        if self.popen.poll() is not None:
            return
        if self.frozen:
            self.thaw()
        pids = self.tree()
        try:
            os.killpg(self.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        for pid in [*pids, *self.tree()]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.popen.wait(timeout=10)

    def tail(self, lines: int = 60) -> str:
        try:
            text = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(text[-lines:])


@dataclass
class Cluster:
    """Starts Procfile processes with a shared environment; stops them all at teardown."""

    log_dir: Path
    env: dict[str, str]
    procs: list[Proc] = field(default_factory=list)
    _counter: int = 0
    #: a command prefix every process is started under (e.g. ``ip netns exec <host>``)
    wrap: list[str] = field(default_factory=list)

    def start(self, kind: str, *, role: str | None = None, **env: str) -> Proc:
        self._counter += 1
        name = f"{kind}{self._counter}"
        full_env = {**self.env, "PORT": str(self._counter), **env}
        if (
            kind not in NO_BROKER
            and full_env.get("DATABASE_URL", "").startswith("postgres")
            and not full_env.get("CELERY_BROKER_URL")
        ):
            # Without a broker URL the process would fall back to the standalone profile's
            # filesystem broker, which nothing reads here: its publishes would vanish and only
            # the dispatch-timeout sweep would ever deliver the job (pass ``role_env(kind)``).
            raise ValueError(f"{kind}: a production-profile process needs CELERY_BROKER_URL")
        argv = procfile_command(kind, full_env)
        if argv[0] == "celery":
            argv[0] = str(VENV_BIN / "celery")
        argv = [*self.wrap, *argv]
        log = self.log_dir / f"{name}.log"
        with open(log, "ab") as out:
            popen = subprocess.Popen(
                argv,
                cwd=REPO,
                env=full_env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        proc = Proc(kind=kind, name=name, popen=popen, log=log)
        self.procs.append(proc)
        return proc

    def worker(self, **env: str) -> Proc:
        env.setdefault("WORKER_CONCURRENCY", "1")
        # no spare pool process unless a test asks for one (ADR 0022, "Stepping aside")
        env.setdefault("QUIRE_WORKER_SPARES", "0")
        return self.start("worker", **env)

    def sweeper(self, **env: str) -> Proc:
        return self.start("sweeper", **env)

    def beat(self, **env: str) -> Proc:
        return self.start("beat", **env)

    def notifier(self, **env: str) -> Proc:
        """The webhook notifier: the database only (no broker, no worker credentials)."""
        for name in ("CELERY_BROKER_URL", "QUIRE_BROKER_PUBLISHER_URL", "QUIRE_BROKER_WORKER_URL"):
            env.pop(name, None)
        return self.start("notifier", **env)

    def web(self, **env: str) -> Proc:
        """The Procfile's ``web`` process on a free loopback port, once it answers
        ``/health/live``."""
        port = free_port()
        proc = self.start("web", QUIRE_BIND=f"127.0.0.1:{port}", **env)
        proc.port = port
        wait_until(
            lambda: _check_alive(proc) and _answers(f"http://127.0.0.1:{port}/health/live"),
            timeout=60,
            what=f"{proc.name} serving",
        )
        return proc

    def ready(self, proc: Proc, *, timeout: float = 30) -> Proc:
        """Wait until a worker logs that it is ready (consuming)."""
        wait_until(
            lambda: _check_alive(proc) and "ready." in proc.log.read_text(errors="replace"),
            timeout=timeout,
            what=f"{proc.name} ready",
        )
        return proc

    def owner_of(self, worker_identity: str) -> Proc:
        """The started process whose tree holds the pid in an attempt's ``worker`` column."""
        pid = int(worker_identity.rsplit(":", 1)[1])
        for proc in self.procs:
            if pid in proc.tree():
                return proc
        raise LookupError(worker_identity)

    def stop_all(self) -> None:
        """Teardown: SIGKILL every tree (graceful shutdown is not under test here, and waiting
        for soft shutdowns would dominate the suite's runtime)."""
        for proc in reversed(self.procs):
            try:
                if proc.popen.poll() is None:
                    proc.thaw()
                    proc.kill9()
            except Exception:  # noqa: S110  (teardown: keep stopping the others)
                pass

    def tails(self) -> str:
        return "\n".join(f"----- {p.name} ({p.log}) -----\n{p.tail()}" for p in self.procs)


def _stamped(log: Path, *markers: str) -> list[float]:
    """The times (seconds of the day) of the log lines that contain every one of ``markers``."""
    times = []
    for line in log.read_text(errors="replace").splitlines():
        if line[:2] == "20" and all(m in line for m in markers):
            hours, minutes, seconds = line.split()[1].replace(",", ".").split(":")
            times.append(int(hours) * 3600 + int(minutes) * 60 + float(seconds))
    return times


def sweep_lags(beat: Proc, sweeper: Proc, task: str) -> list[float]:
    """For each ``task`` beat sent before the sweeper's last receipt of one, the seconds until
    the sweeper next received one (both log it at INFO, with the time). A sweeper that stops
    receiving while beat sends shows as a lag as long as the stop (ADR 0002, "The pool")."""
    sent = _stamped(beat.log, "Sending due task", f"({task})")
    received = _stamped(sweeper.log, f"Task {task}[", "received")
    return [next(r for r in received if r >= t) - t for t in sent if received and t <= received[-1]]


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _answers(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=2) as response:  # noqa: S310 (loopback)
            return bool(response.status == 200)
    except OSError:
        return False


def _check_alive(proc: Proc) -> bool:
    if proc.popen.poll() is not None:
        raise AssertionError(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.tail()}")
    return True


# --- the test process's own publisher -----------------------------------------------------------


class broker_unreachable:
    """While inside, this process's Celery app publishes to a closed port: the on_commit fast
    path fails exactly as it does when the broker is down at that moment."""

    def __enter__(self) -> broker_unreachable:
        import socket

        sock = socket.socket()
        sock.bind((RMQ_HOST, 0))
        closed_port = sock.getsockname()[1]
        sock.close()  # nothing listens there now: connection refused
        self._saved = {
            k: os.environ.get(k) for k in ("CELERY_BROKER_URL", "CELERY_BROKER_WRITE_URL")
        }
        os.environ["CELERY_BROKER_URL"] = os.environ["CELERY_BROKER_WRITE_URL"] = broker_url(
            "publisher", port=closed_port
        )
        _reset_producer_pools()
        return self

    def __exit__(self, *exc: object) -> None:
        for key, value in self._saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        _reset_producer_pools()


def _reset_producer_pools() -> None:
    """Drop every pooled broker connection of this process so the next publish reconnects to
    whatever the environment now says. kombu caches producer pools globally per connection
    URL: closing only the app's pool would leave a cached producer pool bound to a closed
    connection pool ("Acquire on closed pool") for the rest of the run."""
    from kombu import pools

    from project.celery import app

    if app._pool is not None:
        app._pool.force_close_all()
    app._pool = None
    app.amqp._producer_pool = None
    pools.reset()
