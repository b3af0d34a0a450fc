"""The warm-engine options of ADR 0019, measured on the 5-page DOCX of ``pages.py``.

    .venv/bin/python bench/office_engine_options.py [--runs 5]

Same run, same document (a new salt each time): ``soffice --convert-to pdf`` as a fresh process
with a fresh profile (today's fresh path); a warm ``soffice --accept=pipe,…;urp;`` driven by one
long-lived UNO client under LibreOffice's own Python (``converters/unobridge.py``, the chosen
mechanism), first conversion (engine start included) and warm conversions; and the cost of
starting a UNO client per conversion (``/usr/bin/python3 -c "import uno"``), which a
client-per-conversion design (unoserver's ``unoconvert``) pays on top. No sandbox, no service.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from conversion_jobs.converters import process_group_members
from conversion_jobs.converters.officeengine import bound_sockets, remove_sockets
from tests import testdocs

BRIDGE = Path(__file__).resolve().parent.parent / "conversion_jobs" / "converters" / "unobridge.py"


def docx(root: Path) -> Path:
    text = " ".join(["The quick brown fox jumps over the lazy dog."] * 12)
    salt = uuid.uuid4().hex
    return testdocs.make_docx(
        root / f"{salt}.docx",
        paragraphs=[f"{salt} section {i}. {text}" for i in range(5)],
        page_break_after_each=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="quire-engine-options-"))
    env = {"PATH": os.environ["PATH"], "HOME": str(root), "TMPDIR": str(root), "LANG": "C.UTF-8",
           "SAL_USE_VCLPLUGIN": "svp"}  # fmt: skip
    print(f"load at start: {os.getloadavg()}", flush=True)
    try:
        fresh = []
        for i in range(args.runs):
            source, started = docx(root), time.monotonic()
            subprocess.run(
                ["soffice", "--headless", "--norestore", "--nologo", "--nodefault",
                 "--nolockcheck", f"-env:UserInstallation={(root / f'p{i}').as_uri()}",
                 "--convert-to", "pdf", "--outdir", str(root / "out"), str(source)],
                env=env, capture_output=True, check=True,
            )  # fmt: skip
            fresh.append(time.monotonic() - started)
        pipe = f"quire-bench-{uuid.uuid4().hex}"
        started = time.monotonic()
        office = subprocess.Popen(
            ["soffice", "--headless", "--invisible", "--norestore", "--nologo", "--nodefault",
             "--nolockcheck", f"-env:UserInstallation={(root / 'warm').as_uri()}",
             f"--accept=pipe,name={pipe};urp;"],
            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        client = subprocess.Popen(
            ["/usr/bin/python3", str(BRIDGE), pipe],
            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=False,
        )  # fmt: skip
        assert client.stdin is not None and client.stdout is not None

        def convert() -> float:
            source, begun = docx(root), time.monotonic()
            request = {"op": "convert", "source": str(source), "dest": str(source) + ".pdf"}
            client.stdin.write(json.dumps(request).encode() + b"\n")  # type: ignore[union-attr]
            client.stdin.flush()  # type: ignore[union-attr]
            answer = json.loads(client.stdout.readline())  # type: ignore[union-attr]
            if not answer.get("ok"):
                raise RuntimeError(answer)
            return time.monotonic() - begun

        convert()
        first = time.monotonic() - started
        warm = [convert() for _ in range(args.runs * 2)]
        client.stdin.close()
        client.wait()
        sockets = bound_sockets(process_group_members(office.pid))
        os.killpg(office.pid, signal.SIGKILL)
        office.wait()
        remove_sockets(sockets)  # a killed LibreOffice leaves its sockets in /tmp
        begun = time.monotonic()
        subprocess.run(["/usr/bin/python3", "-c", "import uno"], check=True)
        client_start = time.monotonic() - begun
    finally:
        shutil.rmtree(root, ignore_errors=True)
    alone = statistics.median(fresh)
    print(
        f"fresh soffice --convert-to: {', '.join(f'{t:.2f}' for t in fresh)} s (median {alone:.2f})"
    )
    print(f"warm engine: first conversion incl. start {first:.2f} s; warm "
          f"{', '.join(f'{t:.3f}' for t in warm)} s (median {statistics.median(warm):.3f}, "
          f"ratio {statistics.median(warm) / alone:.3f})")  # fmt: skip
    print(f"a UNO client process per conversion adds at least {client_start:.3f} s (python3 + uno)")
    print(f"load at end: {os.getloadavg()}", flush=True)


if __name__ == "__main__":
    main()
