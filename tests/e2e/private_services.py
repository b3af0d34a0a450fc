"""A private RabbitMQ node and a private Postgres cluster for the outage tests.

The outage tests stop and start their broker or database while real Procfile processes run.
The shared services on 5672 / 5432 serve every other suite (and, on a development machine,
other checkouts), so these tests never touch them: each starts its own node / cluster on free
ports in a temporary directory, stops and starts that, and removes it at the end.

Both need the server binaries on this host and must run as root (CI) or as the service's own
user; a node or cluster that cannot start fails the test, it never skips (docs/TEST_STRATEGY.md §2).
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.e2e import harness


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _private_dir(prefix: str, owner: str) -> Path:
    """A fresh directory the service user can write (under /tmp: a pytest tmp dir is 0700)."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    path.chmod(0o755)
    if os.geteuid() == 0:
        user = pwd.getpwnam(owner)
        os.chown(path, user.pw_uid, user.pw_gid)
    return path


def _chown_tree(path: Path, owner: str) -> None:
    if os.geteuid() == 0:
        user = pwd.getpwnam(owner)
        for root, dirs, files in os.walk(path):
            for name in [*dirs, *files]:
                os.chown(Path(root) / name, user.pw_uid, user.pw_gid)
        os.chown(path, user.pw_uid, user.pw_gid)


# --- RabbitMQ -------------------------------------------------------------------------------


@dataclass
class PrivateRabbitMQ:
    """One RabbitMQ node of its own (name, AMQP / management / distribution ports, data and
    logs), with Quire's topology and users applied by ``deploy/rabbitmq/apply.sh``."""

    base: Path = field(default_factory=lambda: _private_dir("quire-rmq-", "rabbitmq"))
    node: str = field(default_factory=lambda: f"quire-outage-{os.getpid()}@localhost")
    port: int = field(default_factory=free_port)
    mgmt_port: int = field(default_factory=free_port)
    dist_port: int = field(default_factory=free_port)
    #: seconds from ``rabbitmq-server -detached`` to a booted node, and to an applied topology
    boot_s: float = 0.0
    apply_s: float = 0.0

    @property
    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "RABBITMQ_NODENAME": self.node,
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_CONFIG_FILE": str(self.base / "rabbitmq.conf"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.base / "enabled_plugins"),
            "RABBITMQ_MNESIA_BASE": str(self.base / "mnesia"),
            "RABBITMQ_LOG_BASE": str(self.base / "log"),
            "RABBITMQ_PID_FILE": str(self.base / "rabbitmq.pid"),
        }

    def url(self, role: str) -> str:
        return harness.broker_url(role, port=self.port)

    def ctl(self, *args: str, timeout: float = 120, check: bool = True) -> str:
        proc = subprocess.run(
            ["rabbitmqctl", "-n", self.node, "--quiet", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and proc.returncode != 0:
            raise RuntimeError(f"rabbitmqctl {' '.join(args)}: {proc.stderr.strip()}")
        return proc.stdout

    def start(self) -> PrivateRabbitMQ:
        (self.base / "rabbitmq.conf").write_text(
            f"listeners.tcp.local = 127.0.0.1:{self.port}\n"
            f"management.tcp.ip = 127.0.0.1\nmanagement.tcp.port = {self.mgmt_port}\n"
            # The shared node's config carries the consumer timeout; keep the same here.
            "consumer_timeout = 7200000\n"
        )
        (self.base / "enabled_plugins").write_text("[rabbitmq_management].\n")
        for sub in ("mnesia", "log"):
            (self.base / sub).mkdir(exist_ok=True)
        _chown_tree(self.base, "rabbitmq")
        started = time.monotonic()
        subprocess.run(
            ["rabbitmq-server", "-detached"],
            env=self.env,
            capture_output=True,
            timeout=60,
            check=True,
        )
        self.await_startup(timeout=120)
        self.boot_s = time.monotonic() - started
        started = time.monotonic()
        proc = subprocess.run(
            ["bash", str(harness.APPLY)],
            env={
                **os.environ,
                "QUIRE_RMQ_NODE": self.node,
                "QUIRE_RMQ_PORT": str(self.port),
                "QUIRE_RMQ_MGMT_URL": f"http://127.0.0.1:{self.mgmt_port}",
                "QUIRE_RMQ_VHOST": harness.VHOST,
            },
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"apply.sh on {self.node} failed:\n{proc.stdout}{proc.stderr}")
        self.apply_s = time.monotonic() - started
        return self

    def await_startup(self, *, timeout: float) -> None:
        # await_startup fails at once while the node is not yet registered with epmd: retry.
        deadline = time.monotonic() + timeout
        while (
            subprocess.run(
                ["rabbitmqctl", "-n", self.node, "--quiet", "await_startup", "--timeout", "10"],
                capture_output=True,
                timeout=30,
                check=False,
            ).returncode
            != 0
        ):
            if time.monotonic() > deadline:
                raise RuntimeError(f"RabbitMQ node {self.node} did not boot:\n{self.log_tail()}")
            time.sleep(0.5)

    def stop_app(self) -> None:
        """The broker goes away (connections closed, port closed); the Erlang node stays."""
        self.ctl("stop_app")

    def start_app(self) -> None:
        self.ctl("start_app")
        self.await_startup(timeout=120)

    def accepts_connections(self) -> bool:
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
            return True
        except OSError:
            return False

    def log_tail(self, lines: int = 40) -> str:
        logs = sorted((self.base / "log").glob("*.log"))
        text = [line for log in logs for line in log.read_text(errors="replace").splitlines()]
        return "\n".join(text[-lines:])

    def destroy(self) -> None:
        """Stop the node (and its Erlang VM) and remove its files."""
        self.ctl("shutdown", check=False, timeout=120)
        pid_file = self.base / "rabbitmq.pid"
        if pid_file.exists():
            try:
                os.kill(int(pid_file.read_text().strip()), 9)
            except (ValueError, ProcessLookupError):
                pass
        shutil.rmtree(self.base, ignore_errors=True)


# --- PostgreSQL ----------------------------------------------------------------------------


@dataclass
class PrivatePostgres:
    """One Postgres cluster of its own (``initdb`` in a temporary directory, trust auth on
    127.0.0.1, a free port), driven with ``pg_ctl`` as the postgres user."""

    base: Path = field(default_factory=lambda: _private_dir("quire-pg-", "postgres"))
    port: int = field(default_factory=free_port)
    boot_s: float = 0.0

    @property
    def bindir(self) -> Path:
        return Path("/usr/lib/postgresql") / harness.postgres_version() / "bin"

    @property
    def data(self) -> Path:
        return self.base / "data"

    def url(self, database: str = "postgres") -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/{database}"

    def _run(self, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        prefix = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        proc = subprocess.run(
            [*prefix, *argv], capture_output=True, text=True, timeout=timeout, check=False
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: {proc.stdout}{proc.stderr}")
        return proc

    def start(self) -> PrivatePostgres:
        started = time.monotonic()
        self._run(
            str(self.bindir / "initdb"),
            "-D",
            str(self.data),
            "-U",
            "postgres",
            "-A",
            "trust",
            "--no-sync",
        )
        with open(self.data / "postgresql.conf", "a") as conf:
            conf.write(
                f"port = {self.port}\nlisten_addresses = '127.0.0.1'\n"
                f"unix_socket_directories = '{self.base}'\nfsync = off\n"
                "max_connections = 200\n"
            )
        self.start_server()
        self.boot_s = time.monotonic() - started
        return self

    def start_server(self) -> None:
        self._run(
            str(self.bindir / "pg_ctl"),
            "-D",
            str(self.data),
            "-l",
            str(self.base / "server.log"),
            "-w",
            "-t",
            "60",
            "start",
        )

    def stop_server(self) -> None:
        """A fast shutdown: every connection is closed, the port stops answering."""
        self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop")

    def create_database(self, name: str) -> None:
        import psycopg

        with psycopg.connect(self.url(), autocommit=True, connect_timeout=5) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')

    def destroy(self) -> None:
        try:
            self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "stop")
        except Exception:  # noqa: S110  (already stopped)
            pass
        shutil.rmtree(self.base, ignore_errors=True)
