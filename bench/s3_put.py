"""The S3 server's CPU per small PUT, by request feature (issue 14, ADR 0018).

    .venv/bin/python bench/s3_put.py [--puts 600] [--threads 4] [--size 10240] [--rounds 2]
                                     [--variants plain,checksum,cond,both,head]
                                     [--weed-args "-flag=value ..."]

Starts the S3 server the tests and benchmarks use (SeaweedFS, ``tests/s3server.py``; with
``--weed-args`` appended to its command line, a later flag winning, to try its options) and
sends ``--puts`` PUTs of ``--size`` random bytes, each to a new key, from ``--threads`` threads
on pooled keep-alive connections, signed with botocore's SigV4 signer as
``conversion_jobs/storage/s3put.py`` signs the acceptance's source PUT. Variants:

* ``plain``: the body's SHA-256 signed as ``x-amz-content-sha256``, nothing else;
* ``checksum``: plus ``x-amz-checksum-sha256`` (the server verifies the body against it);
* ``cond``: plus ``If-None-Match: *`` (the server checks the key does not exist);
* ``both``: checksum and condition: the acceptance's source PUT;
* ``head``: a HEAD of an existing key (the check a server without conditional writes needs).

Every round runs every variant once, interleaved. Per variant and round it prints requests/s,
the server's CPU per request (``/proc/<pid>/stat``, user + system), this process's, and the
whole machine's busy CPU per request (``/proc/stat``: the server, the client, the kernel's
network work and whatever else runs). On a shared machine compare variants within a run.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import os
import shlex
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import urllib3
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

from tests import s3server

TICK = os.sysconf("SC_CLK_TCK")
VARIANTS = ("plain", "checksum", "cond", "both", "head")


class _KnownPayloadAuth(S3SigV4Auth):
    def payload(self, request: AWSRequest) -> str:
        return str(request.context["payload_sha256"])


def proc_cpu(pid: int) -> float:
    """Seconds of user + system CPU of process ``pid`` (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def machine_busy() -> float:
    """Seconds of non-idle CPU of the whole machine, all cores."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]
    return (sum(values[:8]) - idle) / TICK


def signed(
    creds: Credentials, method: str, url: str, headers: dict[str, str], sha256: str
) -> dict[str, str]:
    request = AWSRequest(method=method, url=url, headers=headers)
    request.context["payload_sha256"] = sha256
    _KnownPayloadAuth(creds, "s3", "us-east-1").add_auth(request)
    return dict(request.headers.items())


def run_variant(
    server: s3server.S3Server,
    pool: urllib3.PoolManager,
    variant: str,
    *,
    puts: int,
    threads: int,
    size: int,
    existing: list[str],
) -> tuple[float, float, float, float]:
    """(requests/s, server ms, client ms, machine ms per request)."""
    creds = Credentials(server.access_key, server.secret_key).get_frozen_credentials()
    base = f"{server.endpoint_url}/{server.bucket}/s3put-bench/"
    empty = hashlib.sha256(b"").hexdigest()
    # bodies prepared before the clock starts: the benchmark measures the requests
    work: list[list[tuple[str, bytes, str]]] = [[] for _ in range(threads)]
    for i in range(puts):
        if variant == "head":
            key = existing[i % len(existing)]
            work[i % threads].append((key, b"", empty))
        else:
            body = os.urandom(size)
            key = f"{variant}/{uuid.uuid4().hex}"
            work[i % threads].append((key, body, hashlib.sha256(body).hexdigest()))
    errors: list[str] = []

    def client(items: list[tuple[str, bytes, str]]) -> None:
        for key, body, sha in items:
            url = base + key
            if variant == "head":
                r = pool.request("HEAD", url, headers=signed(creds, "HEAD", url, {}, sha))
                if r.status != 200:
                    errors.append(f"HEAD {r.status}")
                existing.append(key)
                continue
            headers = {"Content-Length": str(len(body)), "Content-Type": "application/pdf"}
            if variant in ("checksum", "both"):
                headers["x-amz-checksum-sha256"] = base64.b64encode(bytes.fromhex(sha)).decode()
            if variant in ("cond", "both"):
                headers["If-None-Match"] = "*"
            r = pool.request("PUT", url, body=body, headers=signed(creds, "PUT", url, headers, sha))
            if r.status != 200:
                errors.append(f"PUT {r.status} {r.data[:200]!r}")
            else:
                existing.append(key)

    assert server.proc is not None
    pid = server.proc.pid
    s0, c0, m0, t0 = proc_cpu(pid), time.process_time(), machine_busy(), time.perf_counter()
    workers = [threading.Thread(target=client, args=(items,)) for items in work]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    wall = time.perf_counter() - t0
    s1, c1, m1 = proc_cpu(pid), time.process_time(), machine_busy()
    if errors:
        raise SystemExit(f"{variant}: {len(errors)} failed requests, first: {errors[0]}")
    per = 1000.0 / puts
    return puts / wall, (s1 - s0) * per, (c1 - c0) * per, (m1 - m0) * per


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--puts", type=int, default=600, help="requests per variant and round")
    parser.add_argument("--threads", type=int, default=4, help="client threads (connections)")
    parser.add_argument("--size", type=int, default=10240, help="bytes per object")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--weed-args", default="", help="appended to the weed command line")
    parser.add_argument(
        "--gomaxprocs",
        type=int,
        default=1,
        help="the server's GOMAXPROCS (tests/s3server.py's default 1; 0: the Go default)",
    )
    parser.add_argument("--settle", type=float, default=3.0, help="idle seconds after start")
    args = parser.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants: {sorted(unknown)}")

    with tempfile.TemporaryDirectory(prefix="s3put-") as scratch:
        server = s3server.start(
            Path(scratch),
            gomaxprocs=args.gomaxprocs or None,
            extra_args=shlex.split(args.weed_args),
        )
        try:
            assert server.proc is not None
            time.sleep(args.settle)
            pid = server.proc.pid
            i0, t0 = proc_cpu(pid), time.perf_counter()
            time.sleep(2.0)
            idle = (proc_cpu(pid) - i0) / (time.perf_counter() - t0)
            print(
                f"weed args: {args.weed_args or '(tests/s3server.py defaults)'}; "
                f"GOMAXPROCS {args.gomaxprocs or 'Go default'}"
            )
            print(f"server idle CPU: {idle * 1000:.1f} ms/s;  load {os.getloadavg()[0]:.1f}")
            pool = urllib3.PoolManager(maxsize=args.threads, block=True)
            existing: list[str] = []
            # warm-up: connections, the bucket's first volume
            run_variant(
                server,
                pool,
                "plain",
                puts=100,
                threads=args.threads,
                size=args.size,
                existing=existing,
            )
            print(
                f"{'round':>5} {'variant':<9} {'req/s':>8} {'server ms':>10} {'client ms':>10}"
                f" {'machine ms':>11}"
            )
            for r in range(1, args.rounds + 1):
                for variant in variants:
                    rate, srv, cli, mach = run_variant(
                        server,
                        pool,
                        variant,
                        puts=args.puts,
                        threads=args.threads,
                        size=args.size,
                        existing=existing,
                    )
                    print(
                        f"{r:>5} {variant:<9} {rate:8.1f} {srv:10.3f} {cli:10.3f} {mach:11.3f}",
                        flush=True,
                    )
        finally:
            server.stop()


if __name__ == "__main__":
    main()
