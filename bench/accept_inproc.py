"""CPU per accepted request through the web's ASGI application in one process, without the HTTP
server, the connection balance between workers, or the publish (ADR 0017, session 6).

``bench/accept.py`` measures the real thing, but on a shared 2-core machine its web CPU per
request moves by ±20 % from run to run and its rate follows how the 16 connections fell on the
two uvicorn workers. This drives ``project.asgi.application`` (AccessLog, Liveness,
QuireASGIHandler with ``WEB_THREADS`` sync threads, the DRF view, the acceptance service, real
Postgres and staging) directly from ``--clients`` coroutines on one uvloop, with the same
request as ``bench/accept.py`` (a unique 10 KB PDF, ``output=text``, an ``Idempotency-Key``),
and prints the process's CPU (all threads) per request. The background publisher is not
started (a stand-in drops every committed row handed to it) and the fast path's publish is a
no-op, so the figure is the request path's alone.
Compare two checkouts by running each in turn (``PYTHONPATH`` and the script of the same one):

    .venv/bin/python bench/accept_inproc.py [--n 1600] [--clients 16]

The 10 KB document is an inline source by default (ADR 0017 session 10); ``BENCH_SOURCE=stored``
sets ``QUIRE_INLINE_SOURCE_MAX_BYTES=0`` so the store's put (and the pre-check read) is measured
instead. Also printed: the CPU of the Postgres backends serving the run, per request.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import resource
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

#: the checkout measured: this one, or ``BENCH_TREE`` (another checkout measured by this script,
#: run from that checkout's directory, for an A/B with the same measurement)
ROOT = Path(os.environ.get("BENCH_TREE") or Path(__file__).resolve().parent.parent)
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import _common as c  # noqa: E402

DB_NAME = c.bench_db_name("quire_inproc")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=1600, help="measured requests")
    parser.add_argument("--warm", type=int, default=800, help="requests discarded first")
    parser.add_argument("--clients", type=int, default=16)
    args = parser.parse_args()

    scratch = Path(tempfile.mkdtemp(prefix="quire-inproc-"))
    os.environ.update(
        DATABASE_URL=c.recreate_database(DB_NAME),
        QUIRE_STORAGE_DIR=str(scratch / "storage"),
        QUIRE_WORK_DIR=str(scratch / "work"),
        QUIRE_VAR_DIR=str(scratch / "var"),
        QUIRE_TENANT_QUOTA=str(10**9),
        QUIRE_GLOBAL_CAPACITY=str(10**9),
        QUIRE_LOG_LEVEL="WARNING",
        WEB_THREADS=os.environ.get("WEB_THREADS", "8"),
        DJANGO_SETTINGS_MODULE="project.settings",
    )
    if os.environ.get("BENCH_SOURCE", "inline") == "stored":
        os.environ["QUIRE_INLINE_SOURCE_MAX_BYTES"] = "0"
    c.run([sys.executable, "manage.py", "migrate", "--noinput", "-v0"], env=dict(os.environ))

    import django

    django.setup()
    from conversion_jobs.services import dispatch, publisher

    # A publisher that drops what it is handed: the web's paths that need one (the acceptance
    # on the event loop, ADR 0017 session 11) run, and nothing is published.
    class _Dropping:
        def submit(self, item: Any) -> bool:
            return True

    dropping = _Dropping()
    publisher._publisher = dropping  # type: ignore[assignment]
    publisher.enable = lambda *a, **k: dropping  # type: ignore[assignment]
    dispatch.outbox_publish_fast = lambda item: None  # type: ignore[assignment]
    import project.asgi
    from conversion_jobs.api.auth import token_mint

    for handler in logging.getLogger().handlers:  # the access log still formats every line
        if isinstance(handler, logging.StreamHandler):
            handler.setStream(open(os.devnull, "w"))
    app = project.asgi.application
    token = token_mint(tenant="bench", subject="bench", scopes=["jobs:submit"], ttl_s=3600)
    doc, slot = c.pdf_template(10 * 1024)
    boundary = "quirebench" + uuid.uuid4().hex
    statuses: dict[int, int] = {}

    def request() -> tuple[dict[str, Any], bytes]:
        uid = uuid.uuid4().hex.encode()
        body = c.multipart(
            [("output", b"text", None), ("file", doc[:slot] + uid + doc[slot + 32 :], "b.pdf")],
            boundary,
        )
        headers = [
            (b"host", b"127.0.0.1"),
            (b"authorization", f"Bearer {token}".encode()),
            (b"idempotency-key", b"bench-" + uid),
            (b"content-type", f"multipart/form-data; boundary={boundary}".encode()),
            (b"content-length", str(len(body)).encode()),
        ]
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": "/api/v1/jobs",
            "raw_path": b"/api/v1/jobs",
            "query_string": b"",
            "root_path": "",
            "headers": headers,
            "client": ("127.0.0.1", 1),
            "server": ("127.0.0.1", 8000),
        }
        return scope, body

    async def one() -> None:
        scope, body = request()
        given = False

        async def receive() -> dict[str, Any]:
            nonlocal given
            if not given:
                given = True
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.sleep(3600)  # no disconnect while the answer is sent
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                statuses[message["status"]] = statuses.get(message["status"], 0) + 1

        await app(scope, receive, send)

    async def client(count: int) -> None:
        for _ in range(count):
            await one()

    async def run() -> None:
        await asyncio.gather(*(client(args.warm // args.clients) for _ in range(args.clients)))
        statuses.clear()
        backends = _backends()
        pg_before = sum(c.proc_cpu_s(pid) for pid in backends)
        before, started = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        await asyncio.gather(*(client(args.n // args.clients) for _ in range(args.clients)))
        after, ended = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        pg = sum(c.proc_cpu_s(pid) for pid in backends) - pg_before
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        switches = (after.ru_nvcsw - before.ru_nvcsw) + (after.ru_nivcsw - before.ru_nivcsw)
        done = sum(statuses.values())
        print(
            f"{ROOT.name} ({os.environ.get('BENCH_SOURCE', 'inline')}):"
            f" {cpu / done * 1000:.3f} ms CPU per request,"
            f" PG backends {pg / done * 1000:.3f} ms, {switches / done:.0f} ctx switches,"
            f" {done / (ended - started):.0f} requests/s, answers {statuses},"
            f" load {os.getloadavg()[0]:.1f}"
        )

    def _backends() -> list[int]:
        pids = c.sql_scalar(
            c.PG_ADMIN_URL,
            f"SELECT array_agg(pid) FROM pg_stat_activity WHERE datname = '{DB_NAME}'",  # noqa: S608
        )
        return list(pids or [])

    import uvloop

    uvloop.run(run())


if __name__ == "__main__":
    main()
