"""The isolated converter process: ``python -m conversion_jobs.converters.child``.

A session: it reads one JSON request per line on stdin and answers each with one JSON line,
``{"ok": true, "result": ...}`` or ``{"ok": false, "code": ..., "detail": ...}``, on the stdout
it had at start (its own stdout then goes to stderr, so a library's stray print cannot break the
protocol). A result holding bytes under ``BODY`` (a text page's UTF-8) is sent as that line
with ``"body": <length>`` in place of the bytes, followed by the bytes as they are, in the same
write (``_encode``). The first request carries the session's ``setup`` (the parent's
``ChildSession.setup``), which the child runs before that request's operation: the private
directory (cwd, HOME, TMPDIR) and the limits (RLIMIT_AS, no core files); with ``reset``, a kept
child first forgets its last attempt. Between requests it keeps state that makes pages cheap,
such as the open PDF (see ``pdfops``). A crash (signal, out of memory, unexpected exception) answers
nothing and the parent reports ``converter_crashed``. End of stdin ends the process. Never imports
Django.
"""

from __future__ import annotations

import _thread
import functools
import gc
import importlib
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, NoReturn

from .base import BODY, CHILD_IDLE_EXIT_S, EXIT_OUT_OF_MEMORY, EXIT_UNEXPECTED, Limits
from .errors import ConversionError, InvalidInput

#: The child kills its own group this long after a request's deadline, should the parent hang.
WATCHDOG_GRACE_S = 10.0


def _lazy(module: str, name: str) -> Callable[..., dict]:
    """The op ``module.name``, imported when first called: a child loads only the code of the
    ops it serves (the fork server preloads pdfops and imageops, ``preload``; the Office ops
    and their helpers load in the children that convert Office documents)."""

    def op(**kwargs: object) -> dict:
        function = getattr(importlib.import_module(f".{module}", __package__), name)
        return function(**kwargs)  # type: ignore[no-any-return]

    return op


def _op_probe(*, limits: Limits) -> dict:
    """For tests: what the isolated process looks like from inside."""
    return {
        "pid": os.getpid(),
        "pgid": os.getpgid(0),
        "sid": os.getsid(0),
        "rlimit_as": resource.getrlimit(resource.RLIMIT_AS)[0],
        "rlimit_core": resource.getrlimit(resource.RLIMIT_CORE)[0],
        "django_loaded": any(name.split(".")[0] == "django" for name in sys.modules),
        "environ": sorted(os.environ),
        "cwd": os.getcwd(),
        "open_document": _open_document(),
    }


def _open_document() -> str | None:
    pdfops = sys.modules.get("conversion_jobs.converters.pdfops")
    key = pdfops._open["key"] if pdfops is not None else None
    return key[0] if key else None


def _op_attempt_access(
    *, files: list[str], unix_sockets: list[str], tcp: list[list], limits: Limits
) -> dict:
    """Test only (the worker sends it only with QUIRE_ENABLE_TEST_FAULTS=1, see
    ``isolation.TEST_OPS``): try to read each file, connect to each Unix socket and TCP
    address; report "ok" or the error for each. Sandboxed, every one must fail."""

    def attempt(action: Callable[[], None]) -> str:
        try:
            action()
            return "ok"
        except OSError as exc:
            return f"{type(exc).__name__}: {exc.strerror or exc}"

    def read(path: str) -> None:
        with open(path, "rb") as fh:
            fh.read(1)

    def unix(path: str) -> None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(2)
            sock.connect(path)

    def connect(host: str, port: int) -> None:
        with socket.create_connection((host, port), timeout=2):
            pass

    return {
        "files": {path: attempt(functools.partial(read, path)) for path in files},
        "unix_sockets": {path: attempt(functools.partial(unix, path)) for path in unix_sockets},
        "tcp": {
            f"{host}:{port}": attempt(functools.partial(connect, host, int(port)))
            for host, port in tcp
        },
    }


OPS: dict[str, Callable[..., dict]] = {
    "pdf_prepare": _lazy("pdfops", "pdf_prepare"),
    "pdf_page": _lazy("pdfops", "pdf_page"),
    "image_prepare": _lazy("imageops", "image_prepare"),
    "image_page": _lazy("imageops", "image_page"),
    "office_scan": _lazy("containers", "office_scan"),
    "office_prepare": _lazy("officeops", "office_prepare"),
    "office_engine_convert": _lazy("officeengine", "office_engine_convert"),
    "office_engine_start": _lazy("officeengine", "office_engine_start"),
    "probe": _op_probe,
    "attempt_access": _op_attempt_access,
}
PAGE_OPS = frozenset({"pdf_page", "image_page"})
#: ``pages``: one request, one answer line per page, in order (read-ahead, see isolation.py).
STREAM_OPS = frozenset({"pages"})


class _Watch:
    """What the watchdog thread looks at; written by the request loop."""

    def __init__(self) -> None:
        self.busy_until: float | None = None
        self.idle_since = time.monotonic()


def _start_watchdog(watch: _Watch, *, parent_pid: int) -> None:
    """Kill this whole process group if the worker dies (e.g. SIGKILL), stops watching a request
    past its deadline, or leaves the session idle for too long."""

    def run() -> None:
        while True:
            time.sleep(0.25)
            now = time.monotonic()
            busy_until = watch.busy_until
            if (
                os.getppid() != parent_pid
                or (busy_until is not None and now > busy_until)
                or (busy_until is None and now - watch.idle_since > CHILD_IDLE_EXIT_S)
            ):
                _before_group_kill()
                os.killpg(0, signal.SIGKILL)

    # A bare thread, not a ``threading.Thread``: no start-up handshake (the caller does not wait
    # for the thread to run) and none of threading's bookkeeping objects in a fresh child.
    _thread.start_new_thread(run, ())


def _reset() -> None:
    """Forget the attempt that ended (converter reuse within a tenant, sessions.py): close the
    open document and leave its private directory, which the parent has emptied (and removes
    if the child is not kept). The next ``setup`` gives the next attempt that directory again,
    empty, or a new one."""
    pdfops = sys.modules.get("conversion_jobs.converters.pdfops")
    if pdfops is not None:
        pdfops.close_document()
    os.chdir("/")
    os.environ["HOME"] = os.environ["TMPDIR"] = "/nonexistent"
    tempfile.tempdir = None
    gc.collect()


def _before_group_kill() -> None:
    """What must go before this group dies and cannot clean up after itself: the warm engine's
    sockets (see officeengine). Never lets an error stop the kill."""
    module = sys.modules.get("conversion_jobs.converters.officeengine")
    if module is not None:
        try:
            module.before_group_kill()
        except Exception:  # noqa: S110
            pass


def _setup(*, directory: str, limits: dict) -> Limits:
    os.chdir(directory)
    os.environ["HOME"] = os.environ["TMPDIR"] = directory
    tempfile.tempdir = None
    parsed = Limits(**limits)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_AS, (parsed.memory_bytes, parsed.memory_bytes))
    return parsed


_preloaded = False


def preload() -> None:
    """Import what pages need before any document arrives: the fork server (``zygote``) does
    this once, so every child it forks starts with pypdfium2 and Pillow loaded. Idempotent."""
    global _preloaded
    if _preloaded:
        return
    _preloaded = True
    # (function-level: what preloading means; a child the fork server did not start loads
    # these with its first page instead)
    import PIL.Image
    import PIL.PngImagePlugin  # noqa: F401

    from . import imageops, pdfops  # noqa: F401

    pdfops.warm_up()


def _inject_fault(fault: dict, *, op: str, args: dict) -> None:
    """Test-only misbehaviour; the parent passes a fault only with QUIRE_ENABLE_TEST_FAULTS=1."""
    if op not in PAGE_OPS:
        return
    wanted = fault.get("page")
    if wanted is not None and int(wanted) != args.get("page"):
        return
    kind = fault.get("kind")
    if kind == "slow":
        time.sleep(float(fault.get("seconds", 0.2)))
    elif kind == "fail":
        raise InvalidInput(f"injected failure on page {args.get('page')}")
    elif kind == "segv":
        os.kill(os.getpid(), signal.SIGSEGV)
    elif kind == "oom":
        hog = []
        while True:
            hog.append(bytearray(64 << 20))
    elif kind == "hang":
        grandchild = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(3600)"],
            stdin=subprocess.DEVNULL,
        )
        record = {
            "pgid": os.getpgid(0),
            "pids": [os.getpid(), grandchild.pid],
            "pidns": os.readlink("/proc/self/ns/pid"),  # pids translate outside (host_pid)
        }
        dest = Path(args["dest"])
        (dest.parent / f"fault-hang-{args.get('page')}.json").write_text(json.dumps(record))
        while True:
            time.sleep(3600)


def _run_op(op: str, args: dict, *, fault: dict | None, limits: Limits) -> dict:
    """One operation's outcome: its result, or its structured ConversionError."""
    try:
        if fault:
            _inject_fault(fault, op=op, args=args)
        return {"ok": True, "result": OPS[op](**args, limits=limits)}
    except ConversionError as exc:
        return {"ok": False, "code": exc.code, "detail": exc.detail, "public": exc.public}


def _take_setup(setup: dict) -> Limits:
    """A request's ``setup``, run before its operation: a kept child forgets its last attempt
    first (``reset``), then takes its private directory and limits."""
    if setup.pop("reset", False):
        _reset()
    return _setup(**setup)


def _answer(request: dict, limits: Limits | None) -> dict:
    op, args = request["op"], request.get("args") or {}
    if limits is None:
        raise RuntimeError("a request before setup")
    return _run_op(op, args, fault=request.get("fault"), limits=limits)


def _first_items(low: int, high: int, folder: str, suffix: str, *, count: int) -> list:
    """A prepare's first pages ``low``..``high`` up to ``count``, as [page, dest] items named as
    the parent names pages (registry._page_dest): one short request whatever the range."""
    return [
        [page, f"{folder}/page-{page:04d}{suffix}"] for page in range(low, min(high, count) + 1)
    ]


def _stream(request: dict, limits: Limits, watch: _Watch) -> Iterator[dict]:
    """``pages``: args ``page_op`` (a PAGE_OPS name), ``items`` ([page, dest] pairs) and the
    page op's other arguments. Yields one outcome per page, each carrying its ``page``; a
    structured error answers that page and the next page goes on. The watchdog's deadline is
    renewed for every page. With ``prepare`` ({"op", "args"}: the document's prepare, which
    answers its ``page_count``), that runs first and its outcome is the first answer; the pages
    (``first``: [low, high, folder, suffix] instead of ``items``) follow only if it succeeded,
    those beyond the count left out (the parent drops them too)."""
    args = dict(request["args"])
    op, items = args.pop("page_op"), args.pop("items")
    if op not in PAGE_OPS:
        raise RuntimeError(f"not a page operation: {op}")
    prepare, first = args.pop("prepare", None), args.pop("first", None)
    if prepare is not None:
        prepared = _run_op(prepare["op"], prepare["args"], fault=None, limits=limits)
        yield prepared
        if not prepared["ok"]:
            return
        if first is not None:
            items = _first_items(*first, count=prepared["result"]["page_count"])
        items = [item for item in items if item[0] <= prepared["result"]["page_count"]]
    for page, dest in items:
        watch.busy_until = time.monotonic() + float(request["timeout_s"]) + WATCHDOG_GRACE_S
        page_args = {**args, "page": page, "dest": dest}
        yield {**_run_op(op, page_args, fault=request.get("fault"), limits=limits), "page": page}


def _encode(outcome: dict) -> bytes:
    """An answer as written to the parent: its JSON line, and after it the result's raw
    ``BODY`` bytes if it has some (their length in the line, under ``BODY``). Takes the bytes
    out of ``outcome``."""
    result = outcome.get("result")
    if isinstance(result, dict) and isinstance(result.get(BODY), bytes):
        body = result.pop(BODY)
        outcome[BODY] = len(body)
        return json.dumps(outcome).encode() + b"\n" + body
    return json.dumps(outcome).encode() + b"\n"


def _write(protocol: IO[bytes], outcome: dict, *, fault: dict | None) -> None:
    """Write one page's answer. Test fault ``cut`` (QUIRE_ENABLE_TEST_FAULTS=1 only): the
    child dies by SIGKILL halfway through that page's raw bytes."""
    data = _encode(outcome)
    if fault and fault.get("kind") == "cut" and fault.get("page") == outcome.get("page"):
        protocol.write(data[: len(data) - max(1, outcome.get(BODY, 0) // 2)])
        os.kill(os.getpid(), signal.SIGKILL)
    protocol.write(data)


def main() -> int:
    protocol = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    requests = open(0, "rb", closefd=False)
    watch = _Watch()
    _start_watchdog(watch, parent_pid=os.getppid())
    preload()
    limits: Limits | None = None
    while True:
        line = requests.readline()
        if not line:  # the parent closed the session (or died)
            engine = sys.modules.get("conversion_jobs.converters.officeengine")
            if engine is not None and engine.running():
                _before_group_kill()  # the engine's processes must not outlive their host
                os.killpg(0, signal.SIGKILL)
            return 0
        request = json.loads(line)
        watch.busy_until = time.monotonic() + float(request["timeout_s"]) + WATCHDOG_GRACE_S
        if request.get("setup") is not None:  # the session's setup travels with its first request
            limits = _take_setup(request["setup"])
        if request["op"] in STREAM_OPS and limits is not None:
            for outcome in _stream(request, limits, watch):
                _write(protocol, outcome, fault=request.get("fault"))
        else:
            protocol.write(_encode(_answer(request, limits)))
        watch.idle_since = time.monotonic()
        watch.busy_until = None


def serve() -> NoReturn:
    """Run the session, then end the process. The exit happens inside the ``except`` blocks on
    purpose: the traceback keeps ``main``'s frame, and so the protocol pipe, alive until the
    process is gone. Closing the pipe first would let the parent see end-of-file and kill the
    child before it could exit with its status (out of memory -> EXIT_OUT_OF_MEMORY)."""
    try:
        code = main()
    except MemoryError:
        os._exit(EXIT_OUT_OF_MEMORY)
    except Exception as exc:  # a bug or an unexpected library failure: report as a crash
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        sys.stderr.flush()
        os._exit(EXIT_UNEXPECTED)
    os._exit(code)


if __name__ == "__main__":
    serve()
