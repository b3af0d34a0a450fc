"""Converter child processes in their own process group (ADR 0009).

A ``ChildSession`` is one long-lived child (``conversion_jobs.converters.child``, forked by the
process's fork server, ``zygote``) that answers
requests (JSON lines over a pipe): set up, prepare a document, convert its pages one by one while
keeping the document open. For every request the parent waits at most ``timeout_s`` and polls
every 100 ms at most: an answer -> the result or the child's structured ConversionError; the
deadline passed -> kill the group, ConversionTimeout; ``should_stop()`` -> kill the group,
ConversionStopped; the child died by a signal, ran out of memory or ended without an answer ->
ConverterCrashed (retryable). Any failure other than a structured error ends the session: the
group is killed with SIGKILL and awaited until none of its processes is left (LibreOffice and
tesseract fork), and its private directory is removed. The child also kills its own group if the
worker dies (watchdog thread), and sees a scrubbed environment (no worker secrets).

Test faults (honoured only when the *worker* process has QUIRE_ENABLE_TEST_FAULTS=1), passed as
``options["_test_fault"]`` to ``convert_page``; without "page" a fault applies to every page:

* ``{"kind": "fail", "page": 7}``  -> InvalidInput (code invalid_input, terminal) for page 7
* ``{"kind": "hang", "page": 3}``  -> spawns a grandchild, both sleep; writes
  ``dest_dir/fault-hang-3.json`` = {"pgid": ..., "pids": [child, grandchild]}
* ``{"kind": "segv"}``             -> the child kills itself with SIGSEGV -> ConverterCrashed
* ``{"kind": "oom"}``              -> allocates until RLIMIT_AS -> ConverterCrashed
* ``{"kind": "slow", "seconds": 0.2}`` -> sleeps before converting each page
* ``{"kind": "cut", "page": 4}``   -> the child dies (SIGKILL) halfway through writing page 4's
  answer (its raw text bytes, inline) -> ConverterCrashed for page 4
"""

from __future__ import annotations

import errno
import json
import logging
import os
import select
import shutil
import signal
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import fields
from pathlib import Path
from typing import IO

from .base import BODY, EXIT_OUT_OF_MEMORY, TEST_FAULTS_ENV, Limits, process_group_members
from .errors import ConversionStopped, ConversionTimeout, ConverterCrashed, error_from_answer
from .zygote import ForkedProcess, spawn

logger = logging.getLogger(__name__)

#: Child operations only sent with TEST_FAULTS_ENV=1 (the sandbox tests' escape attempts).
TEST_OPS = frozenset({"attempt_access"})
POLL_MAX_S = 0.1
_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
GROUP_EXIT_WAIT_S = 5.0


def test_fault_from(options: dict | None) -> dict | None:
    """options["_test_fault"] if test faults are enabled in this process, else None."""
    if os.environ.get(TEST_FAULTS_ENV) != "1" or not options:
        return None
    fault = options.get("_test_fault")
    return dict(fault) if isinstance(fault, dict) else None


def _limits_setup(limits: Limits) -> dict:
    """The limits as a child's setup carries them: a shallow dict of the fields. ``asdict``
    gave the same for these scalar fields but deep-copied each one (≈ 19 µs against ≈ 2 µs,
    ≈ 1 % of a pool process's Python time per one-page attempt; ADR 0017, session 10)."""
    return {f.name: getattr(limits, f.name) for f in _LIMIT_FIELDS}


_LIMIT_FIELDS = fields(Limits)


class ChildSession:
    """One isolated child process and its private directory. Not thread-safe: one user at a time.

    The child is a fresh fork of this worker process's fork server (``zygote``: a clean,
    pre-imported interpreter, see zygote.py); ``setup`` (the first request) gives it its private
    directory ``scratch_dir/.isolated-<hex>`` and its limits.
    """

    def __init__(self) -> None:
        # The child's stderr (its crash message): a memory file, no inode on the work disk.
        self._stderr = os.fdopen(os.memfd_create("quire-child-stderr", os.MFD_CLOEXEC), "w+b")
        self.proc = spawn(stderr=self._stderr.fileno())
        self.pgid = self.proc.pid
        self.spawned_at = self.last_used = time.monotonic()
        self.limits: Limits | None = None
        self.private: Path | None = None
        #: a kept child's private directory, emptied when it was kept: its next ``setup``
        #: takes it again instead of making a new one (``empty_directory``)
        self.emptied: Path | None = None
        self.closed = False
        #: converter reuse within a tenant (sessions.py): whose attempts it served, how many,
        #: and whether any request failed (a failed session is never reused)
        self.tenant: str | None = None
        self.attempts = 0
        self.errored = False
        #: kept for the tenant's next attempt: the child resets (closes the last attempt's
        #: document, forgets its directory) as the first step of its next ``setup``, in the
        #: same round trip, before it takes that attempt's directory and limits
        self.reset_due = False
        #: the setup the child has still to run: it goes with the next request (``setup``)
        self._setup_due: dict | None = None
        self._buffer = b""
        #: pages asked for by read_ahead whose answers are still to be read, in order
        self.ahead: list[int] = []
        self._ahead_since = 0.0
        #: the copy of the session's document in its private directory (``hand_in``)
        self.document: Path | None = None
        #: test faults only: where close() copies the child's fault records (pids translated)
        self.fault_records_to: Path | None = None
        #: the child's ``/proc/<pid>/statm``, open once it was first read (``rss_bytes``)
        self._statm: int | None = None

    def usable(self, *, max_idle_s: float) -> bool:
        return (
            not self.closed
            and not self._leader_exited()
            and not self.proc.stale()
            and time.monotonic() - self.last_used < max_idle_s
            and (self.private is None or self.private.is_dir())
        )

    def _leader_exited(self) -> bool:
        # An exited leader stays a zombie until close() reaps it, so its pid (= our pgid) cannot
        # be reused before the group is killed.
        return self.proc.exited()

    def setup(self, *, limits: Limits, scratch_dir: Path) -> None:
        """Give the child its private directory and limits. Sandboxed, the directory is in the
        sandbox's writable area (the only place the child can see besides system files);
        with the sandbox off it is ``scratch_dir/.isolated-<hex>``. The directory exists when
        this returns; the child takes it (and its limits, and a kept child first forgets its last
        attempt) as the first step of the next request, in the same round trip: no request
        ever runs before its setup, and a session costs one round trip less."""
        root = self.proc.sandbox_root
        private, self.emptied = self.emptied, None
        if private is None or not private.is_dir():
            name = f".isolated-{uuid.uuid4().hex}"
            private = root.work / name if root is not None else Path(scratch_dir) / name
            private.mkdir(parents=True, mode=0o700)
            if root is not None and os.geteuid() == 0:
                os.chown(private, root.uid, root.gid)
        self.private, self.limits = private, limits
        setup: dict = {"directory": str(private), "limits": _limits_setup(limits)}
        if self.reset_due:
            setup["reset"] = True
        self._setup_due, self.reset_due = setup, False

    def _request(self, op: str, args: dict, *, timeout_s: float, fault: dict | None) -> bytes:
        """One request line; the pending setup rides along (the child runs it first)."""
        request = {"op": op, "args": args, "timeout_s": timeout_s, "fault": fault}
        if self._setup_due is not None:
            request["setup"], self._setup_due = self._setup_due, None
        return json.dumps(request).encode() + b"\n"

    def inside(self, *parts: str) -> Path:
        """A path in the child's private directory (the same path inside and outside)."""
        if self.private is None:
            raise RuntimeError("the session is not set up")
        return self.private.joinpath(*parts)

    def folder(self, name: str) -> Path:
        """A directory in the child's private directory that the child may write in."""
        folder = self.inside(name)
        if not folder.is_dir():
            folder.mkdir(mode=0o700)
            self._give_to_sandbox(folder)
        return folder

    def hand_in(self, source: Path) -> Path:
        """``source`` (the attempt's own copy in its work directory, never a path into the
        store) in the child's private directory, readable by the child: the only way a document
        reaches a child. A hard link where both are on one filesystem (the usual case: the
        sandbox's directory is under the same work dir), so the bytes are not copied a second
        time. A root worker's sandbox runs as another uid: the linked file is then made
        read-only for everyone (0444, owner unchanged), so that uid can read it and cannot
        change it (the attempt's work directory, 0700, keeps everyone else out); otherwise the
        child runs as this process's user and reads it as it is. Where no link can be made, a
        copy, 0600 and given to the sandbox's uid."""
        copy = self.inside(f"{uuid.uuid4().hex}{Path(source).suffix}")
        try:
            os.link(source, copy)
        except OSError:
            shutil.copyfile(source, copy)
            os.chmod(copy, 0o600)
            self._give_to_sandbox(copy)
            return copy
        if self.proc.sandbox_root is not None and os.geteuid() == 0:
            os.chmod(copy, 0o444)
        return copy

    def hand_out(self, produced: Path, dest: Path) -> Path:
        """Move a file the child wrote (in its private directory) to ``dest``, owned by this
        process's user."""
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.replace(produced, dest)
        except OSError as exc:
            if exc.errno != errno.EXDEV:
                raise
            shutil.move(produced, dest)
        if os.geteuid() == 0 and self.proc.sandbox_root is not None:
            os.chown(dest, os.geteuid(), os.getegid())
        return dest

    def _give_to_sandbox(self, *paths: Path) -> None:
        root = self.proc.sandbox_root
        if root is not None and os.geteuid() == 0:
            for path in paths:
                os.chown(path, root.uid, root.gid)

    def call(
        self,
        op: str,
        args: dict,
        *,
        timeout_s: float,
        should_stop: Callable[[], bool],
        fault: dict | None = None,
    ) -> dict:
        """Send one request and wait for its answer; see the module docstring for failures."""
        if self.closed:
            raise ConverterCrashed("the converter session is closed")
        if op in TEST_OPS and os.environ.get(TEST_FAULTS_ENV) != "1":
            raise RuntimeError(f"{op} is a test operation ({TEST_FAULTS_ENV}=1 only)")
        if self.ahead:
            self.close()  # answers of a read-ahead are still due: never mix them with this one
            raise ConverterCrashed("the converter session had unread pages")
        try:
            if should_stop():
                raise ConversionStopped()
            self._send(self._request(op, args, timeout_s=timeout_s, fault=fault))
            outcome = self._receive(timeout_s=timeout_s, should_stop=should_stop)
        except BaseException:
            self.close()
            raise
        self.last_used = time.monotonic()
        if outcome["ok"]:
            return outcome["result"]
        self.errored = True
        raise error_from_answer(outcome)

    def rss_bytes(self) -> int:
        """Resident memory of the child (0 if it cannot be read). Its ``/proc/<pid>/statm`` is
        opened once per child and read again at offset 0 after each attempt: the open (a path
        walk into another pid namespace and an access check) was most of ≈ 30 µs per kept
        attempt, a read of the open file is ≈ 2 µs (ADR 0017, session 8). The open file names
        this process for as long as it is open, so a reused pid can never answer for it."""
        try:
            if self._statm is None:
                self._statm = os.open(f"/proc/{self.pgid}/statm", os.O_RDONLY | os.O_CLOEXEC)
            return int(os.pread(self._statm, 256, 0).split()[1]) * _PAGE_SIZE
        except (OSError, ValueError, IndexError):
            return 0

    def read_ahead(
        self,
        page_op: str,
        items: list[tuple[int, str]],
        args: dict,
        *,
        timeout_s: float,
        should_stop: Callable[[], bool],
        fault: dict | None = None,
    ) -> None:
        """Ask for several pages at once (``items``: (page, dest) in order); the child converts
        them one after the other and answers each as it is done, so it works on the next pages
        while the worker checkpoints this one. Collect them in order with ``next_page``. Pages
        already asked for and not yet collected stay due first: the child reads this request
        once it has answered them (requests are served in order), so it never idles between
        two read-aheads."""
        if self.closed:
            raise RuntimeError("read_ahead needs an open session")
        try:
            if should_stop():
                raise ConversionStopped()
            pages = {**args, "page_op": page_op, "items": [list(i) for i in items]}
            self._send(self._request("pages", pages, timeout_s=timeout_s, fault=fault))
        except BaseException:
            self.close()
            raise
        if not self.ahead:
            self._ahead_since = time.monotonic()
        self.ahead += [page for page, _dest in items]

    def prepare_reading_ahead(
        self,
        op: str,
        args: dict,
        page_op: str,
        pages: Sequence[int],
        dest: tuple[str, str],
        page_args: dict,
        *,
        limits: Limits,
        should_stop: Callable[[], bool],
        fault: dict | None = None,
    ) -> dict:
        """``call(op, args)`` — a document's prepare, whose result has its ``page_count`` — and
        ``read_ahead(page_op, items, page_args)`` in one request and one round trip: the child
        answers the prepare, then converts ``pages`` (consecutive; those up to the count, both
        sides drop the others) only if the prepare succeeded. The request names the range, not
        each page: page N goes to ``<dest[0]>/page-NNNN<dest[1]>`` (the child builds the names).
        Returns the prepare's result; a structured prepare error is raised as ``call`` raises
        it, with no page due. ``limits.prepare_timeout_s`` bounds the prepare's answer,
        ``limits.page_timeout_s`` each page (``next_page`` is given it)."""
        if list(pages) != list(range(pages[0], pages[0] + len(pages))):
            raise ValueError("the first pages must be consecutive")
        if self.closed:
            raise ConverterCrashed("the converter session is closed")
        if self.ahead:
            self.close()
            raise ConverterCrashed("the converter session had unread pages")
        try:
            if should_stop():
                raise ConversionStopped()
            request = {
                **page_args,
                "page_op": page_op,
                "items": [],
                "prepare": {"op": op, "args": args},
                "first": [pages[0], pages[-1], *dest],
            }
            # the child's watchdog covers both steps
            limit = max(limits.prepare_timeout_s, limits.page_timeout_s)
            self._send(self._request("pages", request, timeout_s=limit, fault=fault))
            outcome = self._receive(timeout_s=limits.prepare_timeout_s, should_stop=should_stop)
            if "page" in outcome:
                raise ConverterCrashed("the converter answered a page for a prepare")
        except BaseException:
            self.close()
            raise
        self._ahead_since = self.last_used = time.monotonic()
        if not outcome["ok"]:
            self.errored = True
            raise error_from_answer(outcome)
        result = outcome["result"]
        self.ahead = [page for page in pages if page <= int(result["page_count"])]
        return result

    def next_page(self, page: int, *, timeout_s: float, should_stop: Callable[[], bool]) -> dict:
        """The answer for ``page``, which must be the next one due from ``read_ahead``. The
        deadline runs from when the previous answer was read (or the request was sent): each page
        gets ``timeout_s``, and a crash or timeout is charged to the page being converted."""
        if not self.ahead or self.ahead[0] != page:
            raise RuntimeError(f"page {page} is not the next page due")
        try:
            remaining = self._ahead_since + timeout_s - time.monotonic()
            outcome = self._receive(
                timeout_s=max(remaining, 0.0), should_stop=should_stop, limit_s=timeout_s
            )
            if outcome.get("page") != page:
                raise ConverterCrashed("the converter answered for another page")
        except BaseException:
            self.close()
            raise
        self.ahead.pop(0)
        self._ahead_since = self.last_used = time.monotonic()
        if outcome["ok"]:
            return outcome["result"]
        self.errored = True
        raise error_from_answer(outcome)

    @staticmethod
    def _pipe(stream: IO[bytes] | None) -> IO[bytes]:
        if stream is None:  # Popen was given PIPE for both: only a programming error lands here
            raise RuntimeError("converter child pipe missing")
        return stream

    def _send(self, data: bytes) -> None:
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self._pipe(self.proc.stdin).fileno(), view) :]
        except BrokenPipeError:
            self._crashed()

    def _receive(
        self, *, timeout_s: float, should_stop: Callable[[], bool], limit_s: float | None = None
    ) -> dict:
        """The next answer: its line, and the raw ``BODY`` bytes that follow it when the line
        names their length (put back in its result, see child.py). ``timeout_s``: how long to
        wait from now, for the line and its bytes; ``limit_s``: the limit to name in the
        timeout error (default ``timeout_s``). A child that dies before all of an answer's
        bytes came crashed on that answer."""
        deadline = time.monotonic() + timeout_s
        newline = self._buffer.find(b"\n")
        if newline < 0:  # else the answer came with an earlier read (read-ahead): no wait
            newline = self._read_until(
                lambda: self._buffer.find(b"\n"),
                deadline=deadline,
                limit_s=timeout_s if limit_s is None else limit_s,
                should_stop=should_stop,
            )
        try:
            # From str: json.loads on bytes first guesses their encoding in Python (per page).
            outcome = json.loads(self._buffer[:newline].decode("utf-8"))
        except ValueError:
            raise ConverterCrashed("the converter sent an unreadable answer") from None
        if not isinstance(outcome, dict) or "ok" not in outcome:
            raise ConverterCrashed("the converter sent an unreadable answer")
        end = newline + 1
        size = outcome.pop(BODY, None)
        if size is not None:
            result = outcome.get("result")
            if not isinstance(size, int) or size < 0 or not isinstance(result, dict):
                raise ConverterCrashed("the converter sent an unreadable answer")
            start, end = end, end + size
            if len(self._buffer) < end:
                self._read_until(
                    lambda: end if len(self._buffer) >= end else -1,
                    deadline=deadline,
                    limit_s=timeout_s if limit_s is None else limit_s,
                    should_stop=should_stop,
                )
            result[BODY] = self._buffer[start:end]
        self._buffer = self._buffer[end:]
        return outcome

    def _read_until(
        self,
        ready: Callable[[], int],
        *,
        deadline: float,
        limit_s: float,
        should_stop: Callable[[], bool],
    ) -> int:
        """Read from the child until ``ready()`` (an index into the buffer, -1 while not
        there) is found; that index."""
        next_check = time.monotonic() + POLL_MAX_S
        fd = self._pipe(self.proc.stdout).fileno()
        poller = select.poll()
        poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
        while (found := ready()) < 0:
            now = time.monotonic()
            if now >= next_check:
                if should_stop():
                    raise ConversionStopped()
                next_check = now + POLL_MAX_S
            wait_s = max(0.0, min(next_check, deadline) - now)
            if poller.poll(wait_s * 1000 + 1):
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    self._crashed()
                self._buffer += chunk
            elif time.monotonic() >= deadline:  # an answer already in the pipe still counts
                raise ConversionTimeout(f"the converter did not finish within {limit_s:g} s")
        return found

    def _crashed(self) -> None:
        """The child ended (or closed its pipe) without answering: kill, reap, raise."""
        self._kill()
        returncode = self.proc.wait()  # reaped by _kill: its status
        if returncode < 0:
            number = -returncode
            name = signal.Signals(number).name if number in signal.valid_signals() else ""
            raise ConverterCrashed(f"the converter was killed by signal {number} {name}".strip())
        if returncode == EXIT_OUT_OF_MEMORY:
            memory = self.limits.memory_bytes if self.limits else "?"
            raise ConverterCrashed(f"the converter ran out of memory (limit {memory} bytes)")
        self._stderr.seek(0)
        tail = self._stderr.read().decode("utf-8", "replace").strip().splitlines()[-1:]
        raise ConverterCrashed(
            f"the converter exited with status {returncode} {' '.join(tail)}".strip()
        )

    def _kill(self) -> None:
        if self.proc.orphaned():
            # Its fork server is gone: init may already have reaped the child and its pid (our
            # pgid) may be reused, so it is never signalled; its watchdog kills its own group.
            self.proc.wait()
            return
        # The leader is not reaped before killpg, so its pid (= our pgid) cannot be reused.
        kill_process_group(self.pgid, leader=self.proc)

    def close(self) -> None:
        """Kill the group, reap it, remove the private directory. Idempotent."""
        if self.closed:
            return
        self.closed = True
        if self.fault_records_to is not None and self.private is not None:
            _export_fault_records(self.private, self.fault_records_to)
        self._kill()
        for stream in (self.proc.stdin, self.proc.stdout, self._stderr):
            if stream is not None:
                stream.close()
        if self._statm is not None:
            os.close(self._statm)
            self._statm = None
        for directory in (self.private, self.emptied):
            if directory is not None:
                shutil.rmtree(directory, ignore_errors=True)

    def __enter__(self) -> ChildSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _export_fault_records(private: Path, dest_dir: Path) -> None:
    """Test faults only: copy the ``fault-*.json`` records a child wrote in its private
    directory to ``dest_dir`` before the group is killed, with its pids translated from the
    sandbox's pid namespace into ours (``host_pid``)."""
    if os.environ.get(TEST_FAULTS_ENV) != "1":
        return
    for record_path in private.rglob("fault-*.json"):
        try:
            record = json.loads(record_path.read_text())
        except (OSError, ValueError):
            continue
        pidns = record.get("pidns")
        if pidns:
            record["pids"] = [host_pid(pidns, pid) for pid in record["pids"]]
            record["pgid"] = host_pid(pidns, record["pgid"])
        dest_dir.mkdir(parents=True, exist_ok=True)
        (dest_dir / record_path.name).write_text(json.dumps(record))


def host_pid(pidns: str, ns_pid: int) -> int:
    """The pid, as this process sees it, of process ``ns_pid`` of pid namespace ``pidns``
    (``readlink /proc/<pid>/ns/pid``); 0 if there is none. Scans /proc: for tests and tools."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if os.readlink(f"/proc/{entry.name}/ns/pid") != pidns:
                continue
            with open(f"/proc/{entry.name}/status") as fh:
                for line in fh:
                    if line.startswith("NSpid:"):
                        if int(line.split()[-1]) == ns_pid:
                            return int(entry.name)
                        break
        except (OSError, ValueError):
            continue
    return 0


def kill_process_group(pgid: int, *, leader: ForkedProcess | None = None) -> None:
    """SIGKILL every process in the group, reap the leader, wait until no member is left."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if leader is not None:
        leader.wait()
    if not _group_exists(pgid):
        return  # the common case, one syscall: the leader was the group's only process
    give_up = time.monotonic() + GROUP_EXIT_WAIT_S
    while process_group_members(pgid):
        if time.monotonic() > give_up:
            logger.error(
                "processes of group %s survived SIGKILL: %s", pgid, process_group_members(pgid)
            )
            return
        time.sleep(0.01)


def _group_exists(pgid: int) -> bool:
    """Whether any process, zombies included, is still in group ``pgid`` (signal 0)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def empty_directory(path: Path) -> bool:
    """Remove everything in ``path`` but keep the directory itself, for the next attempt of
    this process to take it (a rename, or the same path) instead of a new one: on the work
    disk, a directory made and removed per attempt costs the kernel's inode allocator far more
    than emptying it (ADR 0017, session 7). True only if the directory is there and empty
    afterwards; on False the caller removes it as before and the next attempt makes a new one.
    Symbolic links are removed, never followed."""
    try:
        with os.scandir(path) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path)
                else:
                    os.unlink(entry.path)
        with os.scandir(path) as entries:
            return next(entries, None) is None
    except OSError:
        return False
