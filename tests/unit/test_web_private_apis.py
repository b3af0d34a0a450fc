"""The private parts of uvicorn, uvicorn-worker, gunicorn, asgiref and Django that
``conversion_jobs/web`` relies on (ADR 0024): each is pinned in pyproject.toml to the versions
tested, and these tests fail - by name - when an upgrade moves one, before an e2e test fails in
a way that is harder to read. The e2e tests (tests/e2e/test_web_tier.py) exercise every hook
through a real server; these run in a second and need no server.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import json
import tomllib
from collections import deque
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]

#: The distributions whose private parts the web uses, and what it uses of each.
PINNED = {
    "uvicorn": "httptools_impl.HttpToolsProtocol's state and callbacks, STATUS_LINE",
    "Django": "ASGIHandler.handle (copied), read_body, create_request, send_response",
    "asgiref": "ThreadSensitiveContext(executor=...)",
}


def _requirements() -> dict[str, Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(line) for line in project["dependencies"]]
    return {req.name.lower(): req for req in reqs}


@pytest.mark.parametrize("name", sorted(PINNED))
def test_pinned__each_distribution_is_pinned_to_one_tested_minor_and_installed_within(name):
    """An upgrade past the tested minor is a decision (rerun bench/ and tests/e2e, then move
    the pin and the hashes below), never a side effect of ``pip install -U``."""
    req = _requirements()[name.lower()]
    installed = Version(version(name))
    assert req.specifier.contains(installed, prereleases=True), (name, str(installed), str(req))
    uppers = [Version(spec.version) for spec in req.specifier if spec.operator == "<"]
    next_minor = Version(f"{installed.major}.{installed.minor + 1}")
    assert uppers and min(uppers) <= next_minor, f"{name}: pin below {next_minor}, not {req}"


class _Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.written = b""
        self.closed = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 1) if name in ("sockname", "peername") else default

    def write(self, data: bytes) -> None:  # type: ignore[override]
        self.written += data

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def _protocol(loop: asyncio.AbstractEventLoop) -> Any:
    from uvicorn.config import Config
    from uvicorn.server import ServerState

    from conversion_jobs.web.protocol import QuireHttpProtocol

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    config = Config(app=app, http=QuireHttpProtocol, lifespan="off", access_log=False)
    config.load()
    protocol = QuireHttpProtocol(
        config=config, server_state=ServerState(), app_state={}, _loop=loop
    )
    transport = _Transport()
    protocol.connection_made(transport)
    return protocol, transport


def test_uvicorn__the_httptools_protocol_state_the_subclass_reads_is_there():
    """``QuireHttpProtocol`` reads ``url``, ``headers``, ``scope``, ``cycle`` (its
    ``more_body``, ``response_started``, ``response_complete``, ``disconnected``,
    ``message_event``), ``pipeline``, ``timeout_keep_alive_task`` / ``timeout_keep_alive`` /
    ``timeout_keep_alive_handler`` and ``_unset_keepalive_if_required``, and overrides the
    parser callbacks and ``send_400_response`` / ``on_response_complete``."""
    from uvicorn.protocols.http import httptools_impl

    parent = httptools_impl.HttpToolsProtocol
    for name in (
        "connection_made",
        "connection_lost",
        "data_received",
        "on_message_begin",
        "on_headers_complete",
        "on_body",
        "on_message_complete",
        "on_response_complete",
        "send_400_response",
        "timeout_keep_alive_handler",
        "_unset_keepalive_if_required",
    ):
        assert callable(getattr(parent, name, None)), name
    assert set(httptools_impl.STATUS_LINE) >= {400, 408, 413, 414, 431}

    async def run() -> None:
        protocol, transport = _protocol(asyncio.get_running_loop())
        assert protocol.timeout_keep_alive_task is not None  # armed by our connection_made
        assert isinstance(protocol.timeout_keep_alive, (int, float))
        assert isinstance(protocol.pipeline, deque)
        protocol.data_received(b"POST /x?q=1 HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\n\r\n")
        assert protocol.url == b"/x?q=1"
        assert (b"content-length", b"3") in protocol.headers
        assert protocol.scope["path"] == "/x"
        cycle = protocol.cycle
        for name in ("more_body", "response_started", "response_complete", "disconnected"):
            assert isinstance(getattr(cycle, name), bool), name
        assert isinstance(cycle.message_event, asyncio.Event)
        protocol.data_received(b"abc")
        await asyncio.sleep(0.05)  # the application answers
        assert transport.written.startswith(b"HTTP/1.1 204")
        protocol.connection_lost(None)

    asyncio.run(run())


def test_uvicorn__the_subclass_refuses_on_the_installed_version():
    """The refusals themselves, on the protocol as installed: a 9 KiB target is 414 as
    problem+json and the connection closes; unparseable bytes are 400."""

    async def run() -> None:
        protocol, transport = _protocol(asyncio.get_running_loop())
        protocol.data_received(b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: a\r\n\r\n")
        head, _, body = transport.written.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 414"), transport.written[:80]
        assert json.loads(body)["code"] == "uri_too_long"
        assert transport.closed
        protocol.connection_lost(None)

        protocol, transport = _protocol(asyncio.get_running_loop())
        protocol.data_received(b"GARBAGE\x01\r\n\r\n")
        assert transport.written.startswith(b"HTTP/1.1 400"), transport.written[:80]
        protocol.connection_lost(None)

    asyncio.run(run())


#: sha256 of ``inspect.getsource(ASGIHandler.handle)`` in the Django the pin allows (5.2.x):
#: ``QuireASGIHandler.handle`` is a copy of it with changes (conversion_jobs/web/handler.py).
#: A new hash means Django changed the method: port the change, then update the hash.
DJANGO_ASGI_HANDLE_SHA256 = "98faeb5bef800331e6a8002fbc96b30e4122a23438ae45a047190a531ea11323"


def test_django__the_asgi_handler_methods_the_subclass_overrides_and_calls_are_as_tested():
    from django.core.handlers.asgi import ASGIHandler
    from django.core.handlers.base import BaseHandler

    source = inspect.getsource(ASGIHandler.handle)
    assert hashlib.sha256(source.encode()).hexdigest() == DJANGO_ASGI_HANDLE_SHA256
    for name in (
        "read_body",
        "create_request",
        "send_response",
        "listen_for_disconnect",
        "run_get_response",
        "get_response_async",
    ):
        assert callable(getattr(ASGIHandler, name, None)), name
    assert list(inspect.signature(ASGIHandler.send_response).parameters) == [
        "self",
        "response",
        "send",
    ]
    assert "is_async" in inspect.signature(BaseHandler.load_middleware).parameters
    assert callable(BaseHandler.resolve_request)


def test_asgiref__a_thread_sensitive_context_takes_an_executor():
    from asgiref.sync import ThreadSensitiveContext

    assert "executor" in inspect.signature(ThreadSensitiveContext.__init__).parameters


def test_uvicorn_worker__the_worker_is_configured_the_documented_way():
    """``QuireUvicornWorker`` only sets ``CONFIG_KWARGS`` (uvicorn-worker's documented way to
    configure it; no private hook), and uvicorn loads the protocol it names."""
    from uvicorn.config import Config
    from uvicorn_worker import UvicornWorker

    from conversion_jobs.web.protocol import QuireHttpProtocol
    from conversion_jobs.web.worker import QuireUvicornWorker

    own = {name for name in vars(QuireUvicornWorker) if not name.startswith("__")}
    assert own == {"CONFIG_KWARGS"}
    assert issubclass(QuireUvicornWorker, UvicornWorker)
    config = Config(app=lambda *_: None, **QuireUvicornWorker.CONFIG_KWARGS)
    config.load()
    assert config.http_protocol_class is QuireHttpProtocol
