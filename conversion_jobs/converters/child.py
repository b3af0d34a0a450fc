"""The isolated converter process: ``python -m conversion_jobs.converters.child REQUEST``.

Reads a JSON request, sets its own memory limit, runs one operation on untrusted input and writes
``{"ok": true, "result": ...}`` or ``{"ok": false, "code": ..., "detail": ...}`` to the result
file. A crash (signal, out of memory, unexpected exception) writes nothing and the parent reports
``converter_crashed``. Never imports Django.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from .base import EXIT_OUT_OF_MEMORY, EXIT_UNEXPECTED, Limits
from .errors import ConversionError, InvalidInput

#: The child kills its own group this long after the parent's deadline, should the parent hang.
WATCHDOG_GRACE_S = 10.0


def _op_pdf_prepare(**kwargs):
    from .pdfops import pdf_prepare

    return pdf_prepare(**kwargs)


def _op_pdf_page(**kwargs):
    from .pdfops import pdf_page

    return pdf_page(**kwargs)


def _op_image_prepare(**kwargs):
    from .imageops import image_prepare

    return image_prepare(**kwargs)


def _op_image_page(**kwargs):
    from .imageops import image_page

    return image_page(**kwargs)


def _op_office_prepare(**kwargs):
    from .officeops import office_prepare

    return office_prepare(**kwargs)


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
    }


OPS = {
    "pdf_prepare": _op_pdf_prepare,
    "pdf_page": _op_pdf_page,
    "image_prepare": _op_image_prepare,
    "image_page": _op_image_page,
    "office_prepare": _op_office_prepare,
    "probe": _op_probe,
}
PAGE_OPS = frozenset({"pdf_page", "image_page"})


def _set_limits(memory_bytes: int) -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))


def _start_watchdog(*, parent_pid: int, deadline: float) -> None:
    """Kill this whole process group if the worker dies (e.g. SIGKILL) or stops watching us."""

    def watch() -> None:
        while True:
            time.sleep(0.25)
            if os.getppid() != parent_pid or time.monotonic() > deadline:
                os.killpg(0, signal.SIGKILL)

    threading.Thread(target=watch, name="quire-watchdog", daemon=True).start()


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
        record = {"pgid": os.getpgid(0), "pids": [os.getpid(), grandchild.pid]}
        dest = Path(args["dest"])
        (dest.parent / f"fault-hang-{args.get('page')}.json").write_text(json.dumps(record))
        while True:
            time.sleep(3600)


def main(argv: list[str]) -> int:
    request = json.loads(Path(argv[1]).read_text())
    limits = Limits(**request["limits"])
    _set_limits(limits.memory_bytes)
    _start_watchdog(
        parent_pid=request["parent_pid"],
        deadline=time.monotonic() + request["timeout_s"] + WATCHDOG_GRACE_S,
    )
    op, args = request["op"], request["args"]
    try:
        if request.get("fault"):
            _inject_fault(request["fault"], op=op, args=args)
        outcome = {"ok": True, "result": OPS[op](**args, limits=limits)}
    except ConversionError as exc:
        outcome = {"ok": False, "code": exc.code, "detail": exc.detail}
    except MemoryError:
        os._exit(EXIT_OUT_OF_MEMORY)
    result = Path(request["result"])
    partial = result.with_name(result.name + ".tmp")
    partial.write_text(json.dumps(outcome))
    partial.replace(result)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv))
    except MemoryError:
        os._exit(EXIT_OUT_OF_MEMORY)
    except Exception as exc:  # a bug or an unexpected library failure: report as a crash
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        os._exit(EXIT_UNEXPECTED)
