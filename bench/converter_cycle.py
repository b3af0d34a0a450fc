"""The converter layer's cost per one-page attempt, without Celery, Postgres or RabbitMQ.

    .venv/bin/python bench/converter_cycle.py [--n 300] [--reuse attempt|tenant] [--sandbox on|off]

Runs ``--n`` one-page PDF -> text attempts in this process the way the runner drives the
converter layer (``begin_attempt``, ``prepare`` with the first pages, one ``convert_page``
with the inline text limit, ``release(spare=False)``, the work directory emptied for the next
attempt (``--workdir new``: removed), ``warm()``;
synchronously: the runner does the last two on its tidying thread), after 20 unmeasured
ones. Prints per attempt: wall time, CPU of this process (the worker's side), CPU of the fork
server and every child it forked and reaped (the *zygote tree*: ``/proc/<zygote>/stat`` utime +
stime + cutime + cstime) and the zygote tree's minor page faults (own + reaped children's;
copy-on-write faults after ``fork()`` are most of them). Page faults do not depend on the
machine's load; CPU does: compare runs back to back (ADR 0017, session 5).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _zygote_stat(pid: int) -> tuple[float, int]:
    """(CPU seconds incl. reaped children, minor faults incl. reaped children) of ``pid``."""
    with open(f"/proc/{pid}/stat") as fh:
        stat = fh.read()
    fields = stat[stat.rfind(")") + 2 :].split()
    cpu = sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")
    return cpu, int(fields[7]) + int(fields[8])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=300)
    parser.add_argument("--reuse", choices=("attempt", "tenant"), default="attempt")
    parser.add_argument("--sandbox", choices=("on", "off"), default="on")
    parser.add_argument(
        "--workdir",
        choices=("reuse", "new"),
        default="reuse",
        help="reuse: the last attempt's emptied work dir renamed, as the runner does since "
        "session 7; new: a directory made and removed per attempt (before)",
    )
    args = parser.parse_args()

    from conversion_jobs import converters
    from conversion_jobs.converters import (
        Limits,
        PageRequest,
        PrepareRequest,
        sandbox,
        sessions,
        zygote,
    )
    from conversion_jobs.converters.isolation import empty_directory
    from tests.testdocs import pdf_bytes

    os.environ[sandbox.MODE_ENV] = args.sandbox
    scratch = Path(tempfile.mkdtemp(prefix="quire-bench-cycle-"))
    sandbox.configure(work_dir=scratch / "work")
    converters.configure_reuse(converters.ReuseSettings(mode=args.reuse))
    converter = converters.converter_for("application/pdf", "text")
    document = pdf_bytes(pages=1, text_of=lambda n: "one page of text")
    limits = Limits()
    # As the runner's first run: the prepare carries the first pages (ADR 0017, session 6).
    first = converters.FirstPages(pages=tuple(range(1, 33)), output="text", inline_max_bytes=65536)

    emptied: list[Path] = []

    def attempt(i: int) -> None:
        workdir = scratch / f"attempt-{i}"
        if emptied:  # as runner._workdir_make
            os.rename(emptied.pop(), workdir)
            os.utime(workdir)
        else:
            workdir.mkdir(mode=0o700)
        source = workdir / "source"
        source.write_bytes(document)
        converters.begin_attempt(tenant="bench-tenant")
        prepared = converter.prepare(
            PrepareRequest(
                source=source,
                media_type="application/pdf",
                workdir=workdir,
                limits=limits,
                should_stop=lambda: False,
                options={},
                first=first,
            )
        )
        page = converter.convert_page(
            PageRequest(
                prepared=prepared,
                output="text",
                options={},
                dest_dir=workdir,
                limits=limits,
                should_stop=lambda: False,
                inline_max_bytes=65536,
            ),
            page=1,
        )
        if page.content != b"one page of text":
            raise AssertionError(page)
        converters.release(spare=False)
        converters.begin_attempt(tenant=None)
        if args.workdir == "reuse" and empty_directory(workdir):  # as runner._tidy
            emptied.append(workdir)
        else:
            shutil.rmtree(workdir)
        converters.warm()

    try:
        for i in range(20):
            attempt(i)
        server = zygote.current_zygote()
        if server is None:
            raise RuntimeError("no fork server")
        load = os.getloadavg()[0]
        own0 = resource.getrusage(resource.RUSAGE_SELF)
        tree0, faults0 = _zygote_stat(server.pid)
        start = time.perf_counter()
        for i in range(20, 20 + args.n):
            attempt(i)
        wall = time.perf_counter() - start
        own1 = resource.getrusage(resource.RUSAGE_SELF)
        tree1, faults1 = _zygote_stat(server.pid)
    finally:
        sessions.release_all()
        shutil.rmtree(scratch, ignore_errors=True)
    n = args.n
    own = (own1.ru_utime + own1.ru_stime - own0.ru_utime - own0.ru_stime) * 1000 / n
    tree = (tree1 - tree0) * 1000 / n
    print(
        f"converter cycle: reuse {args.reuse}, sandbox {args.sandbox}, n={n}: "
        f"wall {wall * 1000 / n:.2f} ms/attempt; CPU worker side {own:.2f} + zygote tree "
        f"{tree:.2f} = {own + tree:.2f} ms/attempt; zygote tree page faults "
        f"{(faults1 - faults0) / n:.0f}/attempt; load average {load:.2f} -> "
        f"{os.getloadavg()[0]:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
