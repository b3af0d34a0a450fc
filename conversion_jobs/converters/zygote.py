"""The converter fork server (ADR 0009; docs/adr/0011-converter-fork-server.md).

Starting a converter child as a new interpreter costs ~90 ms of CPU (interpreter start-up, then
pypdfium2), which made a one-page job cost more than all of Quire's durable bookkeeping. The
*zygote* pays that once: a clean process (``python -c … conversion_jobs.converters.zygote``,
named ``quire-zygote``) started with the same scrubbed environment as a child, which imports the
converter code, pypdfium2 and Pillow and then only forks. Every converter child is a fresh
``fork()`` of it, so:

* each attempt still gets a process of its own that has never seen another document: the
  zygote itself never opens input, never runs converter code and holds no secrets (it never
  imports Django and gets neither the database URL nor the broker credentials);
* the child (named ``quire-convert``) calls ``setsid()`` — its own session and process group, as
  before — and sets its own limits at ``setup``; its pipes are created by the worker and passed
  to the zygote over a Unix socket (SCM_RIGHTS), so nothing else of the zygote's is inherited.

Protocol (one ``SOCK_SEQPACKET`` message per request and per answer, JSON):

* ``{"op": "spawn"}`` with three file descriptors (the child's stdin, stdout, stderr) ->
  ``{"pid": N}``;
* ``{"op": "reap", "pid": N}`` -> ``{"returncode": R}`` after waiting for that child (negative R:
  killed by signal -R). Until reaped an exited child stays a zombie, so its pid (= its process
  group id) cannot be reused while the worker may still signal the group.

The zygote is single-threaded and ends when its socket reaches end of file (the worker exited or
was killed); its children then see their parent change and kill their own group (the child's
watchdog). One zygote serves one worker process (``ZygoteClient``); a dead zygote is replaced on
the next spawn.

Worker side: ``spawn`` forks a child through this process's zygote (``zygote()``, started on
first use) and returns a ``ForkedProcess``, the Popen-like handle ``isolation.ChildSession``
uses; ``stop_zygote`` ends it at exit. The server side never imports Django.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import IO

from . import child, sandbox
from .base import EXIT_UNEXPECTED
from .errors import ConverterCrashed

_MAX_MESSAGE = 4096
#: struct ucred: pid, uid, gid
_UCRED = struct.Struct("iII")
_REPO_ROOT = Path(__file__).resolve().parents[2]
#: A zygote that does not answer within this time is killed and replaced (a stuck fork server
#: must not hang an attempt whose heartbeat would keep its lease alive).
ANSWER_TIMEOUT_S = 10.0
#: How long to wait for a child whose zygote died to end itself (its watchdog polls every 0.25 s).
ORPHAN_EXIT_WAIT_S = 2.0
#: How the zygote starts (``-m`` would import this module twice: the package imports it too).
_ENTRY = "import sys; from conversion_jobs.converters.zygote import main; sys.exit(main(sys.argv))"


#: Process names (``/proc/<pid>/comm``, what ``ps -o comm`` and ``top`` show).
ZYGOTE_NAME = "quire-zygote"
CHILD_NAME = "quire-convert"


_prctl = None


def _load_prctl():
    """libc's ``prctl``, looked up once: the zygote does it before it forks, so a child names
    itself without loading libc through ctypes again (≈ 0.25 ms of a fresh child's CPU, most of
    it copy-on-write faults of the ctypes objects it creates)."""
    global _prctl
    if _prctl is None:
        try:
            _prctl = ctypes.CDLL(None, use_errno=True).prctl
        except (OSError, AttributeError):
            _prctl = False
    return _prctl


def set_process_name(name: str) -> None:
    """Set this process's name (``prctl(PR_SET_NAME)``); its command line stays the zygote's."""
    prctl = _load_prctl()
    if prctl:
        prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME


def _serve_child(fds: list[int], sock: socket.socket, request: dict) -> None:
    """In the forked child: become an isolated converter session (or, with ``argv``, exec that
    program); never returns. The child answers the spawn itself, so the worker learns its pid as
    the worker sees it (SCM_CREDENTIALS: translated out of the sandbox's pid namespace)."""
    code = EXIT_UNEXPECTED
    try:
        os.setsid()
        _answer(sock, {"pid": os.getpid()})
        sock.close()
        set_process_name(CHILD_NAME)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        argv = request.get("argv")
        if argv:
            os.chdir(request.get("cwd") or "/")
            os.execvpe(argv[0], argv, request.get("env") or _child_env())  # noqa: S606
        child.serve()  # never returns
    finally:
        os._exit(code)


def _answer(sock: socket.socket, payload: dict) -> None:
    sock.send(json.dumps(payload).encode())


def serve(sock: socket.socket) -> int:
    """The zygote's loop: fork on ``spawn``, wait on ``reap``; ends at end of file."""
    set_process_name(ZYGOTE_NAME)  # also looks prctl up once for every child
    _answer(sock, {"hello": os.getpid()})  # the worker learns this process's pid (credentials)
    child.preload()
    # Everything imported so far is shared copy-on-write with every child; frozen, the cyclic
    # garbage collector never walks (and so never writes to, and copies) those objects.
    gc.collect()
    gc.freeze()
    while True:
        try:
            data, fds, _flags, _addr = socket.recv_fds(sock, _MAX_MESSAGE, 3)
        except ConnectionResetError:
            return 0
        if not data:
            return 0
        request = json.loads(data)
        if request["op"] == "spawn":
            if len(fds) != 3:
                for fd in fds:
                    os.close(fd)
                _answer(sock, {"error": "spawn needs three file descriptors"})
                continue
            try:
                if os.fork() == 0:
                    _serve_child(fds, sock, request)
            except OSError as exc:
                _answer(sock, {"error": f"fork failed: {exc}"})
            for fd in fds:
                os.close(fd)
        elif request["op"] == "reap":
            try:
                _pid, status = os.waitpid(int(request["pid"]), 0)
                _answer(sock, {"returncode": os.waitstatus_to_exitcode(status)})
            except ChildProcessError:
                _answer(sock, {"returncode": None})
        else:
            _answer(sock, {"error": f"unknown op {request['op']!r}"})


class ZygoteGone(Exception):
    """The zygote died (killed, out of memory); the client starts a new one."""


class ZygoteClient:
    """The worker's side: one zygote process, shared by the worker's threads (one request at a
    time under a lock). With the sandbox on (``sandbox.enabled()``) the zygote runs inside a
    bubblewrap sandbox rooted at ``self.root`` (see sandbox.py); ``self.root`` is None when an
    operator turned the sandbox off."""

    def __init__(self, *, env: dict[str, str]) -> None:
        self.root = sandbox.SandboxRoot() if sandbox.enabled() else None
        #: the ``sandbox_dirs_parent()`` object last found to match ``root`` (``_stale``)
        self.matched_parent: Path | None = None
        parent_end, zygote_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # Every answer carries its sender's credentials, pid translated into our pid namespace.
        parent_end.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        argv = [sys.executable, "-c", _ENTRY, str(zygote_end.fileno())]
        if self.root is not None:
            argv = sandbox.command(self.root, argv)
        try:
            self.proc = subprocess.Popen(  # noqa: S603
                argv,
                env=env,
                cwd="/",
                stdin=subprocess.DEVNULL,
                pass_fds=(zygote_end.fileno(),),
                start_new_session=True,
                close_fds=True,
            )
        except BaseException:
            parent_end.close()
            if self.root is not None:
                self.root.remove()
            raise
        finally:
            zygote_end.close()
        parent_end.settimeout(ANSWER_TIMEOUT_S)
        self._sock = parent_end
        self._lock = threading.Lock()
        self._pid: int | None = None

    def _receive(self) -> tuple[dict, int]:
        """The next message and the pid (ours) of its sender. Caller holds the lock."""
        try:
            data, ancillary, _flags, _addr = self._sock.recvmsg(
                _MAX_MESSAGE, socket.CMSG_SPACE(_UCRED.size)
            )
        except OSError as exc:  # includes the answer timeout
            self.kill()  # stuck or broken: the next spawn starts a new zygote
            raise ZygoteGone(str(exc) or type(exc).__name__) from exc
        if not data:
            self.kill()
            raise ZygoteGone("the zygote closed its socket")
        sender = 0
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                sender = _UCRED.unpack(payload[: _UCRED.size])[0]
        return json.loads(data), sender

    def _greeted(self) -> None:
        """Read the zygote's greeting once: its pid as we see it. Caller holds the lock."""
        if self._pid is None:
            answer, sender = self._receive()
            if "hello" not in answer or not sender:
                self.kill()
                raise ZygoteGone("the zygote did not greet")
            self._pid = sender

    @property
    def pid(self) -> int:
        """The zygote process's pid (inside bwrap when sandboxed; ``proc`` is bwrap)."""
        with self._lock:
            self._greeted()
            return int(self._pid or 0)

    def _call(self, request: dict, fds: tuple[int, ...] = ()) -> tuple[dict, int]:
        """Send ``request``; the answer and the pid of the process that sent it."""
        with self._lock:
            self._greeted()
            try:
                if fds:
                    socket.send_fds(self._sock, [json.dumps(request).encode()], list(fds))
                else:
                    self._sock.send(json.dumps(request).encode())
            except OSError as exc:
                self.kill()
                raise ZygoteGone(str(exc) or type(exc).__name__) from exc
            answer, sender = self._receive()
        if "error" in answer:
            raise RuntimeError(answer["error"])
        return answer, sender

    def spawn(
        self, *, stdin: int, stdout: int, stderr: int, argv: list[str] | None = None, **extra
    ) -> tuple[int, int]:
        """Fork a child; returns (its pid here, its pid in the zygote's namespace)."""
        request = {"op": "spawn", "argv": argv, **extra}
        answer, sender = self._call(request, (stdin, stdout, stderr))
        if not sender:
            raise ZygoteGone("the spawn answer carried no credentials")
        return sender, int(answer["pid"])

    def reap(self, ns_pid: int) -> int | None:
        return self._call({"op": "reap", "pid": ns_pid})[0]["returncode"]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def clear_tmp(self) -> None:
        """Empty the sandbox's /tmp (call with no child of this zygote working)."""
        if self.root is not None:
            self.root.clear_tmp()

    def kill(self) -> None:
        """Kill the zygote at once (its whole process group: bwrap and the sandbox's pid 1 go,
        and with them every process in the sandbox's pid namespace)."""
        self._sock.close()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        if self.root is not None:
            self.root.remove()

    def close(self) -> None:
        """End the zygote (its children see it go and kill their own groups)."""
        self._sock.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.kill()
        if self.root is not None:
            self.root.remove()


def _child_env() -> dict[str, str]:
    # The child sees none of the worker's secrets (database URL, broker credentials, keys).
    # HOME and TMPDIR become its private directory at setup.
    return {
        "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
        "PYTHONPATH": str(_REPO_ROOT),
        "PYTHONDONTWRITEBYTECODE": "1",
        "HOME": "/nonexistent",
        "LANG": "C.UTF-8",
        "OMP_THREAD_LIMIT": "1",
    }


class ForkedProcess:
    """A converter child forked by the zygote: the parts of ``Popen`` that ChildSession uses.
    The zygote is its parent, so waiting for it goes through the zygote (``reap``)."""

    def __init__(
        self,
        *,
        pid: int,
        ns_pid: int,
        zygote: ZygoteClient,
        stdin: IO[bytes],
        stdout: IO[bytes],
    ):
        #: ``pid``: as this process sees it (kill, /proc); ``ns_pid``: inside the sandbox
        self.pid, self.ns_pid, self._zygote = pid, ns_pid, zygote
        self.stdin: IO[bytes] | None = stdin
        self.stdout: IO[bytes] | None = stdout
        self.returncode: int | None = None
        #: polls a pidfd of the child (``_pidfd``); None: ``exited`` reads ``/proc``
        self._ended: select.poll | None = None
        self._close_pidfd: Callable[[], object] = lambda: None
        pidfd = _pidfd(pid)
        if pidfd is not None:
            self._ended = select.poll()
            self._ended.register(pidfd, select.POLLIN)
            # closed after ``wait``, or when a session a forked process forgot is collected
            self._close_pidfd = weakref.finalize(self, os.close, pidfd)

    def exited(self) -> bool:
        """True once the process has ended (a zombie or gone), without reaping it."""
        if self.returncode is not None:
            return True
        ended = self._ended
        if ended is not None:
            try:
                return bool(ended.poll(0))
            except RuntimeError:  # polled by another thread at this instant: ask /proc
                pass
        try:
            with open(f"/proc/{self.pid}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:
            return True
        return stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] in (b"Z", b"X")

    @property
    def sandbox_root(self) -> sandbox.SandboxRoot | None:
        """The sandbox this process lives in (None: the sandbox is off)."""
        return self._zygote.root

    def stale(self) -> bool:
        """Its fork server no longer matches the sandbox setting (see ``_stale``)."""
        return _stale(self._zygote)

    def orphaned(self) -> bool:
        """Its zygote is gone: the child was re-parented and ends itself (its watchdog)."""
        return not self._zygote.alive()

    def wait(self) -> int:
        """Wait for the process to end and reap it (call after it was killed)."""
        if self.returncode is None:
            returncode = None
            if not self.orphaned():
                try:
                    returncode = self._zygote.reap(self.ns_pid)
                except ZygoteGone:
                    pass
            if returncode is None:
                # Re-parented: its watchdog ends it within a second. Bounded, because once init
                # has reaped it the pid may belong to another process.
                give_up = time.monotonic() + ORPHAN_EXIT_WAIT_S
                while not self.exited() and time.monotonic() < give_up:
                    time.sleep(0.01)
                returncode = -signal.SIGKILL
            self.returncode = returncode
            self._ended = None
            self._close_pidfd()
        return self.returncode


def _pidfd(pid: int) -> int | None:
    """A pidfd of ``pid``: polled, it is readable once the process has ended (a zombie too,
    whoever its parent), so ``exited`` asks it without reading ``/proc/<pid>/stat`` (≈ 1 µs
    against ≈ 25 µs for a sandboxed child, three times per kept attempt: ADR 0017, session 8).
    The pid cannot be reused before the zygote reaps it at our request (``wait``), so the pidfd
    names this child. None where pidfds are unavailable (Linux before 5.3, a seccomp filter):
    ``exited`` then reads ``/proc`` as before."""
    try:
        return os.pidfd_open(pid)
    except (OSError, AttributeError):
        return None


_zygote_lock = threading.Lock()
_zygote: ZygoteClient | None = None
_zygote_pid = 0


def zygote() -> ZygoteClient:
    """This process's fork server, started on first use and again if it died. Raises
    SandboxUnavailable when the sandbox is on but cannot be set up here."""
    global _zygote, _zygote_pid
    with _zygote_lock:
        if _zygote is None or _zygote_pid != os.getpid() or not _zygote.alive() or _stale(_zygote):
            if _zygote is not None and _zygote_pid == os.getpid():
                _zygote.close()
            _zygote = None
            if sandbox.enabled():
                status = sandbox.probe()
                if not status.available:
                    raise sandbox.SandboxUnavailable(status.reason)
            _zygote, _zygote_pid = ZygoteClient(env=_child_env()), os.getpid()
        return _zygote


def _stale(server: ZygoteClient) -> bool:
    """The sandbox setting or its directory changed since ``server`` started (tests, tools)."""
    if server.root is None:
        return sandbox.enabled()
    if not sandbox.enabled():
        return True
    # ``sandbox_dirs_parent`` hands out one cached object per setting: the one found equal to
    # the server's parent last time is recognised by identity, without building and comparing
    # paths (asked several times per attempt, ADR 0017 session 8).
    parent = sandbox.sandbox_dirs_parent()
    if parent is server.matched_parent:
        return False
    if server.root.path.parent != parent:
        return True
    server.matched_parent = parent
    return False


def current_zygote() -> ZygoteClient | None:
    """This process's fork server if it has one running (never starts one)."""
    with _zygote_lock:
        if _zygote is not None and _zygote_pid == os.getpid() and _zygote.alive():
            return _zygote
        return None


def stop_zygote() -> None:
    """End this process's fork server (at exit)."""
    global _zygote
    with _zygote_lock:
        if _zygote is not None and _zygote_pid == os.getpid():
            _zygote.close()
        _zygote = None


def spawn(
    *,
    stderr: int,
    argv: list[str] | None = None,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
) -> ForkedProcess:
    """Fork a fresh child from the zygote, with new pipes for its stdin and stdout.

    Without ``argv`` the child is a converter session (``child.serve``). With ``argv`` it
    executes that program (``env``, ``cwd`` inside the sandbox; default: the scrubbed converter
    environment and ``/``): the way to run a long-lived process, such as a warm engine, in the
    worker's sandbox. Either way it is in its own session and process group, killed with
    ``isolation.kill_process_group(proc.pid, leader=proc)`` and reaped through the zygote."""
    child_in, parent_out = os.pipe()
    parent_in, child_out = os.pipe()
    extra = {"env": env, "cwd": cwd} if argv else {}
    try:
        for tries_left in (1, 0):
            server = zygote()
            try:
                pid, ns_pid = server.spawn(
                    stdin=child_in, stdout=child_out, stderr=stderr, argv=argv, **extra
                )
                break
            except ZygoteGone:
                if not tries_left:
                    if sandbox.enabled() and not sandbox.probe(fresh=True).available:
                        raise sandbox.SandboxUnavailable(sandbox.probe().reason) from None
                    raise ConverterCrashed("the converter fork server is not available") from None
    except BaseException:
        os.close(parent_out)
        os.close(parent_in)
        raise
    finally:
        os.close(child_in)
        os.close(child_out)
    return ForkedProcess(
        pid=pid,
        ns_pid=ns_pid,
        zygote=server,
        stdin=os.fdopen(parent_out, "wb", buffering=0),
        stdout=os.fdopen(parent_in, "rb", buffering=0),
    )


def main(argv: list[str]) -> int:
    sock = socket.socket(fileno=int(argv[1]))
    return serve(sock)
