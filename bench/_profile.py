"""py-spy every process of a benchmark phase (``--profile DIR`` of bench/throughput.py).

``Profiler.attach(name, pid)`` starts ``py-spy record`` (non-blocking sampling, raw collapsed
stacks: one ``frame;frame;… count`` line per distinct stack, which speedscope and
``flamegraph.pl`` read as they are) on ``pid`` and its subprocesses (the worker's pool processes,
its fork server and converter children). ``stop()`` ends the recorders (SIGINT: py-spy writes its
file) and writes ``DIR/<name>.top.txt``: the busiest frames by inclusive and by self samples, the
stacks' processes summed, the sampler's idle stacks left out. py-spy cannot tell idle threads
of processes in another pid namespace (the sandboxed converter children): their waits count as
busy. ``BENCH_PROFILE_GIL=1`` samples only threads holding the GIL (≈ Python CPU time).
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
from pathlib import Path

PY_SPY = Path(__file__).resolve().parents[1] / ".venv" / "bin" / "py-spy"
RATE = 200


def _py_spy() -> str:
    for candidate in (PY_SPY, Path("/work/main/.venv/bin/py-spy")):
        if candidate.exists():
            return str(candidate)
    return "py-spy"


def _frame_name(frame: str) -> str:
    """``func (path/to/file.py:123)`` -> ``func (file.py)``: lines of one function summed."""
    name, _, where = frame.partition(" (")
    where = where.rstrip(")")
    path = where.rsplit(":", 1)[0]
    short = "/".join(path.split("/")[-2:])
    return f"{name} ({short})" if path else name


def summarize(raw: Path, *, top: int = 40) -> str:
    """Inclusive and self samples per function of a raw collapsed-stack file."""
    inclusive: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [_frame_name(f) for f in stack.split(";") if f]
        # py-spy puts "process <pid>:"<cmd>"" / "thread (0x…)" pseudo-frames first.
        frames = [f for f in frames if not f.startswith(("process ", "thread "))]
        if not frames:
            continue
        total += count
        for name in set(frames):
            inclusive[name] += count
        own[frames[-1]] += count
    lines = [f"{raw.name}: {total} busy samples at {RATE}/s (≈ {total / RATE:.2f} CPU-s)", ""]
    lines.append("inclusive  %    function")
    for name, count in inclusive.most_common(top):
        lines.append(f"{count:9d} {100 * count / max(total, 1):5.1f}  {name}")
    lines += ["", "self       %    function"]
    for name, count in own.most_common(top):
        lines.append(f"{count:9d} {100 * count / max(total, 1):5.1f}  {name}")
    return "\n".join(lines) + "\n"


class Profiler:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self._recorders: list[tuple[str, subprocess.Popen[bytes]]] = []

    def attach(self, name: str, pid: int) -> None:
        out = self.directory / f"{name}.raw.txt"
        with open(self.directory / f"{name}.py-spy.log", "wb") as log:
            popen = subprocess.Popen(
                [
                    _py_spy(),
                    "record",
                    "--nonblocking",
                    "--subprocesses",
                    *(["--gil"] if os.environ.get("BENCH_PROFILE_GIL") == "1" else []),
                    "-r",
                    str(RATE),
                    "-f",
                    "raw",
                    "-o",
                    str(out),
                    "--pid",
                    str(pid),
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self._recorders.append((name, popen))

    def stop(self) -> list[Path]:
        """End the recorders and write the summaries; returns the summary files."""
        for _name, popen in self._recorders:
            if popen.poll() is None:
                os.kill(popen.pid, signal.SIGINT)
        written = []
        for name, popen in self._recorders:
            try:
                popen.wait(timeout=60)
            except subprocess.TimeoutExpired:
                popen.kill()
                popen.wait()
            raw = self.directory / f"{name}.raw.txt"
            if raw.exists():
                summary = self.directory / f"{name}.top.txt"
                summary.write_text(summarize(raw))
                written.append(summary)
        self._recorders.clear()
        return written


if __name__ == "__main__":
    import sys

    for arg in sys.argv[1:]:
        print(summarize(Path(arg)))
