"""LibreOffice headless conversion to PDF, run inside the isolated child.

soffice inherits the child's process group and memory limit, so the worker's kill of the group
(timeout, cancellation, lost lease) takes LibreOffice's forks with it.
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import time
from pathlib import Path

from .base import DOC, DOCX, ODT, PPTX, RTF, XLSX, Limits
from .errors import ConversionError, ConverterCrashed, InvalidInput
from .pdfops import pdf_prepare, pdf_require_text

_EXTENSIONS = {DOCX: ".docx", PPTX: ".pptx", XLSX: ".xlsx", ODT: ".odt", DOC: ".doc", RTF: ".rtf"}

#: (configuration path, property, value) written into every per-call profile: defence in depth
#: behind the sandbox (ADR 0013). A document's links to files or URLs (linked images, OLE and
#: DDE links, sections) are neither loaded nor updated, and no macro runs.
#: * BlockUntrustedRefererLinks: no external resource is loaded on behalf of a document that is
#:   not in a trusted location (none is configured): linked images in DOCX (``r:link``) and ODT
#:   (``draw:image xlink:href``) stay empty.
#: * Writer/Calc Update/Link = never (Writer 0 = never; Calc 1 = never).
#: * Macros: security level "very high" (3) and execution disabled.
#: LibreOffice 7.4's RTF import still reads an ``INCLUDEPICTURE`` target itself; only the sandbox
#: stops that one (tests/integration/converters/test_conv_sandbox.py covers both layers).
PROFILE_SETTINGS = (
    ("/org.openoffice.Office.Common/Security/Scripting", "BlockUntrustedRefererLinks", "true"),
    ("/org.openoffice.Office.Common/Security/Scripting", "MacroSecurityLevel", "3"),
    ("/org.openoffice.Office.Common/Security/Scripting", "DisableMacrosExecution", "true"),
    ("/org.openoffice.Office.Writer/Content/Update", "Link", "0"),
    ("/org.openoffice.Office.Calc/Content/Update", "Link", "1"),
    ("/org.openoffice.Office.Common/Misc", "FirstRun", "false"),
)


def write_profile(profile: Path) -> None:
    """A fresh LibreOffice user profile holding ``PROFILE_SETTINGS``."""
    items = "".join(
        f'<item oor:path="{path}"><prop oor:name="{name}" oor:op="fuse">'
        f"<value>{value}</value></prop></item>\n"
        for path, name, value in PROFILE_SETTINGS
    )
    user = profile / "user"
    user.mkdir(parents=True, exist_ok=True)
    (user / "registrymodifications.xcu").write_text(
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        '<oor:items xmlns:oor="http://openoffice.org/2001/registry"'
        ' xmlns:xs="http://www.w3.org/2001/XMLSchema"'
        ' xmlns:xsi="http://www.w3.org/2001/XMLSchema-instance">\n'
        f"{items}</oor:items>\n"
    )


#: A document LibreOffice did not load while its address space came within this share of the
#: child's RLIMIT_AS did not load for want of memory (``load_failure``).
NEAR_MEMORY_LIMIT = 0.9


def vm_peak(pid: int) -> int:
    """The peak virtual memory of ``pid`` in bytes (``VmPeak``), 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/status", "rb") as fh:
            for line in fh:
                if line.startswith(b"VmPeak:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def descendants(pid: int) -> list[int]:
    """``pid``'s live descendants (``/proc/<pid>/task/*/children``), children first."""
    found, queue = [], [pid]
    while queue:
        parent = queue.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{parent}/task/{task}/children") as fh:
                    children = [int(child) for child in fh.read().split()]
            except (OSError, ValueError):
                continue
            found.extend(children)
            queue.extend(children)
    return found


def load_failure(detail: str, *, peak_bytes: int) -> ConversionError:
    """The error for a document LibreOffice did not load. Under the child's RLIMIT_AS an
    allocation that fails while a document loads is sometimes caught and reported as "could not
    be loaded" rather than as an abort. So a failed load whose LibreOffice came within
    ``NEAR_MEMORY_LIMIT`` of the limit (``peak_bytes``, its largest address space) is a crash,
    retryable, like pdfium past the limit; otherwise the document is at fault. (Measured: a
    DOCX that loads at 400 MB fails at 380 MB with a peak of 379 MB; a corrupt DOCX fails at
    1.5 GB with a peak of 476 MB.)"""
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    if limit != resource.RLIM_INFINITY and peak_bytes >= NEAR_MEMORY_LIMIT * limit:
        return ConverterCrashed("LibreOffice ran out of memory loading the document")
    return InvalidInput(detail)


def office_prepare(
    *, path: str, media_type: str, base: str, limits: Limits, has_text: bool = False
) -> dict:
    """Convert to PDF in ``base`` (a fresh directory) with a private LibreOffice profile.
    ``has_text``: the document has text (``office_scan``), so its PDF must have some."""
    root = Path(base)
    inbox, outdir, profile, home = (root / name for name in ("in", "out", "profile", "home"))
    for directory in (inbox, outdir, profile, home):
        directory.mkdir(parents=True, exist_ok=True)
    # LibreOffice picks its import filter partly by extension; the name is ours, never the client's.
    source = inbox / ("document" + _EXTENSIONS[media_type])
    shutil.copyfile(path, source)
    write_profile(profile)
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "TMPDIR": str(home),
        "LANG": "C.UTF-8",
        "SAL_USE_VCLPLUGIN": "svp",
    }
    argv = [
        "soffice",
        "--headless",
        "--norestore",
        "--nologo",
        "--nodefault",
        "--nolockcheck",
        f"-env:UserInstallation={profile.resolve().as_uri()}",
        "--convert-to",
        "pdf",
        "--outdir",
        str(outdir),
        str(source),
    ]
    # Run, noting the largest address space of soffice's processes (sampled every 20 ms: it
    # only grows, and tells a load that failed for want of memory from a faulty document).
    with (root / "soffice.err").open("w+b") as err:
        running = subprocess.Popen(  # noqa: S603
            argv, env=env, cwd=root, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err
        )
        peak = 0
        while running.poll() is None:
            peak = max([peak, *(vm_peak(pid) for pid in descendants(running.pid))])
            time.sleep(0.02)
        err.seek(0)
        stderr = err.read()
    done = subprocess.CompletedProcess(argv, running.returncode, b"", stderr)
    if done.returncode < 0:
        raise ConverterCrashed(f"LibreOffice killed by signal {-done.returncode}")
    result = outdir / "document.pdf"
    if not result.is_file() or result.stat().st_size == 0:
        # soffice is a shell script: soffice.bin dying by a signal (SIGABRT when an allocation
        # fails under the child's RLIMIT_AS, SIGKILL, SIGSEGV) comes back as 128 + the signal.
        # Like pdfium past the memory limit, that is a crash, not a fault of the input. (Checked
        # only when no PDF was stored: a soffice.bin that died after storing it converted.)
        if 128 < done.returncode < 128 + 65:
            raise ConverterCrashed(f"LibreOffice killed by signal {done.returncode - 128}")
        tail = done.stderr.decode("utf-8", "replace").strip().splitlines()[-1:]
        raise load_failure(
            f"LibreOffice could not convert the document (status {done.returncode}) "
            + " ".join(tail),
            peak_bytes=peak,
        )
    shutil.rmtree(profile, ignore_errors=True)
    shutil.rmtree(inbox, ignore_errors=True)
    info = pdf_prepare(path=str(result), limits=limits)
    if has_text:
        pdf_require_text(path=str(result))
    return {"document": str(result), "page_count": info["page_count"]}
