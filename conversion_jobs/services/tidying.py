"""The end of an attempt that need not delay its task's return (ADR 0017, "Session 6").

When an attempt's outcome is committed, its converter child has been killed or kept (reset) and
the sandbox's ``/tmp`` emptied, in the worker thread, before the task returns. What is left —
removing the attempt's work directory (an ``rmdir`` waits on the filesystem journal) and
checking or starting the spare converter child — runs on this process's tidying thread while
the task's result goes back to Celery's main process, the message is acked and the next one is
delivered. ``tidy_wait`` is the barrier: the runner calls it before an attempt creates its work
directory or starts a converter session, so no attempt ever runs while an earlier attempt of this
process still has files on disk, and the fork server and the spare child have one user at a time.

One thread per process, started on first use (after Celery's fork: a pool process gets its own);
a task that fails in it is logged, never raised (the stale-work-directory sweep removes what a
failed removal leaves, as it does after a crash).
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

_lock = threading.Condition()
_pending = 0
_queue: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
_owner_pid: int | None = None


def _run() -> None:
    global _pending
    while True:
        task = _queue.get()
        try:
            task()
        except Exception:
            log.exception("tidying after an attempt failed")
        finally:
            with _lock:
                _pending -= 1
                if _pending == 0:
                    _lock.notify_all()


def _started() -> None:
    """Start this process's tidying thread if it has none (none is inherited across a fork)."""
    global _owner_pid, _pending, _queue
    if _owner_pid == os.getpid():
        return
    _owner_pid, _pending, _queue = os.getpid(), 0, queue.SimpleQueue()
    threading.Thread(target=_run, name="quire-tidy", daemon=True).start()


def tidy_later(task: Callable[[], None]) -> None:
    """Run ``task`` on the tidying thread, after the tasks handed in before it."""
    global _pending
    with _lock:
        _started()
        _pending += 1
        _queue.put(task)


def tidy_wait() -> None:
    """Return once every task handed to ``tidy_later`` by this process has run."""
    with _lock:
        if _owner_pid != os.getpid():
            return  # nothing was handed in by this process (a fork inherits no pending task)
        while _pending:
            _lock.wait()


# A process that ends normally finishes its tidying first (a killed one leaves its work
# directory to the stale-work-directory sweep).
atexit.register(tidy_wait)
