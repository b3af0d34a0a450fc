"""The gunicorn worker class the Procfile names: uvicorn on uvloop with
:class:`conversion_jobs.web.protocol.QuireHttpProtocol` (ADR 0016), and an even spread of the
shared socket's connections over the workers (ADR 0017 session 11)."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from asyncio import TimerHandle
from typing import Any

from gunicorn.arbiter import Arbiter
from uvicorn import Server as UvicornServer
from uvicorn_worker import UvicornWorker

from conversion_jobs import secret_policy

# gunicorn's master imports this module before it binds or forks: the production profile's
# secrets are checked here, as every other process checks them first (docs/THREAT_MODEL.md).
secret_policy.enforce()

log = logging.getLogger(__name__)


def _env_float(name: str, default: float) -> float:
    return float(os.environ.get(name, default))


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


#: A worker holding more than its share of the web's connections leaves a pending connection
#: to the other workers for this long before it accepts it itself (ADR 0017 session 11).
ACCEPT_DEFER_S = _env_float("QUIRE_HTTP_ACCEPT_DEFER_S", 0.005)


class _ConnectionShares:
    """The open connections of each worker process of one gunicorn master, in memory the master
    maps before it forks them (``QuireUvicornWorker.__init__`` runs in the master): one slot
    (pid, count) per worker. A worker writes its own slot; what it reads of the others may be
    a little stale, which only makes it accept a connection it could have left."""

    SLOTS = 64

    def __init__(self) -> None:
        import multiprocessing

        self._pids = multiprocessing.RawArray("i", self.SLOTS)
        self._counts = multiprocessing.RawArray("i", self.SLOTS)
        self._lock = multiprocessing.Lock()
        self._slot = -1

    def claim(self) -> None:
        """This process's slot: a free one or one whose process is gone (after a fork)."""
        pid = os.getpid()
        with self._lock:
            for slot in range(self.SLOTS):
                other = self._pids[slot]
                if other == 0 or other == pid or not _alive(other):
                    self._pids[slot], self._counts[slot], self._slot = pid, 0, slot
                    return

    def update(self, mine: int) -> None:
        """This worker's connections now (a connection closed)."""
        if self._slot >= 0:
            self._counts[self._slot] = mine

    def over_share(self, mine: int) -> bool:
        """Whether this worker holds more than an even share of the connections of the live
        slots (False when it is alone, or has no slot)."""
        if self._slot < 0:
            return False
        self._counts[self._slot] = mine
        workers, total = self._totals()
        return workers > 1 and mine * workers > total

    def others(self) -> int:
        """The connections the other workers hold (as they last wrote them)."""
        return self._totals()[1] - (self._counts[self._slot] if self._slot >= 0 else 0)

    def _totals(self) -> tuple[int, int]:
        workers = total = 0
        for slot in range(self.SLOTS):
            if self._pids[slot]:
                workers += 1
                total += self._counts[slot]
        return workers, total


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _BalancedAccept:
    """Accepts the connections of one listening socket shared by every worker (gunicorn's) with
    an even spread: every worker is woken by a pending connection; one that holds more than its
    share leaves it to the others for ``ACCEPT_DEFER_S``, then takes one, or - the others took
    none in two deferrals - a whole batch (a busy or stuck worker holds a connection back for
    at most two deferrals: work stealing is kept).
    uvloop's own server accepts everything pending at once, so the worker that woke first took
    most of a burst of connects (15 / 1 of 16 kept-alive clients; ADR 0017 session 5
    "Connection balance"). Quacks as the ``asyncio.Server`` uvicorn's shutdown closes."""

    def __init__(self, sock: Any, protocol_factory: Any, shares: _ConnectionShares, live: Any):
        self.sockets = [sock]
        self._sock, self._factory, self._shares, self._live = sock, protocol_factory, shares, live
        self._loop = asyncio.get_running_loop()
        self._closed = asyncio.Event()
        self._deferred: TimerHandle | None = None
        self._starting = 0
        self._others = 0
        self._idle_deferrals = 0
        sock.setblocking(False)
        self._loop.add_reader(sock.fileno(), self._ready)

    def _ready(self, force: int = 0) -> None:
        for _ in range(16):  # a bounded batch per wake-up, as the loop's own accept
            if force > 0:
                force -= 1
            elif self._shares.over_share(len(self._live) + self._starting):
                self._loop.remove_reader(self._sock.fileno())
                self._others = self._shares.others()
                self._deferred = self._loop.call_later(ACCEPT_DEFER_S, self._resume)
                return
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE and the like: the loop's server logs and goes on
                log.warning("accept failed", extra={"error": type(exc).__name__})
                return
            conn.setblocking(False)
            self._starting += 1  # counted until its protocol is in the live set
            task = self._loop.create_task(self._loop.connect_accepted_socket(self._factory, conn))
            task.add_done_callback(self._started)
        self._shares.over_share(len(self._live) + self._starting)

    def _started(self, task: asyncio.Task[Any]) -> None:
        self._starting -= 1
        if not task.cancelled() and task.exception() is not None:
            log.warning("connection setup failed", extra={"error": type(task.exception()).__name__})

    def _resume(self) -> None:
        self._deferred = None
        if self._closed.is_set():
            return
        self._loop.add_reader(self._sock.fileno(), self._ready)
        # Still pending after the deferral: this one takes one, then the share decides again.
        # When the others took none in two deferrals running (busy or stuck, or not scheduled
        # on a loaded host), it takes a whole batch.
        idle = self._shares.others() == self._others
        self._idle_deferrals = self._idle_deferrals + 1 if idle else 0
        if self._idle_deferrals >= 2:
            self._idle_deferrals = 0
            self._ready(force=16)
        else:
            self._ready(force=1)

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        if self._deferred is not None:
            self._deferred.cancel()
        else:
            self._loop.remove_reader(self._sock.fileno())

    async def wait_closed(self) -> None:
        await self._closed.wait()


_shares: _ConnectionShares | None = None


def connection_shares() -> _ConnectionShares | None:
    """This process's connection counts (None: the balance is off, or not under gunicorn)."""
    return _shares


class _BalancedServer(UvicornServer):
    """uvicorn's server with :class:`_BalancedAccept` on gunicorn's sockets instead of the
    loop's own ``create_server``; everything else (state, shutdown) is uvicorn's."""

    async def startup(self, sockets: list[Any] | None = None) -> None:
        await super().startup(sockets=[])
        if not self.started or not sockets or _shares is None:
            return
        config = self.config

        def create_protocol() -> asyncio.Protocol:
            return config.http_protocol_class(  # type: ignore[call-arg]
                config=config, server_state=self.server_state, app_state=self.lifespan.state
            )

        _shares.claim()
        accepts: list[Any] = [  # each quacks as the asyncio.Server uvicorn's shutdown closes
            _BalancedAccept(sock, create_protocol, _shares, self.server_state.connections)
            for sock in sockets
        ]
        self.servers = accepts


class QuireUvicornWorker(UvicornWorker):
    """gunicorn worker: an asyncio event loop (uvloop) per process serving ``project.asgi``
    with :class:`QuireHttpProtocol`. gunicorn still owns the processes (restarts a dead
    worker, graceful reload and shutdown, ``--timeout`` for a stuck event loop);
    ``--keep-alive`` sets the idle connection timeout. The workers spread the connections of
    their shared listening socket evenly (:class:`_BalancedAccept`; ``QUIRE_HTTP_BALANCE=0``:
    uvloop's own accept)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        global _shares
        super().__init__(*args, **kwargs)
        if _shares is None and os.environ.get("QUIRE_HTTP_BALANCE", "1") != "0":
            _shares = _ConnectionShares()  # in the master, before the fork: shared by all

    async def _serve(self) -> None:
        if _shares is None:
            await super()._serve()
            return
        self.config.app = self.wsgi
        server = _BalancedServer(config=self.config)
        self._install_sigquit_handler()
        await server.serve(sockets=self.sockets)
        if not server.started:
            sys.exit(Arbiter.WORKER_BOOT_ERROR)

    CONFIG_KWARGS = {
        "loop": "uvloop",
        "http": "conversion_jobs.web.protocol:QuireHttpProtocol",
        "lifespan": "off",
        "server_header": False,
        "access_log": False,
    }
