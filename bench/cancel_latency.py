"""Cancellation latency of running PDF -> PNG jobs (issue 5, performance).

    .venv/bin/python bench/cancel_latency.py [--cancels 50] [--pages 60] [--concurrency 2]

Real processes, default timings (heartbeat 2 s, lease 10 s): a fresh database ``quire_cx_cancel``,
a throwaway RabbitMQ vhost with the production topology (see ``bench/pages.py``), one Procfile
worker (``--concurrency`` worker processes). In rounds of ``--concurrency`` jobs: submit unique
``--pages``-page PDFs (``png``, 150 dpi), wait until each is ``running`` with at least one page
checkpointed, wait a random 0-2 s (so requests land at every phase of the heartbeat period),
cancel (``conversion_job_cancel``, the service behind ``POST /api/v1/jobs/{id}/cancel``), wait
for ``cancelled``. Latency = ``cancellation_request.resolved_at - requested_at`` (Postgres
timestamps: request committed -> the worker's fenced ``cancelled`` transition committed).

The worker notices a cancel at whichever comes first: its next page checkpoint (the fenced write
matches no row once the job is ``cancelling``) or its next heartbeat. Real pages at 150 dpi take
a fraction of a second, so the page boundary usually wins; ``--slow-page 3`` (a test fault:
every page sleeps 3 s in the converter child) makes pages longer than the heartbeat and measures
the heartbeat path and the kill of a busy converter child.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import percentile
from pages import service, submit, unique_pdf


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cancels", type=int, default=50)
    parser.add_argument("--pages", type=int, default=60)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument(
        "--slow-page",
        type=float,
        default=0.0,
        help="seconds every page sleeps in the converter child (test fault, enabled for this "
        "run only): pages longer than the heartbeat, so the heartbeat, not the page boundary, "
        "is what notices the cancel",
    )
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    print(f"load at start: {os.getloadavg()}", flush=True)
    started = time.monotonic()
    extra = {"QUIRE_ENABLE_TEST_FAULTS": "1"} if args.slow_page else {}
    options: dict = {"dpi": 150}
    if args.slow_page:
        options["_test_fault"] = {"kind": "slow", "seconds": args.slow_page}
    with service("quire_cx_cancel", keep=args.keep, **extra) as svc:
        from conversion_jobs.models import CancellationRequest, ConversionJob, PageCheckpoint
        from conversion_jobs.services.cancellation import conversion_job_cancel

        svc.worker(concurrency=args.concurrency)
        from django.conf import settings

        heartbeat = settings.QUIRE["HEARTBEAT_S"]
        latencies: list[float] = []
        outcomes: dict[str, int] = {}
        n = 0
        while len(latencies) < args.cancels:
            batch = [
                submit(
                    unique_pdf(svc.scratch / f"c{n + i}.pdf", args.pages),
                    output="png",
                    options=options,
                )
                for i in range(min(args.concurrency, args.cancels - len(latencies)))
            ]
            n += len(batch)
            for job in batch:
                deadline = time.monotonic() + 120
                while not (
                    ConversionJob.objects.filter(id=job.id, state="running").exists()
                    and PageCheckpoint.objects.filter(job_id=job.id, state="done").exists()
                ):
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"job {job.id} never ran")
                    time.sleep(0.02)
            time.sleep(random.uniform(0, 2))
            for job in batch:
                result = conversion_job_cancel(job_id=job.id, tenant="bench", actor="bench")
                outcomes[result.outcome.value] = outcomes.get(result.outcome.value, 0) + 1
            for job in batch:
                deadline = time.monotonic() + 60
                while ConversionJob.objects.get(id=job.id).state != "cancelled":
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"job {job.id} not cancelled")
                    time.sleep(0.02)
                request = CancellationRequest.objects.get(job_id=job.id)
                latencies.append((request.resolved_at - request.requested_at).total_seconds())
        lat = sorted(latencies)
        print(
            f"{len(lat)} cancels of running {args.pages}-page PDF -> PNG jobs "
            f"{f'(slow-page fault {args.slow_page:g} s/page) ' if args.slow_page else ''}"
            f"({args.concurrency} worker processes, heartbeat {heartbeat:g} s; request outcomes "
            f"{outcomes}): p50 {percentile(lat, 50):.3f} s, p90 {percentile(lat, 90):.3f} s, "
            f"p99 {percentile(lat, 99):.3f} s, max {lat[-1]:.3f} s, min {lat[0]:.3f} s "
            f"(target p99 <= 2 s: {'met' if percentile(lat, 99) <= 2 else 'missed'}); "
            f"run took {time.monotonic() - started:.0f} s",
            flush=True,
        )
    print(f"load at end: {os.getloadavg()}", flush=True)


if __name__ == "__main__":
    main()
