"""The worker side of warm engines (ADR 0019).

One warm LibreOffice per worker process: an *engine host*, a converter child forked by the
process's fork server like any other (own session and process group, scrubbed environment,
limits, watchdog), that keeps ``soffice`` and its UNO client running between attempts (see
``officeengine``). It converts one document at a time (a lock) and is recycled — its whole
process group killed with SIGKILL and its private directory removed — when:

* it has served ``max_conversions`` conversions (``max_conversions``);
* its engine's resident memory is above ``max_rss_bytes`` after a conversion (``memory``);
* a conversion failed in any way, structured error included (``failure``), ran past its time
  limit (``timeout``; the attempt is charged ``conversion_timeout``), was stopped by a
  cancellation or a lost lease (``stopped``), or the host died (``crashed``);
* a conversion stepped aside (``stepped_aside``: its threads run at the lowest priority,
  ``aside.py``);
* it sat idle past ``MAX_IDLE_S`` (``idle``; its watchdog would end it anyway), the limits
  changed (``settings``), or it could not start (``start_failed``).

The reason is the label of ``quire_engine_recycles``. Being a child of the fork server, the host
lives in the worker process's sandbox (ADR 0013): documents are handed in as copies and PDFs
handed out. The worker's death (even ``kill -9``) ends the fork server; the host then sees end of
file or a new parent and kills its own group: no ``soffice`` and no socket outlive the worker.
"""

from __future__ import annotations

import atexit
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from conversion_jobs.observability import metrics

from .aside import AsideSettings, ConversionClock
from .base import Limits, PrepareRequest
from .errors import (
    ConversionError,
    ConversionStopped,
    ConversionTimeout,
    InputTooLarge,
    InvalidInput,
)
from .isolation import ChildSession, process_group_members
from .sessions import MAX_IDLE_S, fresh_child, on_release_all


@dataclass(frozen=True)
class EngineSettings:
    #: ``warm``: Office documents go to the warm engine; ``fresh``: a new LibreOffice per document.
    mode: str = "warm"
    max_conversions: int = 50
    max_rss_bytes: int = 800 * 1024 * 1024
    #: where engine hosts keep their private directories (profile, temporary files)
    scratch_dir: Path | None = None
    #: when a long conversion hands its worker slot back (ADR 0022, "Stepping aside")
    aside: AsideSettings = field(default_factory=AsideSettings)

    @property
    def warm(self) -> bool:
        return self.mode == "warm" and self.scratch_dir is not None


_settings = EngineSettings()


def configure(settings: EngineSettings) -> None:
    """Set this process's engine settings (the worker does it from Django settings)."""
    global _settings
    _settings = settings


def current_settings() -> EngineSettings:
    return _settings


@dataclass
class _Host:
    session: ChildSession
    owner_pid: int
    #: the engine's LibreOffice pipe sockets (removed after its group is killed)
    sockets: tuple[str, ...] = ()
    conversions: int = 0
    started_at: float = 0.0
    #: LibreOffice runs in the host (it starts after the host's first document passed its
    #: container check, so a refused document never starts it)
    engine_started: bool = False

    def forked_away(self) -> bool:
        """True in a forked copy of the process that started it: not ours to use or kill."""
        return self.owner_pid != os.getpid()


_lock = threading.Lock()
_host: _Host | None = None


def _observe(event: str, **labels: object) -> None:
    """Metrics (prometheus_client only; this package stays Django-free)."""
    if event == "start":
        metrics.ENGINE_STARTS.labels(engine="libreoffice").inc()
    elif event == "recycle":
        metrics.ENGINE_RECYCLES.labels(engine="libreoffice", reason=labels["reason"]).inc()
        metrics.ENGINE_LIFE_CONVERSIONS.labels(engine="libreoffice").observe(
            float(labels["conversions"])  # type: ignore[arg-type]
        )


def _recycle(reason: str) -> None:
    """End the current host (caller holds the lock)."""
    global _host
    host, _host = _host, None
    if host is None:
        return
    # (function-level: officeengine loads pdfops and pypdfium2, which the worker's own process
    # otherwise never imports; only its children convert)
    from .officeengine import bound_sockets, remove_sockets

    # A killed soffice leaves its sockets: note them (the host reported them; a host killed
    # before its first answer is asked through /proc) and remove them once the group is dead.
    sockets = set(_host_paths(host, host.sockets))
    if not host.session.closed and host.session.proc.sandbox_root is None:
        # (a sandbox has its own network namespace: its sockets are not listed here)
        sockets.update(bound_sockets(process_group_members(host.session.pgid)))
    host.session.close()
    remove_sockets(sorted(sockets))
    _observe("recycle", reason=reason, conversions=host.conversions)


def _host_paths(host: _Host, paths: tuple[str, ...]) -> list[str]:
    """Where the engine's socket paths are on this host: in a sandbox, its ``/tmp`` is the
    sandbox's own directory."""
    root = host.session.proc.sandbox_root
    if root is None:
        return list(paths)
    return [str(root.tmp / Path(p).name) for p in paths if p.startswith("/tmp/")]  # noqa: S108


def _host_for(*, scratch_dir: Path, limits: Limits) -> _Host:
    """This process's engine host (a converter child; LibreOffice starts in it on first use,
    ``_start_engine``), a new one if there is none usable with ``limits``."""
    global _host
    if _host is not None and _host.forked_away():
        _host = None  # a forked copy of this module: the parent's host is not ours
    if _host is not None and (
        _host.session.limits != limits or not _host.session.usable(max_idle_s=MAX_IDLE_S)
    ):
        _recycle("idle" if _host.session.limits == limits else "settings")
    if _host is None:
        scratch_dir.mkdir(parents=True, exist_ok=True)
        session = fresh_child()
        try:
            session.setup(limits=limits, scratch_dir=scratch_dir)
        except BaseException:
            session.close()
            raise
        _host = _Host(session=session, owner_pid=os.getpid(), started_at=time.monotonic())
    return _host


def _start_engine(host: _Host, *, clock: ConversionClock) -> None:
    """Start LibreOffice in ``host`` if it is not running (caller holds the lock)."""
    if host.engine_started:
        return
    _observe("start")
    try:
        started = host.session.call(
            "office_engine_start",
            {},
            timeout_s=clock.begin(),
            should_stop=clock.should_stop,
        )
    except BaseException:
        _recycle("start_failed")
        raise
    host.sockets = tuple(started["engine_sockets"])
    host.engine_started = True


def convert(
    request: PrepareRequest,
    *,
    dest: Path,
    password: str | None = None,
    encrypted: bool | None = None,
    fault: dict | None = None,
) -> dict:
    """Convert the Office document ``request`` names to the PDF ``dest`` with this process's
    warm engine (``password``, ``encrypted``, ``fault``: as the prepare found them). The
    document is handed in as a copy in the host's private directory and the PDF handed out; both
    are gone from the host before this returns. The host checks the container first
    (``office_scan``, containers.py): a document that fails it never reaches LibreOffice (which
    is not even started for it), and the engine, which has not seen it, is kept. Returns
    ``{"page_count", "engine_rss", "engine_started"}``; raises the conversion's ConversionError
    (the engine is then recycled)."""
    source, media_type = request.source, request.media_type
    limits = request.limits
    settings = _settings
    if settings.scratch_dir is None:
        raise RuntimeError("warm engines are not configured")
    with _lock:
        host = _host_for(scratch_dir=settings.scratch_dir, limits=limits)
        session = host.session
        clock = ConversionClock(request, settings.aside, pgid=lambda: session.pgid)
        args: dict = {}
        refused = False
        try:
            args = {
                "path": str(session.hand_in(source)),
                "media_type": media_type,
                "base": str(session.folder("out")),
            }
            if password is not None:
                args["password"], args["encrypted"] = password, encrypted
            if fault is not None:
                args["fault"] = fault
            try:
                scan = session.call(
                    "office_scan",
                    {"path": args["path"], "media_type": media_type},
                    timeout_s=clock.begin(),
                    should_stop=clock.should_stop,
                )
            except (InputTooLarge, InvalidInput):
                refused = True  # only the host's Python read it; LibreOffice never did
                raise
            args["has_text"] = scan["has_text"]
            _start_engine(host, clock=clock)
            result = session.call(
                "office_engine_convert",
                args,
                timeout_s=clock.begin(),
                should_stop=clock.should_stop,
            )
            session.hand_out(Path(result["document"]), dest)
        except ConversionTimeout:
            _recycle("timeout")
            raise
        except ConversionStopped:
            _recycle("stopped")
            raise
        except ConversionError as exc:
            if not refused:
                _recycle("crashed" if exc.retryable else "failure")
            raise
        except BaseException:
            _recycle("failure")
            raise
        finally:
            clock.end()
            args.pop("password", None)
            if not session.closed:  # nothing of this document stays with the host
                for folder in ("in", "out"):
                    shutil.rmtree(session.inside(folder), ignore_errors=True)
                if "path" in args:  # the handed-in copy (a refused one too)
                    Path(args["path"]).unlink(missing_ok=True)
        host.conversions += 1
        if clock.aside:
            _recycle("stepped_aside")  # its threads keep SCHED_IDLE (converters/aside.py)
        elif host.conversions >= settings.max_conversions:
            _recycle("max_conversions")
        elif int(result.get("engine_rss") or 0) > settings.max_rss_bytes:
            _recycle("memory")
        return result


def host_sockets() -> list[str]:
    """The current engine's LibreOffice sockets, as paths on this host (tests, diagnostics)."""
    with _lock:
        return _host_paths(_host, _host.sockets) if _host is not None else []


def host_private() -> Path | None:
    """The current engine host's private directory on this host (tests, diagnostics)."""
    with _lock:
        return _host.session.private if _host is not None else None


def host_conversions() -> int | None:
    """Conversions the current engine host has served, or None without a host (tests)."""
    with _lock:
        return _host.conversions if _host is not None else None


def host_engine_started() -> bool:
    """Whether LibreOffice runs in the current engine host (tests, diagnostics)."""
    with _lock:
        return _host is not None and _host.engine_started


def host_pgid() -> int | None:
    """The current engine host's process group (for tests and health), or None."""
    with _lock:
        return _host.session.pgid if _host is not None else None


def stop(reason: str = "shutdown") -> None:
    """End this process's engine (worker shutdown, tests)."""
    with _lock:
        if _host is not None and _host.forked_away():
            return
        _recycle(reason)


atexit.register(stop)
on_release_all(stop)
