"""Converter-level page throughput and memory, against a same-run direct pypdfium2 baseline
(issue 4, performance; the whole-service numbers are ``bench/pages.py``).

    .venv/bin/python bench/pages_converter.py [--pages 200] [--rss-pages 300] [--rounds 3]
                                              [--lines 40] [--outputs text,png]

What runs, for each output (``text``; ``png`` at 150 dpi) on one generated ``--pages`` PDF (Letter
pages of ``--lines`` lines of Helvetica text each), ``--rounds`` times, modes interleaved:

* ``direct``: 2 processes, each opens the PDF with pypdfium2 and loops over its half of the pages,
  writing each page to a file as the converter does (text: UTF-8; png: ``page.render(scale=dpi/72)
  .to_pil().save(png)``, Pillow's default compression). Modules are imported before the clock
  starts; opening the document is timed.
* ``converter warm``: 2 processes, each a stand-in for a long-lived worker: it has already
  converted a small document and called ``converters.release`` (which leaves a spare child), then,
  timed, ``prepare`` + ``convert_page`` for each of its pages + ``release`` -- the calls
  ``services/runner.py`` makes, with the same isolation (child in its own process group, RLIMIT_AS,
  scrubbed environment, watchdog, 100 ms stop polling).
* ``converter cold``: the same with no earlier document (the child is spawned on the clock).

All processes are started and have imported before a common start signal; pages/s = pages /
(last finish - first start). The ratio is converter / direct (median of the rounds). CPU ms/page
counts the processes and their reaped children (the converter child, including the start-up of
the spare it was) from the start signal on; its ratio (direct / converter) is the efficiency of the
converter and, unlike pages/s, does not depend on what else the machine is doing.

Memory: one process converts a ``--rss-pages`` PDF to PNG at 150 dpi through the converter; peak
RSS (``ru_maxrss``) of that worker process and of its converter children.

Nothing here is imported by the product or the tests. The machine is shared: run it on a quiet
machine for publishable numbers; the ratio is what the same-run baseline protects.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PDF = "application/pdf"
DPI = 150


def page_text(lines: int):
    def text_of(n: int) -> str:
        return "\n".join(
            f"Page {n} line {i}: the quick brown fox jumps over the lazy dog {n * i}"
            for i in range(1, lines + 1)
        )

    return text_of


# -- worker side ----------------------------------------------------------------------------------


def _cpu_s() -> float:
    """CPU of this process and of its reaped children (the converter children)."""
    return sum(
        usage.ru_utime + usage.ru_stime
        for usage in (
            resource.getrusage(resource.RUSAGE_SELF),
            resource.getrusage(resource.RUSAGE_CHILDREN),
        )
    )


def _wait_for_go() -> float:
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        raise SystemExit("no start signal")
    return _cpu_s()


def _report(start: float, end: float, pages: int, cpu_before: float) -> None:
    self_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    print(
        json.dumps(
            {
                "start": start,
                "end": end,
                "pages": pages,
                "cpu_s": _cpu_s() - cpu_before,
                "maxrss_self_kb": self_kb,
                "maxrss_children_kb": children_kb,
            }
        ),
        flush=True,
    )


def worker_direct(*, source: Path, output: str, first: int, last: int, out: Path) -> None:
    import pypdfium2 as pdfium

    cpu = _wait_for_go()
    start = time.time()
    doc = pdfium.PdfDocument(str(source))
    for number in range(first, last + 1):
        page = doc[number - 1]
        if output == "text":
            textpage = page.get_textpage()
            (out / f"page-{number:04d}.txt").write_text(textpage.get_text_range(), "utf-8")
            textpage.close()
        else:
            image = page.render(scale=DPI / 72).to_pil()
            image.save(out / f"page-{number:04d}.png", format="PNG")
        page.close()
    doc.close()
    _report(start, time.time(), last - first + 1, cpu)


def worker_converter(
    *, source: Path, output: str, first: int, last: int, out: Path, warm: bool
) -> None:
    from conversion_jobs import converters
    from conversion_jobs.converters import Limits, PageRequest, PrepareRequest, converter_for
    from tests import testdocs

    limits = Limits()
    stop = threading.Event()
    converter = converter_for(PDF, output)

    def convert(document: Path, pages: range, workdir: Path) -> None:
        prepared = converter.prepare(
            PrepareRequest(
                source=document,
                media_type=PDF,
                workdir=workdir,
                limits=limits,
                should_stop=stop.is_set,
            )
        )
        request = PageRequest(
            prepared=prepared,
            output=output,
            options={"dpi": DPI},
            dest_dir=workdir,
            limits=limits,
            should_stop=stop.is_set,
        )
        try:
            for number in pages:
                artifact = converter.convert_page(request, page=number)
                assert artifact.path.is_file()
        finally:
            converters.release(prepared)

    if warm:  # a worker that has done a job before: its release left a spare child
        earlier = out / "earlier"
        earlier.mkdir()
        convert(testdocs.make_pdf(earlier / "earlier.pdf", pages=2), range(1, 3), earlier)
        deadline = time.monotonic() + 10
        while not _spare_ready() and time.monotonic() < deadline:
            time.sleep(0.05)
    cpu = _wait_for_go()
    start = time.time()
    convert(source, range(first, last + 1), out)
    _report(start, time.time(), last - first + 1, cpu)


def _spare_ready() -> bool:
    """The spare child has finished importing (it then waits on its stdin)."""
    from conversion_jobs.converters import sessions

    spare = sessions._spare
    if spare is None:
        return False
    try:
        wchan = Path(f"/proc/{spare.proc.pid}/wchan").read_text()
        syscall = Path(f"/proc/{spare.proc.pid}/syscall").read_text().split()[0]
    except OSError:
        return False
    return syscall == "0" or "pipe" in wchan  # blocked in read(0, ...)


# -- driver ---------------------------------------------------------------------------------------


def _spawn(args: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, __file__, "--worker", *args],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def run_pair(mode: str, *, source: Path, output: str, pages: int, scratch: Path) -> dict:
    """Two processes over the two halves of ``source``; returns pages/s and their reports."""
    half = pages // 2
    procs = []
    for index, (first, last) in enumerate([(1, half), (half + 1, pages)]):
        out = scratch / f"{mode}-{output}-{index}"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        procs.append(_spawn([mode, str(source), output, str(first), str(last), str(out)]))
    for proc in procs:
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"{mode} worker failed to start")
    for proc in procs:
        proc.stdin.write("go\n")
        proc.stdin.flush()
    reports = []
    for proc in procs:
        line = proc.stdout.readline()
        proc.wait()
        if proc.returncode != 0 or not line:
            raise RuntimeError(f"{mode} worker failed ({proc.returncode})")
        reports.append(json.loads(line))
    elapsed = max(r["end"] for r in reports) - min(r["start"] for r in reports)
    done = sum(r["pages"] for r in reports)
    produced = sum(len(list((scratch / f"{mode}-{output}-{i}").glob("page-*"))) for i in (0, 1))
    if produced != pages:
        raise RuntimeError(f"{mode}: {produced} page files for {pages} pages")
    cpu_ms = 1000 * sum(r["cpu_s"] for r in reports) / done
    return {"pages_s": done / elapsed, "cpu_ms": cpu_ms, "reports": reports}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pages", type=int, default=200)
    parser.add_argument("--rss-pages", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--lines", type=int, default=40)
    parser.add_argument("--outputs", default="text,png")
    parser.add_argument("--modes", default="direct,warm,cold")
    parser.add_argument("--worker", nargs=6, metavar="ARG")
    args = parser.parse_args()

    if args.worker:
        mode, source, output, first, last, out = args.worker
        common = {
            "source": Path(source),
            "output": output,
            "first": int(first),
            "last": int(last),
            "out": Path(out),
        }
        if mode == "direct":
            worker_direct(**common)
        else:
            worker_converter(**common, warm=mode == "warm")
        return

    from tests import testdocs

    scratch = Path(tempfile.mkdtemp(prefix="quire-bench-pages-"))
    try:
        source = testdocs.make_pdf(
            scratch / "doc.pdf", pages=args.pages, text_of=page_text(args.lines)
        )
        load = os.getloadavg()[0]
        size_kib = source.stat().st_size // 1024
        print(f"{args.pages}-page PDF ({size_kib} KiB, {args.lines} lines/page)")
        print(f"2 processes per mode, {args.rounds} rounds, load average {load:.1f}")
        modes = args.modes.split(",")
        for output in args.outputs.split(","):
            speed: dict[str, list[float]] = {mode: [] for mode in modes}
            cost: dict[str, list[float]] = {mode: [] for mode in modes}
            for _ in range(args.rounds):
                for mode in modes:
                    r = run_pair(
                        mode, source=source, output=output, pages=args.pages, scratch=scratch
                    )
                    speed[mode].append(r["pages_s"])
                    cost[mode].append(r["cpu_ms"])
            label = "text" if output == "text" else f"png@{DPI}dpi"
            for mode in modes:
                pages_s, cpu_ms = statistics.median(speed[mode]), statistics.median(cost[mode])
                rounds = " ".join(f"{v:.1f}" for v in speed[mode])
                ratios = ""
                if "direct" in speed and mode != "direct":
                    ratios = (
                        f"  ratio {pages_s / statistics.median(speed['direct']):.3f}"
                        f" (CPU ratio {statistics.median(cost['direct']) / cpu_ms:.3f})"
                    )
                print(
                    f"  {label:<11} {mode:<7} {pages_s:8.1f} pages/s  {cpu_ms:7.2f} CPU ms/page"
                    f"  (rounds: {rounds}){ratios}"
                )

        if args.rss_pages:
            rss_doc = testdocs.make_pdf(
                scratch / "rss.pdf", pages=args.rss_pages, text_of=page_text(args.lines)
            )
            out = scratch / "rss"
            out.mkdir()
            proc = _spawn(["cold", str(rss_doc), "png", "1", str(args.rss_pages), str(out)])
            assert proc.stdout.readline().strip() == "ready"
            proc.stdin.write("go\n")
            proc.stdin.flush()
            report = json.loads(proc.stdout.readline())
            proc.wait()
            worker_mb = report["maxrss_self_kb"] / 1024
            child_mb = report["maxrss_children_kb"] / 1024
            pages_s = report["pages"] / (report["end"] - report["start"])
            print(
                f"  peak RSS, {args.rss_pages}-page PDF -> png@{DPI}dpi in one worker: "
                f"worker process {worker_mb:.0f} MB, converter child {child_mb:.0f} MB, "
                f"sum {worker_mb + child_mb:.0f} MB ({pages_s:.1f} pages/s)"
            )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
