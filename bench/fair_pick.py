"""Where the fair pick's time goes, seen from its caller (issue 24, idle latency; ADR 0021).

    .venv/bin/python bench/fair_pick.py [--rounds 300]

One fresh database and throwaway vhost (``_common.quire_stack``), no worker (the messages
published stay in the throwaway queue), ``QUIRE_FAIR_CAPACITY`` fixed so credits are always
free. Each round accepts one one-page job with its commit fast path switched off (untimed), then
times, in turn, one variant of what the fast path does with it: so every variant sees the same
tables, one waiting unit and the same machine load. Variants (wall ms from this process, and
the process's own CPU ms in the same span):

* ``select1``: ``SELECT 1`` on Django's cursor: the round trip floor.
* ``pick``: ``fair.pick`` as the fast path calls it.
* ``pick_client`` / ``pick_server``: the pick statement on Django's client-binding cursor
  (the values rendered into the text, parsed by Postgres each time) / on the server-binding,
  prepared cursor (``store/prepared.py``).
* ``pick_explain``: ``EXPLAIN (ANALYZE)`` of the pick: Postgres's own execution time of the
  function, reported as ``server``.
* ``pick_empty``: a pick with nothing waiting (the round's unit taken first, untimed).
* ``publish``: ``broker.publish_conversion`` of the round's unit (confirm included).

Printed: p50 / p90 per variant, wall and CPU, and the load average.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as c

PICK_CLIENT = "SELECT * FROM quire_fair_pick(%s, %s, %s, %s)"
PICK_SERVER = (
    "SELECT * FROM quire_fair_pick(%(limit)s::integer, %(capacity)s::integer,"
    " %(lost)s::float8, %(ttl)s::float8)"
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=300)
    args = parser.parse_args()
    print(f"load average at start {c.load_average()}", flush=True)
    with c.quire_stack(
        db_name=c.bench_db_name("quire_fair_pick"), QUIRE_FAIR_CAPACITY="1000000"
    ) as _stack:
        from django.conf import settings
        from django.db import connection

        from conversion_jobs.services import broker, dispatch, fair
        from conversion_jobs.store.prepared import prepared_cursor

        q = settings.QUIRE
        client_params = [100, q["FAIR_CAPACITY"], q["FAIR_LOST_S"], q["FAIR_SLOT_TTL_S"]]
        server_params = {
            "limit": 100,
            "capacity": q["FAIR_CAPACITY"],
            "lost": float(q["FAIR_LOST_S"]),
            "ttl": float(q["FAIR_SLOT_TTL_S"]),
        }
        dispatch.outbox_publish_fast = lambda _item: True  # type: ignore[assignment]

        def accept() -> None:
            c.submit_job(tenant="bench")

        def select1() -> object:
            with connection.cursor() as cur:
                cur.execute("SELECT 1")
                return cur.fetchall()

        def pick_client() -> object:
            with connection.cursor() as cur:
                cur.execute(PICK_CLIENT, client_params)
                return cur.fetchall()

        def pick_server() -> object:
            with prepared_cursor() as cur:
                cur.execute(PICK_SERVER, server_params)
                return cur.fetchall()

        server_ms: list[float] = []

        def pick_explain() -> object:
            with connection.cursor() as cur:
                cur.execute("EXPLAIN (ANALYZE) " + PICK_CLIENT, client_params)
                text = "\n".join(r[0] for r in cur.fetchall())
            found = re.search(r"Execution Time: ([0-9.]+) ms", text)
            if found:
                server_ms.append(float(found.group(1)))
            return text

        picked: list[object] = []

        def publish() -> object:
            units = picked[-1]
            for u in units:  # type: ignore[attr-defined]
                broker.publish_conversion(
                    job_id=u.job_id, generation=u.generation, traceparent=u.traceparent
                )
            return units

        variants: dict[str, tuple[Callable[[], object], Callable[[], object] | None]] = {
            "select1": (select1, None),
            "pick": (lambda: fair.pick(limit=100), None),
            "pick_client": (pick_client, None),
            "pick_server": (pick_server, None),
            "pick_explain": (pick_explain, None),
            "pick_empty": (lambda: fair.pick(limit=100), lambda: fair.pick(limit=100)),
            "publish": (publish, lambda: picked.append(fair.pick(limit=100))),
        }
        wall: dict[str, list[float]] = {k: [] for k in variants}
        cpu: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(5):  # warm-up: connections, prepared statements, plans
            for _name, (run, before) in variants.items():
                accept()
                if before is not None:
                    before()
                run()
        server_ms.clear()
        for _ in range(args.rounds):
            for name, (run, before) in variants.items():
                accept()
                if before is not None:
                    before()
                time.sleep(0.002)  # as at idle: the caller was waiting, not spinning
                t0, p0 = time.perf_counter(), time.process_time()
                run()
                cpu[name].append((time.process_time() - p0) * 1000)
                wall[name].append((time.perf_counter() - t0) * 1000)
                fair.pick(limit=100)  # nothing left waiting for the next variant
    print(f"load average at end {c.load_average()}")
    print(f"{'variant':<14} {'wall p50':>9} {'p90':>7} | {'CPU p50':>8} {'p90':>7}  ms")
    for name in variants:
        w, u = sorted(wall[name]), sorted(cpu[name])
        print(
            f"{name:<14} {c.percentile(w, 50):9.3f} {c.percentile(w, 90):7.3f} |"
            f" {c.percentile(u, 50):8.3f} {c.percentile(u, 90):7.3f}"
        )
    s = sorted(server_ms)
    print(
        f"{'server':<14} {c.percentile(s, 50):9.3f} {c.percentile(s, 90):7.3f}"
        "   (EXPLAIN ANALYZE execution time of the pick)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
