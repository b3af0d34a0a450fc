"""LibreOffice headless conversion to PDF, run inside the isolated child.

soffice inherits the child's process group and memory limit, so the worker's kill of the group
(timeout, cancellation, lost lease) takes LibreOffice's forks with it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from .base import DOC, DOCX, ODT, PPTX, RTF, XLSX, Limits
from .errors import ConverterCrashed, InvalidInput
from .pdfops import pdf_prepare

_EXTENSIONS = {DOCX: ".docx", PPTX: ".pptx", XLSX: ".xlsx", ODT: ".odt", DOC: ".doc", RTF: ".rtf"}


def office_prepare(*, path: str, media_type: str, base: str, limits: Limits) -> dict:
    """Convert to PDF in ``base`` (a fresh directory) with a private LibreOffice profile."""
    root = Path(base)
    inbox, outdir, profile, home = (root / name for name in ("in", "out", "profile", "home"))
    for directory in (inbox, outdir, profile, home):
        directory.mkdir(parents=True, exist_ok=True)
    # LibreOffice picks its import filter partly by extension; the name is ours, never the client's.
    source = inbox / ("document" + _EXTENSIONS[media_type])
    shutil.copyfile(path, source)
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
    done = subprocess.run(  # noqa: S603
        argv, env=env, cwd=root, stdin=subprocess.DEVNULL, capture_output=True, check=False
    )
    if done.returncode < 0:
        raise ConverterCrashed(f"LibreOffice killed by signal {-done.returncode}")
    result = outdir / "document.pdf"
    if not result.is_file() or result.stat().st_size == 0:
        tail = done.stderr.decode("utf-8", "replace").strip().splitlines()[-1:]
        raise InvalidInput(
            f"LibreOffice could not convert the document (status {done.returncode}) "
            + " ".join(tail)
        )
    shutil.rmtree(profile, ignore_errors=True)
    shutil.rmtree(inbox, ignore_errors=True)
    info = pdf_prepare(path=str(result), limits=limits)
    return {"document": str(result), "page_count": info["page_count"]}
