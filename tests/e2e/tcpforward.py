"""A small TCP forwarder: ``python -m tests.e2e.tcpforward LISTEN_HOST:PORT=TARGET_HOST:PORT ...``.

The separate-hosts e2e test runs it in the root network namespace, bound to the host side of
each test host's veth pair, so the hosts reach Postgres, RabbitMQ and the S3 server (which
listen on 127.0.0.1 only) over an address of their own network — without touching the shared
servers' configuration. It prints ``ready`` once every listener is bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


def _handler(host: str, port: int):  # type: ignore[no-untyped-def]
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(host, port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

    return handle


async def main(routes: list[str]) -> None:
    servers = []
    for route in routes:
        listen, target = route.split("=")
        lhost, lport = listen.rsplit(":", 1)
        thost, tport = target.rsplit(":", 1)
        servers.append(await asyncio.start_server(_handler(thost, int(tport)), lhost, int(lport)))
    print("ready", flush=True)
    await asyncio.gather(*(s.serve_forever() for s in servers))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
