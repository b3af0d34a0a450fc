"""A local webhook receiver for the tests (the outside world of the notifier): a threaded HTTP
server on 127.0.0.x that records every request and answers what its ``script`` says."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Received:
    headers: dict[str, str]
    body: bytes
    at: float
    path: str


@dataclass
class Reply:
    status: int = 200
    body: bytes = b"ok"
    headers: dict[str, str] = field(default_factory=dict)
    delay_s: float = 0.0


class Receiver:
    """``Receiver(script)``: ``script(received, seen_before)`` -> Reply, where ``seen_before``
    counts earlier requests with the same ``webhook-id``."""

    def __init__(
        self,
        script: Callable[[Received, int], Reply] | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.script = script or (lambda r, n: Reply())
        self.requests: list[Received] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", "0"))
                body = self.rfile.read(length)
                got = Received(
                    {k.lower(): v for k, v in self.headers.items()}, body, time.time(), self.path
                )
                with receiver.lock:
                    seen = sum(
                        1
                        for r in receiver.requests
                        if r.headers.get("webhook-id") == got.headers.get("webhook-id")
                    )
                    receiver.requests.append(got)
                reply = receiver.script(got, seen)
                if reply.delay_s:
                    time.sleep(reply.delay_s)
                self.send_response(reply.status)
                for name, value in reply.headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(reply.body)))
                self.end_headers()
                self.wfile.write(reply.body)

            def log_message(self, *args: Any) -> None:
                pass

        ThreadingHTTPServer.allow_reuse_address = True
        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://{host}:{self.port}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Canary:
    """A listener that only counts the connections it gets (it should get none)."""

    def __init__(self, host: str = "127.0.0.2") -> None:
        """``host`` "::" listens on every IPv4 and IPv6 address at once (dual stack)."""
        import socket

        self.connections = 0
        if host == "::":
            self.sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
            self.sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        else:
            self.sock = socket.socket()
        self.sock.bind((host, 0))
        self.sock.listen(64)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.closed = threading.Event()
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self.closed.set()
        self.thread.join(timeout=2)
        self.sock.close()
