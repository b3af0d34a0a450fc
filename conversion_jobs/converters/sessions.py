"""Which child session serves which document (ADR 0009).

Each worker thread has at most one session: ``open_session`` (called by ``prepare``) always
starts a fresh child for the document and ends the thread's previous sessions, so an attempt never
inherits a child from an earlier attempt. ``session_for`` (called per page) returns the thread's
session for the same document and limits, or a fresh one (private directory in the page's
``dest_dir``) after a failure killed it or its directory was removed. ``release`` ends the
calling thread's sessions; the worker calls it when an attempt ends.

To take the child's start-up (interpreter, pypdfium2) off the page path, ``release`` leaves
one *spare* child per process: spawned but never set up, it has seen no input and no directory,
and becomes the next session of whichever thread needs one. A spare or a session idle longer than
``MAX_IDLE_S`` is replaced (the child ends itself after ``CHILD_IDLE_EXIT_S``).

**Reuse within a tenant** (``QUIRE_CONVERTER_REUSE=tenant``, ADR 0019; default ``attempt``:
a fresh child per attempt). The worker names the attempt's tenant with ``begin_attempt`` (an
opaque pseudonym, never the tenant id). ``release`` then keeps the attempt's child, *reset*
(document closed, private directory removed), for the next attempt of the same tenant on this
process, unless it failed in any way (a structured error, a timeout, a crash), served
``max_attempts`` attempts, or is above ``max_rss_bytes``. The child's own reset (document
closed) is the first step of the next attempt's setup, which travels with that attempt's first
request (``ChildSession.setup``), before that attempt's directory and limits; its private
directory is removed at ``release``. The next
attempt of another tenant, or one with other limits, ends it and gets a fresh child.
"""

from __future__ import annotations

import atexit
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .base import CHILD_IDLE_EXIT_S, Limits
from .errors import ConversionError
from .isolation import ChildSession, empty_directory
from .zygote import current_zygote, stop_zygote

MAX_IDLE_S = CHILD_IDLE_EXIT_S / 2

_lock = threading.Lock()
_owner_pid = os.getpid()
#: (thread ident, document, limits) -> session
_sessions: dict[tuple, ChildSession] = {}
_spare: ChildSession | None = None


@dataclass(frozen=True)
class ReuseSettings:
    #: ``attempt``: a fresh child per attempt; ``tenant``: a child may serve consecutive
    #: attempts of one tenant
    mode: str = "attempt"
    max_attempts: int = 200
    max_rss_bytes: int = 512 * 1024 * 1024


_reuse = ReuseSettings()
#: the kept child (reuse within a tenant), its reset due with its next setup, with ``tenant``
#: and ``attempts`` set
_kept: ChildSession | None = None
_attempt = threading.local()


def configure_reuse(settings: ReuseSettings) -> None:
    global _reuse
    _reuse = settings


def begin_attempt(*, tenant: str | None) -> None:
    """Name the calling thread's attempt's tenant (an opaque pseudonym) for converter reuse."""
    _attempt.tenant = tenant


def _attempt_tenant() -> str | None:
    return getattr(_attempt, "tenant", None)


def _take_kept(*, tenant: str | None, limits: Limits) -> ChildSession | None:
    """The kept child if it may serve this attempt; otherwise it ends (tenant change...)."""
    global _kept
    with _lock:
        _forked()
        kept, _kept = _kept, None
    if kept is None:
        return None
    if (
        _reuse.mode == "tenant"
        and tenant is not None
        and kept.tenant == tenant
        and kept.limits == limits
        and kept.usable(max_idle_s=MAX_IDLE_S)
    ):
        return kept
    kept.close()
    return None


def _keep(session: ChildSession) -> bool:
    """Keep ``session`` for the tenant's next attempt if it may serve one; True if kept."""
    global _kept
    tenant = _attempt_tenant()
    if (
        _reuse.mode != "tenant"
        or tenant is None
        or session.closed
        or session.errored
        or session.ahead
        or session.attempts + 1 >= _reuse.max_attempts
        or not session.usable(max_idle_s=MAX_IDLE_S)
        or session.rss_bytes() > _reuse.max_rss_bytes
    ):
        return False
    # The child's reset (close the document, forget the directory) rides on its next setup,
    # which travels with the next attempt's first request: no round trip of its own, and
    # nothing of this attempt is visible to that request. The directory is emptied now (its
    # files go before this returns) and kept for that setup; if it cannot be emptied the
    # child is not kept.
    if session.private is not None:
        if not empty_directory(session.private):
            return False
        session.emptied, session.private, session.document = session.private, None, None
    session.reset_due = True
    session.tenant, session.attempts = tenant, session.attempts + 1
    with _lock:
        stale, _kept = _kept, session
    if stale is not None:
        stale.close()
    return True


def _forked() -> None:
    """After a fork the parent's children are not ours to use or kill: forget them."""
    global _owner_pid, _spare, _kept
    if os.getpid() != _owner_pid:
        _owner_pid, _spare, _kept = os.getpid(), None, None
        _sessions.clear()


def fresh_child() -> ChildSession:
    """The spare child if there is a usable one, else a newly spawned child. Not set up."""
    global _spare
    with _lock:
        _forked()
        spare, _spare = _spare, None
    if spare is not None and spare.usable(max_idle_s=MAX_IDLE_S):
        return spare
    if spare is not None:
        spare.close()
    return ChildSession()


def warm() -> None:
    """Spawn the spare child now (it starts in the background) unless there is one. Does
    nothing when no child can be started (e.g. the sandbox is unavailable): the next attempt
    then reports why."""
    global _spare
    with _lock:
        _forked()
        if _spare is not None and _spare.usable(max_idle_s=MAX_IDLE_S):
            return
        stale, _spare = _spare, None
    if stale is not None:
        stale.close()
    spare: ChildSession | None
    try:
        spare = ChildSession()
    except ConversionError:
        return
    with _lock:
        if _spare is None:
            _spare, spare = spare, None
    if spare is not None:
        spare.close()


def _key(document: Path, limits: Limits) -> tuple:
    return (threading.get_ident(), str(document), limits)


def _take_thread_sessions(keep: tuple | None = None, document: Path | None = None) -> list:
    """Remove and return this thread's sessions (of ``document`` if given), except ``keep``,
    and any session of a thread that no longer exists. Caller holds the lock."""
    me = threading.get_ident()
    living = {thread.ident for thread in threading.enumerate()}
    taken = []
    for key in list(_sessions):
        owner, path = key[0], key[1]
        mine = owner == me and (document is None or path == str(document))
        if key != keep and (mine or owner not in living):
            taken.append(_sessions.pop(key))
    return taken


def open_session(*, document: Path, scratch_dir: Path, limits: Limits) -> ChildSession:
    """A fresh, set-up child for ``document``; the calling thread's other sessions end. The
    child gets a copy of the document in its private directory (``session.document``)."""
    key = _key(document, limits)
    with _lock:
        _forked()
        old = _take_thread_sessions()
    for session in old:
        session.close()
    session = _take_kept(tenant=_attempt_tenant(), limits=limits) or fresh_child()
    try:
        # The setup (for a kept child: its reset first) goes with the first request.
        session.setup(limits=limits, scratch_dir=scratch_dir)
        session.document = session.hand_in(document)
    except BaseException:
        session.close()
        raise
    with _lock:
        _sessions[key] = session
    return session


def session_for(*, document: Path, scratch_dir: Path, limits: Limits) -> ChildSession:
    """The calling thread's live session for ``document``, or a fresh one."""
    key = _key(document, limits)
    with _lock:
        _forked()
        session = _sessions.get(key)
    if session is not None and session.usable(max_idle_s=MAX_IDLE_S):
        return session
    return open_session(document=document, scratch_dir=scratch_dir, limits=limits)


def session_due(*, document: Path, limits: Limits, page: int) -> ChildSession | None:
    """The calling thread's session for ``document`` if ``page`` is the next answer it owes (a
    read-ahead asked for it), else None. Unlike ``session_for`` it does not probe the child
    (its ``/proc`` status, its directory, its idle time) once per page: a child that died
    shows when the answer is read (ConverterCrashed, charged to that page)."""
    key = _key(document, limits)
    with _lock:
        _forked()
        session = _sessions.get(key)
    if session is not None and not session.closed and session.ahead and session.ahead[0] == page:
        return session
    return None


def forget(session: ChildSession) -> None:
    """Close ``session`` and drop it from the cache (e.g. its prepare failed)."""
    with _lock:
        for key in [k for k, s in _sessions.items() if s is session]:
            del _sessions[key]
    session.close()


def release(prepared=None, *, spare: bool = True) -> None:
    """End the calling thread's child sessions (only those of ``prepared.document`` if given):
    kill their process groups and remove their private directories. Then, with ``spare``, start
    a spare child for the next attempt. Safe to call more than once or with nothing open."""
    document = getattr(prepared, "document", None)
    with _lock:
        _forked()
        taken = _take_thread_sessions(document=document)
        idle = not _sessions
    for session in taken:
        if not (prepared is None and _keep(session)):
            session.close()
    server = current_zygote()
    if idle and server is not None:
        server.clear_tmp()  # nothing of this attempt stays in the sandbox's /tmp
    if spare:
        warm()


#: Run first by :func:`release_all` in the owning process: ``engines.py`` registers its
#: ``stop`` (a hook, not an import: the engine module is built on this one).
_release_hooks: list[Callable[[str], None]] = []


def on_release_all(hook: Callable[[str], None]) -> None:
    """Have :func:`release_all` call ``hook("shutdown")`` before it ends the children."""
    _release_hooks.append(hook)


def release_all() -> None:
    """End every session, the spare, the kept child and the warm engine of this process (at
    exit, or before its fork server is replaced): the engine lives in the fork server's sandbox,
    so it is recycled here rather than found dead, mid-conversion, by the next attempt."""
    global _spare, _kept
    if os.getpid() == _owner_pid:
        for hook in _release_hooks:
            hook("shutdown")
    with _lock:
        if os.getpid() != _owner_pid:
            return
        taken = list(_sessions.values())
        _sessions.clear()
        if _spare is not None:
            taken.append(_spare)
            _spare = None
        if _kept is not None:
            taken.append(_kept)
            _kept = None
    for session in taken:
        session.close()
    stop_zygote()


atexit.register(release_all)


def run_isolated(
    *,
    op: str,
    args: dict,
    limits: Limits,
    timeout_s: float,
    scratch_dir: Path,
    should_stop: Callable[[], bool] = lambda: False,
    fault: dict | None = None,
) -> dict:
    """Run ``op`` once in a fresh child and return its result dict; the child is gone after.

    Raises the child's structured ConversionError, or ConversionTimeout, ConversionStopped,
    ConverterCrashed. ``scratch_dir`` holds the child's private directory; it is removed
    before returning.
    """
    with fresh_child() as session:
        session.setup(limits=limits, scratch_dir=scratch_dir)
        return session.call(op, args, timeout_s=timeout_s, should_stop=should_stop, fault=fault)
