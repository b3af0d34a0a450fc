"""The warm LibreOffice engine, inside its host child (ADR 0019).

The engine host is a converter child (forked by the worker's fork server, its own session and
process group, its watchdog, its limits) that lives across attempts. On its first conversion it
starts, in its own process group:

* ``soffice --headless --accept=pipe,name=<random>;urp;`` with a private profile in the host's
  private directory, seeded so that it keeps no recent-documents list, no thumbnails, no
  autosave or backup copies (``_PROFILE_SETTINGS``), and ``TMPDIR`` in that directory;
* the UNO client (``unobridge.py``) under LibreOffice's own Python (``/usr/bin/python3`` with
  ``python3-uno``), spoken to with JSON lines over a pipe. The UNO connection itself is a Unix
  socket (LibreOffice's ``pipe`` transport), so an engine needs no network, not even loopback.

Each conversion copies the source to ``in/document.<ext>`` (a name of ours, never the client's),
has the engine store ``out/document.pdf``, moves that PDF into the attempt's directory and
removes ``in`` and ``out``; whatever LibreOffice left in its temporary directory is removed
too. So nothing of one attempt is left for the next: the worker recycles the host (kills its
whole group) after N conversions, after any failure, timeout or cancellation, and above a
memory mark (``engine_rss``, reported with every result).
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path
from typing import IO

from .base import DOC, DOCX, ODT, PPTX, RTF, XLSX, Limits, process_group_members
from .errors import (
    ConverterCrashed,
    EncryptedInput,
    InvalidPassword,
    error_from_code,
)
from .officeops import PROFILE_SETTINGS, descendants, load_failure, vm_peak
from .pdfops import pdf_prepare, pdf_require_text

_EXTENSIONS = {DOCX: ".docx", PPTX: ".pptx", XLSX: ".xlsx", ODT: ".odt", DOC: ".doc", RTF: ".rtf"}
BRIDGE = Path(__file__).with_name("unobridge.py")
#: LibreOffice's own Python, the one python3-uno is built for.
UNO_PYTHON = "/usr/bin/python3"

#: Profile settings written before the engine's first start: those of every LibreOffice profile
#: (officeops: no links followed, no macros) and, because this profile outlives a conversion,
#: none that keeps document data (history, thumbnails, autosave/backup/recovery copies).
_PROFILE_SETTINGS = (
    *PROFILE_SETTINGS,
    ("/org.openoffice.Office.Common/History", "PickListSize", "0"),
    ("/org.openoffice.Office.Common/History", "RecentDocsThumbnail", "false"),
    ("/org.openoffice.Office.Common/Save/Document", "AutoSave", "false"),
    ("/org.openoffice.Office.Common/Save/Document", "CreateBackup", "false"),
    ("/org.openoffice.Office.Recovery/AutoSave", "Enabled", "false"),
    ("/org.openoffice.Office.Recovery/RecoveryInfo", "Enabled", "false"),
    ("/org.openoffice.Office.Common/Misc", "ShowTipOfTheDay", "false"),
)


def _seed_profile(profile: Path) -> None:
    user = profile / "user"
    user.mkdir(parents=True, exist_ok=True)
    items = "\n".join(
        f'<item oor:path="{path}"><prop oor:name="{name}" oor:op="fuse">'
        f"<value>{value}</value></prop></item>"
        for path, name, value in _PROFILE_SETTINGS
    )
    (user / "registrymodifications.xcu").write_text(
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        '<oor:items xmlns:oor="http://openoffice.org/2001/registry" '
        'xmlns:xs="http://www.w3.org/2001/XMLSchema" '
        'xmlns:xsi="http://www.w3.org/2001/XMLSchema-instance">\n'
        f"{items}\n</oor:items>\n"
    )


class _Engine:
    """soffice and its UNO client, both in this host's process group."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.profile, self.tmp = root / "profile", root / "tmp"
        for directory in (self.profile, self.tmp):
            directory.mkdir(parents=True, exist_ok=True)
        _seed_profile(self.profile)
        pipe = f"quire-{uuid.uuid4().hex}"
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(self.tmp),
            "TMPDIR": str(self.tmp),
            "LANG": "C.UTF-8",
            "SAL_USE_VCLPLUGIN": "svp",
        }
        argv = [
            "soffice",
            "--headless",
            "--invisible",
            "--norestore",
            "--nologo",
            "--nodefault",
            "--nolockcheck",
            "--nofirststartwizard",
            f"-env:UserInstallation={self.profile.resolve().as_uri()}",
            f"--accept=pipe,name={pipe};urp;",
        ]
        self.soffice = subprocess.Popen(  # noqa: S603
            argv,
            env=env,
            cwd=root,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.bridge = subprocess.Popen(  # noqa: S603
            [UNO_PYTHON, str(BRIDGE), pipe],
            env=env,
            cwd=root,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        self.started = time.monotonic()
        self._lingering = set(os.listdir(self.tmp))
        self.sockets: list[str] = []

    def wait_connected(self) -> None:
        """Return once the UNO client is connected (it answers a ping only then). soffice
        ending first (it cannot start under the host's memory limit, say) is a crash, seen at
        once rather than after the client's connect timeout."""
        self._send({"op": "ping"})
        while self.bridge.stdout and not select.select([self.bridge.stdout], [], [], 0.1)[0]:
            if self.soffice.poll() is not None:
                raise ConverterCrashed(
                    f"LibreOffice ended (status {self.soffice.returncode}) before it accepted"
                    " a connection"
                )
        self._receive()

    def call(self, request: dict) -> dict:
        self._send(request)
        return self._receive()

    def _send(self, request: dict) -> None:
        stdin: IO[bytes] | None = self.bridge.stdin
        if stdin is None or self.bridge.poll() is not None:
            raise ConverterCrashed("the LibreOffice engine's client is gone")
        try:
            stdin.write(json.dumps(request).encode() + b"\n")
            stdin.flush()
        except BrokenPipeError:
            raise ConverterCrashed("the LibreOffice engine's client is gone") from None

    def _receive(self) -> dict:
        stdout: IO[bytes] | None = self.bridge.stdout
        line = stdout.readline() if stdout is not None else b""
        if not line:
            raise ConverterCrashed("the LibreOffice engine ended during a conversion")
        return json.loads(line)

    def scrub_tmp(self) -> None:
        """Remove what a conversion left in LibreOffice's temporary directory (its own per-process
        directory, made at start, stays; its contents are a document's temporary files)."""
        for entry in self.tmp.iterdir():
            if entry.name in self._lingering:
                continue
            if entry.is_dir() and entry.name.startswith("lu") and entry.name.endswith(".tmp"):
                self._lingering.add(entry.name)  # the engine's own; empty it
                for inner in entry.iterdir():
                    _remove(inner)
                continue
            _remove(entry)

    def rss_bytes(self) -> int:
        """Resident memory of the engine (soffice's processes and the client)."""
        total = 0
        for pid in _group_pids():
            if pid == os.getpid():
                continue
            try:
                with open(f"/proc/{pid}/statm") as fh:
                    total += int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            except (OSError, ValueError, IndexError):
                continue
        return total


#: Where LibreOffice's ``pipe`` transport binds its Unix sockets (osl: fixed paths, not TMPDIR).
_OSL_PIPE_DIRS = ("/tmp/OSL_PIPE_", "/var/tmp/OSL_PIPE_")  # noqa: S108


def bound_sockets(pids: list[int]) -> list[str]:
    """Paths of the LibreOffice pipe sockets that processes ``pids`` hold open. A killed soffice
    cannot remove them, so whoever kills the engine removes these (``remove_sockets``)."""
    by_inode: dict[str, str] = {}
    try:
        with open("/proc/net/unix") as fh:
            next(fh, None)
            for row in fh:
                fields = row.split()
                if len(fields) >= 8 and fields[7].startswith(_OSL_PIPE_DIRS):
                    by_inode[fields[6]] = fields[7]
    except OSError:
        return []
    paths = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:[") and target[8:-1] in by_inode:
                paths.add(by_inode[target[8:-1]])
    return sorted(paths)


def remove_sockets(paths: list[str]) -> None:
    """Remove LibreOffice pipe sockets (only files named ``OSL_PIPE_*``)."""
    for path in paths:
        if Path(path).name.startswith("OSL_PIPE_"):
            try:
                os.unlink(path)
            except OSError:
                pass


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _group_pids() -> list[int]:
    return process_group_members(os.getpgid(0))


_engine: _Engine | None = None


def _start() -> _Engine:
    """This host's engine, started in its private directory (the cwd) if it is not running:
    returns once LibreOffice accepts UNO calls, with its sockets noted."""
    global _engine
    if _engine is None:
        engine = _Engine(Path.cwd() / "engine")
        engine.wait_connected()
        engine.sockets = bound_sockets(_group_pids())
        _engine = engine
    return _engine


def office_engine_start(*, limits: Limits) -> dict:
    """Start the engine now; its sockets are what the worker removes after killing the host."""
    return {"engine_sockets": _start().sockets}


def office_engine_convert(
    *,
    path: str,
    media_type: str,
    base: str,
    limits: Limits,
    password: str | None = None,
    encrypted: bool | None = None,
    fault: dict | None = None,
    has_text: bool = False,
) -> dict:
    """Convert ``path`` to ``base``/document.pdf with this host's warm engine (started on first
    use in the host's private directory, the cwd). Returns the PDF's path and page count, the
    engine's memory and whether this call started it. ``has_text``: the document has text
    (``office_scan``), so its PDF must have some."""
    started = _engine is None
    engine = _start()
    inbox, outbox = engine.root / "in", engine.root / "out"
    for directory in (inbox, outbox):
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir()
    source = inbox / ("document" + _EXTENSIONS[media_type])
    shutil.copyfile(path, source)
    produced = outbox / "document.pdf"
    if fault and fault.get("kind") == "hang":
        # Test only: LibreOffice stops answering mid-conversion (the worker's deadline kills the
        # whole group, SIGKILL ends stopped processes too).
        for pid in _group_pids():
            if pid not in (os.getpid(), engine.bridge.pid):
                os.kill(pid, signal.SIGSTOP)
    password_given = password is not None
    try:
        answer = engine.call(
            {"op": "convert", "source": str(source), "dest": str(produced), "password": password}
        )
    finally:
        password = None
        shutil.rmtree(inbox, ignore_errors=True)
    try:
        if not answer.get("ok"):
            raise _load_error(
                answer,
                password_given=password_given,
                encrypted=encrypted,
                peak_bytes=max(
                    (vm_peak(pid) for pid in descendants(engine.soffice.pid)), default=0
                ),
            )
        if not produced.is_file() or produced.stat().st_size == 0:
            raise error_from_code("invalid_input", "LibreOffice produced no PDF")
        out_dir = Path(base)
        out_dir.mkdir(parents=True, exist_ok=True)
        result = out_dir / "document.pdf"
        shutil.move(produced, result)
    finally:
        shutil.rmtree(outbox, ignore_errors=True)
        engine.scrub_tmp()
    info = pdf_prepare(path=str(result), limits=limits)
    if has_text:
        pdf_require_text(path=str(result))
    return {
        "document": str(result),
        "page_count": info["page_count"],
        "engine_rss": engine.rss_bytes(),
        "engine_started": started,
        "engine_sockets": engine.sockets,
    }


def _load_error(
    answer: dict,
    *,
    password_given: bool,
    encrypted: bool | None,
    peak_bytes: int,
) -> Exception:
    """The error for a failed conversion. LibreOffice only says "not loaded"; with a password
    for a file that is (or may be, ``None``) encrypted, that is the wrong password; otherwise,
    with LibreOffice's address space near the host's limit (``peak_bytes``), out of memory
    (``officeops.load_failure``)."""
    if answer.get("code") != "not_loaded":
        return error_from_code(answer.get("code", "converter_crashed"), answer.get("detail"))
    if password_given and encrypted is not False:
        return InvalidPassword()
    if encrypted:
        return EncryptedInput()
    return load_failure(answer.get("detail") or "", peak_bytes=peak_bytes)


def running() -> bool:
    """Whether this host started an engine (whose processes share its group)."""
    return _engine is not None


def before_group_kill() -> None:
    """Called by the host's watchdog before it kills its own group (the worker died)."""
    if _engine is not None:
        remove_sockets(_engine.sockets or bound_sockets(_group_pids()))
