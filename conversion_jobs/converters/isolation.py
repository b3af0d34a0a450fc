"""Run one converter operation in a child process in its own process group (DESIGN §7.7).

The parent polls every 100 ms at most: the child finished -> read its result; the deadline
passed -> kill the group, ConversionTimeout; ``should_stop()`` -> kill the group,
ConversionStopped; the child died by a signal, ran out of memory or exited without a
structured result -> ConverterCrashed (retryable). The group is killed with SIGKILL and
awaited until none of its processes is left, also after a normal exit (LibreOffice forks).
The child also kills its own group if the worker dies (watchdog thread), and sees a scrubbed
environment (no worker secrets).

Test faults (honoured only when the *worker* process has QUIRE_ENABLE_TEST_FAULTS=1), passed as
``options["_test_fault"]`` to ``convert_page``; without "page" a fault applies to every page:

* ``{"kind": "fail", "page": 7}``  -> InvalidInput (code invalid_input, terminal) for page 7
* ``{"kind": "hang", "page": 3}``  -> spawns a grandchild, both sleep; writes
  ``dest_dir/fault-hang-3.json`` = {"pgid": ..., "pids": [child, grandchild]}
* ``{"kind": "segv"}``             -> the child kills itself with SIGSEGV -> ConverterCrashed
* ``{"kind": "oom"}``              -> allocates until RLIMIT_AS -> ConverterCrashed
* ``{"kind": "slow", "seconds": 0.2}`` -> sleeps before converting each page
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from .base import EXIT_OUT_OF_MEMORY, Limits
from .errors import ConversionStopped, ConversionTimeout, ConverterCrashed, error_from_code

logger = logging.getLogger(__name__)

#: Set to "1" in the worker's environment to let options["_test_fault"] reach the child.
TEST_FAULTS_ENV = "QUIRE_ENABLE_TEST_FAULTS"
POLL_MAX_S = 0.1
GROUP_EXIT_WAIT_S = 5.0
_REPO_ROOT = Path(__file__).resolve().parents[2]


def test_fault_from(options: dict | None) -> dict | None:
    """options["_test_fault"] if test faults are enabled in this process, else None."""
    if os.environ.get(TEST_FAULTS_ENV) != "1" or not options:
        return None
    fault = options.get("_test_fault")
    return dict(fault) if isinstance(fault, dict) else None


def run_isolated(
    *,
    op: str,
    args: dict,
    limits: Limits,
    timeout_s: float,
    scratch_dir: Path,
    should_stop: Callable[[], bool] = lambda: False,
    fault: dict | None = None,
) -> dict:
    """Run ``op`` in ``conversion_jobs.converters.child`` and return its result dict.

    Raises the child's structured ConversionError, or ConversionTimeout, ConversionStopped,
    ConverterCrashed. ``scratch_dir`` holds the request, result and the child's TMPDIR; all
    of it is removed before returning.
    """
    private = Path(scratch_dir) / f".isolated-{uuid.uuid4().hex}"
    private.mkdir(parents=True)
    try:
        request_path, result_path = private / "request.json", private / "result.json"
        request_path.write_text(
            json.dumps(
                {
                    "op": op,
                    "args": args,
                    "limits": asdict(limits),
                    "timeout_s": timeout_s,
                    "parent_pid": os.getpid(),
                    "result": str(result_path),
                    "fault": fault,
                }
            )
        )
        with open(private / "stderr", "wb") as stderr:
            returncode = _run_and_wait(
                [sys.executable, "-m", "conversion_jobs.converters.child", str(request_path)],
                env=_child_env(private),
                cwd=private,
                stderr=stderr,
                timeout_s=timeout_s,
                should_stop=should_stop,
            )
        return _outcome(returncode, result_path, private / "stderr", limits)
    finally:
        shutil.rmtree(private, ignore_errors=True)


def _child_env(private: Path) -> dict[str, str]:
    # The child sees none of the worker's secrets (database URL, broker credentials, keys).
    return {
        "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
        "PYTHONPATH": str(_REPO_ROOT),
        "PYTHONDONTWRITEBYTECODE": "1",
        "HOME": str(private),
        "TMPDIR": str(private),
        "LANG": "C.UTF-8",
        "OMP_THREAD_LIMIT": "1",
    }


def _run_and_wait(
    argv: list[str],
    *,
    env: dict[str, str],
    cwd: Path,
    stderr,
    timeout_s: float,
    should_stop: Callable[[], bool],
) -> int:
    deadline = time.monotonic() + timeout_s
    proc = subprocess.Popen(  # noqa: S603
        argv,
        env=env,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=stderr,
        start_new_session=True,
        close_fds=True,
    )
    pgid = proc.pid
    try:
        delay = 0.005
        while True:
            # WNOWAIT: the leader stays a zombie, so its pid (= our pgid) cannot be reused
            # before we have killed the rest of the group.
            if os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                break
            if should_stop():
                raise ConversionStopped()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ConversionTimeout(f"the converter did not finish within {timeout_s:g} s")
            time.sleep(min(delay, remaining))
            delay = min(delay * 2, POLL_MAX_S)
    finally:
        kill_process_group(pgid, leader=proc)
    return proc.returncode


def kill_process_group(pgid: int, *, leader: subprocess.Popen | None = None) -> None:
    """SIGKILL every process in the group, reap the leader, wait until no member is left."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if leader is not None:
        leader.wait()
    give_up = time.monotonic() + GROUP_EXIT_WAIT_S
    while process_group_members(pgid):
        if time.monotonic() > give_up:
            logger.error(
                "processes of group %s survived SIGKILL: %s", pgid, process_group_members(pgid)
            )
            return
        time.sleep(0.01)


def process_group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes whose process group is ``pgid``, from /proc."""
    members = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:
            continue
        # The command name may contain spaces and parentheses; fields resume after the last ")".
        fields = stat[stat.rfind(b")") + 2 :].split()
        state, pgrp = fields[0], int(fields[2])
        if pgrp == pgid and state not in (b"Z", b"X"):
            members.append(int(entry.name))
    return members


def _outcome(returncode: int, result_path: Path, stderr_path: Path, limits: Limits) -> dict:
    if returncode < 0:
        name = signal.Signals(-returncode).name if -returncode in signal.valid_signals() else ""
        raise ConverterCrashed(f"the converter was killed by signal {-returncode} {name}".strip())
    if returncode == EXIT_OUT_OF_MEMORY:
        raise ConverterCrashed(
            f"the converter ran out of memory (limit {limits.memory_bytes} bytes)"
        )
    if returncode == 0 and result_path.is_file():
        outcome = json.loads(result_path.read_text())
        if outcome["ok"]:
            return outcome["result"]
        raise error_from_code(outcome["code"], outcome.get("detail"))
    tail = stderr_path.read_text(errors="replace").strip().splitlines()[-1:]
    raise ConverterCrashed(
        f"the converter exited with status {returncode} {' '.join(tail)}".strip()
    )
