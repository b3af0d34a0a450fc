"""The converter sandbox (docs/adr/0013-converter-sandbox.md).

Every process that parses a document — the converter children (pdfium, Pillow, img2pdf),
tesseract and LibreOffice — descends from the worker process's fork server (``zygote``). With
the sandbox on, that fork server starts inside a bubblewrap (``bwrap``) sandbox, so all of them
share its view of the machine:

* **mounts** (own mount namespace): ``/usr`` and the few files under ``/etc`` the engines need,
  the Python installation, the virtualenv and the ``conversion_jobs`` code, all read-only; a
  fresh ``/proc`` (of the sandbox's own pid namespace) and ``/dev``; ``/tmp`` is the sandbox's
  own directory; the only writable place is ``<root>/work`` (``SandboxRoot``), where each
  child's private directory lives. The artifact store, the other workers' work directories,
  ``/etc/shadow``, ``/run`` (the Postgres socket) and home directories do not exist inside.
* **network**: an empty network namespace (only a loopback of its own): no request leaves.
* **pids**: own pid namespace: a child cannot name, signal or trace anything outside.
* **uid**: the sandbox runs as an unprivileged uid. A worker running as root drops to
  ``QUIRE_SANDBOX_UID``/``GID`` (default 65534, ``nobody``) before bwrap starts; a non-root
  worker's sandbox runs as the worker's own uid, mapped into a user namespace without
  capabilities. Either way ``/proc/<pid>/status`` shows a non-root uid from outside.
* ``no_new_privs`` (bwrap always sets it), no capabilities, no nested user namespaces.

Documents are handed in as copies in the child's private directory and results handed out
by the worker (``isolation.ChildSession.hand_in`` / ``hand_out``): no path into the store
ever reaches a child.

Off switch: ``QUIRE_SANDBOX=off`` (an operator's explicit choice) starts the fork server as
before (ADR 0011); the worker logs it loudly, ``/health/ready`` and ``/metrics``
(``quire_sandbox_enabled 0``) show it. With the sandbox on but impossible to set up (no
bwrap, user namespaces disabled), every conversion fails with the retryable
``sandbox_unavailable`` before any document is opened and readiness says why.

To start a long-lived process inside a worker's sandbox (a warm engine), fork it from the
zygote with ``zygote.spawn(argv=[...])``: it then shares these namespaces and is killed and
reaped through the zygote like any converter child.

Never imports Django.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from .errors import ConversionError

log = logging.getLogger(__name__)

MODE_ENV = "QUIRE_SANDBOX"
UID_ENV = "QUIRE_SANDBOX_UID"
GID_ENV = "QUIRE_SANDBOX_GID"
#: Where per-worker sandbox directories live (the worker sets it from settings.WORK_DIR).
ROOT_ENV = "QUIRE_WORK_DIR"
NOBODY = 65534

_PACKAGE_DIR = Path(__file__).resolve().parents[1]  # conversion_jobs/
#: Read-only system paths inside the sandbox (those that exist on this machine).
SYSTEM_PATHS = (
    "/usr",
    "/etc/fonts",
    "/etc/ld.so.cache",
    "/etc/libreoffice",
    "/etc/alternatives",
    "/etc/localtime",
)
#: Merged-/usr symlinks recreated inside.
SYMLINKS = (
    ("usr/bin", "/bin"),
    ("usr/sbin", "/sbin"),
    ("usr/lib", "/lib"),
    ("usr/lib64", "/lib64"),
)
#: Minimal account database: LibreOffice looks its user up.
_PASSWD = "sandbox:x:{uid}:{gid}:sandbox:/nonexistent:/usr/sbin/nologin\n"  # noqa: S105
_GROUP = "sandbox:x:{gid}:\n"


class SandboxUnavailable(ConversionError, code="sandbox_unavailable", retryable=True):
    """The converter sandbox cannot be set up on this worker; the job is retried later."""


def enabled() -> bool:
    """The sandbox is on unless an operator set ``QUIRE_SANDBOX=off`` (anything else is on)."""
    return os.environ.get(MODE_ENV, "on").strip().lower() not in ("off", "0", "false", "no")


def _ids() -> tuple[int, int]:
    """The uid and gid the sandbox runs as (seen from outside)."""
    if os.geteuid() != 0:
        return os.geteuid(), os.getegid()
    uid = int(os.environ.get(UID_ENV) or NOBODY)
    gid = int(os.environ.get(GID_ENV) or uid)
    if uid == 0 or gid == 0:
        raise SandboxUnavailable("the sandbox uid and gid must not be 0")
    return uid, gid


_configured_work_dir: Path | None = None


def configure(*, work_dir: Path) -> None:
    """Where the per-worker sandbox directories go (``<work_dir>/.sandbox``); the worker and
    the web call this with ``settings.QUIRE["WORK_DIR"]``."""
    global _configured_work_dir
    _configured_work_dir = Path(work_dir)


def sandbox_dirs_parent() -> Path:
    """Where the per-worker-process sandbox directories are (``<WORK_DIR>/.sandbox``)."""
    return _dirs_parent(
        _configured_work_dir, os.environ.get(ROOT_ENV), os.environ.get("QUIRE_VAR_DIR")
    )


@functools.lru_cache(maxsize=8)
def _dirs_parent(work_dir: Path | None, root_env: str | None, var_dir: str | None) -> Path:
    """``sandbox_dirs_parent`` for these settings: ``configure``'s work dir, else
    ``$QUIRE_WORK_DIR``, else ``$QUIRE_VAR_DIR/work`` (cached: asked at every child start)."""
    if work_dir is not None:
        base = work_dir
    elif root_env:
        base = Path(root_env)
    else:
        base = Path(var_dir or _PACKAGE_DIR.parent / "var") / "work"
    return base / ".sandbox"


class SandboxRoot:
    """One fork server's directory: ``<WORK_DIR>/.sandbox/<pid>-<hex>/`` with ``work/`` (the
    only writable place inside; converter children's private directories) and ``tmp/`` (the
    sandbox's ``/tmp``), both owned by the sandbox uid, mode 0700. ``remove`` at the end."""

    def __init__(self) -> None:
        self.uid, self.gid = _ids()
        parent = sandbox_dirs_parent()
        parent.mkdir(parents=True, exist_ok=True)
        remove_stale(parent)
        self.path = parent / f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.path.mkdir(mode=0o711)
        self.work = self.path / "work"
        self.tmp = self.path / "tmp"
        (self.path / "passwd").write_text(_PASSWD.format(uid=self.uid, gid=self.gid))
        (self.path / "group").write_text(_GROUP.format(gid=self.gid))
        for directory in (self.work, self.tmp):
            directory.mkdir(mode=0o700)
            if os.geteuid() == 0:
                os.chown(directory, self.uid, self.gid)

    @functools.cached_property
    def _tmp_mount_roots(self) -> frozenset[str]:
        """The names of the entries of ``/tmp`` that lead to a mount point (computed once: the
        paths bound are fixed for a sandbox's life, and ``clear_tmp`` runs after every attempt)."""
        return frozenset(p.split("/")[2] for p in tmp_mount_points(self.work))

    def clear_tmp(self) -> None:
        """Empty the sandbox's ``/tmp`` (LibreOffice's OSL_PIPE sockets of killed instances).
        Keeps the directories that lead to ``work`` and to the read-only code paths when they
        lie under /tmp (their mount points inside the sandbox: removing one would unmount it
        there)."""
        for entry in list(os.scandir(self.tmp)):
            if entry.name in self._tmp_mount_roots:
                continue
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                try:
                    os.unlink(entry.path)
                except OSError:
                    pass

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def remove_stale(parent: Path) -> None:
    """Remove the sandbox directories of processes that no longer exist (a worker killed with
    SIGKILL cannot remove its own). ``<pid>-<hex>``: a directory is kept while its pid lives."""
    for entry in list(os.scandir(parent)) if parent.is_dir() else []:
        pid = entry.name.split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(entry.path, ignore_errors=True)
        except PermissionError:
            pass  # alive, another user's


def _bwrap() -> str:
    path = shutil.which("bwrap")
    if path is None:
        raise SandboxUnavailable("bubblewrap (bwrap) is not installed")
    return path


def _readonly_paths() -> list[str]:
    """Everything the converter code needs, read-only: system paths, Python, virtualenv, code."""
    paths = [p for p in SYSTEM_PATHS if os.path.exists(p)]
    for prefix in {sys.base_prefix, sys.prefix}:
        real = os.path.realpath(prefix)
        if not any(real == p or real.startswith(p + "/") for p in paths):
            paths.append(real)
    paths.append(str(_PACKAGE_DIR))
    return paths


def tmp_mount_points(work: Path) -> list[str]:
    """The paths bound inside a sandbox that lie under /tmp (its ``work`` and any read-only
    code path, e.g. a checkout in /tmp): bwrap creates their mount points, empty directories,
    in the sandbox's own /tmp (``SandboxRoot.tmp``)."""
    inside = (str(work), *_readonly_paths())
    return [p for p in inside if p.startswith("/tmp/")]  # noqa: S108


#: Where, in the launcher's private mount namespace, a root worker stages what bwrap binds
#: (the first of these that holds none of the bound paths; hidden only in that namespace).
STAGE_CANDIDATES = ("/dev/shm", "/mnt", "/srv", "/media")  # noqa: S108


def _stage_point(paths: list[str]) -> str:
    for candidate in STAGE_CANDIDATES:
        inside = any(p == candidate or p.startswith(candidate + "/") for p in paths)
        if os.path.isdir(candidate) and not inside:
            return candidate
    raise SandboxUnavailable("no directory to stage the sandbox's mounts in")


def command(root: SandboxRoot, argv: list[str]) -> list[str]:
    """The command line that runs ``argv`` in the sandbox rooted at ``root``.

    As another user than root: bwrap directly (unprivileged, in a user namespace). As root:
    ``unshare`` gives a launcher shell a private mount namespace in which every path bwrap will
    bind is first bind-mounted onto a fresh tmpfs (``_stage_point``), because the sandbox uid
    may be unable to reach the originals (a Python under /root, a work directory under a 0700
    parent); then ``setpriv`` drops to the sandbox uid (no groups, no capabilities) and bwrap
    builds the sandbox from the staged copies. Nothing of this is visible on the host."""
    bwrap = _bwrap()
    readonly = _readonly_paths()
    # (source on the host, path inside, read-only)
    # The sandbox's own /tmp is mounted first: a checkout, virtualenv or work directory that
    # lies under the host's /tmp is then bound on top of it instead of being hidden by it.
    binds = [
        (str(root.tmp), "/tmp", False),  # noqa: S108 - the sandbox's own /tmp
        *((p, p, True) for p in readonly),
        (str(root.path / "passwd"), "/etc/passwd", True),
        (str(root.path / "group"), "/etc/group", True),
        (str(root.work), str(root.work), False),
    ]
    as_root = os.geteuid() == 0
    stage_point = _stage_point([os.path.realpath(b[0]) for b in binds]) if as_root else ""
    args = [
        bwrap,
        "--unshare-all",
        "--unshare-user",
        "--disable-userns",
        "--uid",
        str(root.uid),
        "--gid",
        str(root.gid),
        "--hostname",
        "quire-sandbox",
        "--proc",
        "/proc",
        "--dev",
        "/dev",
    ]
    for i, (source, inside, readonly_bind) in enumerate(binds):
        staged = f"{stage_point}/{i}" if as_root else source
        args += ["--ro-bind" if readonly_bind else "--bind", staged, inside]
        if inside == "/usr":
            for target, link in SYMLINKS:
                args += ["--symlink", target, link]
    args += ["--chdir", "/", "--", *argv]
    if not as_root:
        return args
    stage = ["set -e", f'mount -t tmpfs -o mode=0755,size=1m quire-stage "{stage_point}"']
    for i, (source, _inside, _ro) in enumerate(binds):
        make = "mkdir" if os.path.isdir(source) else "touch"
        stage.append(f'{make} "{stage_point}/{i}" && mount --bind "$S{i}" "{stage_point}/{i}"')
    stage.append(
        f"exec setpriv --reuid={root.uid} --regid={root.gid} --clear-groups "
        '--inh-caps=-all --bounding-set=-all -- "$@"'
    )
    return [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "--",
        "env",
        *(f"S{i}={source}" for i, (source, _inside, _ro) in enumerate(binds)),
        "/bin/sh",
        "-c",
        "\n".join(stage),
        "quire-sandbox-stage",
        *args,
    ]


@dataclass(frozen=True)
class Status:
    """What readiness and metrics say about the sandbox on this host."""

    enabled: bool
    available: bool
    reason: str | None

    def as_dict(self) -> dict:
        mode = "on" if self.enabled else "off"
        return {"mode": mode, "available": self.available, "reason": self.reason}


_PROBE_TTL_S = 30.0
_probe_lock = threading.Lock()
_probe_cache: tuple[float, Status] | None = None


def probe(*, fresh: bool = False) -> Status:
    """Whether a sandbox can be set up here: starts this Python in one (cached for 30 s)."""
    global _probe_cache
    if not enabled():
        return Status(enabled=False, available=False, reason="turned off by QUIRE_SANDBOX=off")
    with _probe_lock:
        now = time.monotonic()
        if not fresh and _probe_cache is not None and now - _probe_cache[0] < _PROBE_TTL_S:
            return _probe_cache[1]
        status = _probe_once()
        _probe_cache = (now, status)
        return status


def status(*, work_dir: Path) -> Status:
    """:func:`probe` for a web or a worker whose work directory is ``work_dir``: what readiness
    and the sandbox gauges report (``settings.QUIRE["WORK_DIR"]``)."""
    configure(work_dir=work_dir)
    return probe()


def _probe_once() -> Status:
    root = None
    try:
        root = SandboxRoot()
        done = subprocess.run(  # noqa: S603
            # The interpreter the fork server runs, so a path the sandbox cannot show (say a
            # virtualenv it hides) fails readiness here rather than every conversion later.
            command(root, [sys.executable, "-c", "pass"]),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=20,
            check=False,
        )
        if done.returncode != 0:
            tail = done.stderr.decode("utf-8", "replace").strip().splitlines()[-1:]
            reason = f"the sandbox could not start: {' '.join(tail) or done.returncode}"
            return Status(enabled=True, available=False, reason=reason)
        return Status(enabled=True, available=True, reason=None)
    except SandboxUnavailable as exc:
        return Status(enabled=True, available=False, reason=exc.detail)
    except (OSError, subprocess.SubprocessError) as exc:
        return Status(enabled=True, available=False, reason=f"the sandbox could not start: {exc}")
    finally:
        if root is not None:
            root.remove()


def announce() -> Status:
    """Log the sandbox's state once at process start (loudly when it is off or broken)."""
    status = probe()
    if not status.enabled:
        log.critical(
            "CONVERTER SANDBOX OFF (QUIRE_SANDBOX=off): untrusted documents are parsed with the "
            "worker's view of the filesystem and network; ADR 0013 requires the sandbox"
        )
    elif not status.available:
        log.error("converter sandbox unavailable, conversions are refused: %s", status.reason)
    else:
        log.info("converter sandbox on")
    return status
