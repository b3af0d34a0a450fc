"""Webhook delivery (issue 25): latency, a flaky receiver at scale with notifier kill -9s, and a
receiver that is down for a while.

    .venv/bin/python bench/webhooks.py [--latency-jobs 100] [--jobs 1000] [--down-s 120]
                                       [--skip latency,flaky,down]

Real processes (quire_stack: a fresh database, a throwaway vhost): one Procfile worker
(``--concurrency``), sweeper, beat and notifier; a local receiver on 127.0.0.1 (allowlisted with
``QUIRE_WEBHOOK_ALLOWLIST``) that verifies every request with the ``standardwebhooks``
reference library. One-page text jobs through the service layer.

(a) latency: jobs one after another on an idle stack; for each, the receiver's arrival time
    minus the job's ``finished_at`` (the terminal commit, a Postgres timestamp on this host's
    clock): p50 / p99 (targets ≤ 100 ms / ≤ 500 ms).
(b) flaky: the receiver answers 500 to the first 3 deliveries of each message, then 200;
    ``--jobs`` jobs, a secret rotation half-way, the notifier killed with SIGKILL twice and
    restarted; counts acknowledged events against terminal jobs, checks one webhook-id per job.
    The retry schedule is shortened (``SHORT_SCHEDULE``) so the run fits in minutes.
(c) down: the receiver is down (connection refused) for ``--down-s`` seconds while jobs finish,
    then back on the same port; every message must be delivered by the schedule
    (``DOWN_SCHEDULE``: shortened, said so in the output).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import percentile, quire_stack, submit_job

SHORT_SCHEDULE = "0.5,1,1,1,1,1,2,2"
DOWN_SCHEDULE = "2,5,10,20,30,30,30,30,30,30"
HOOK_ENV = {
    "QUIRE_WEBHOOK_ALLOWLIST": "127.0.0.1/32",
    "QUIRE_WEBHOOK_ALLOWED_PORTS": "1024-65535",
    "QUIRE_WEBHOOK_TIMEOUT_S": "5",
}
ALL = ["job.succeeded", "job.partial", "job.failed", "job.cancelled"]


def _verify_all(receiver, secrets_: list[str]) -> dict[str, set[str]]:
    """job id -> the webhook-ids its deliveries carried; every request verified."""
    from standardwebhooks import Webhook

    ids: dict[str, set[str]] = {}
    for got in list(receiver.requests):
        body = None
        for secret in secrets_:
            with contextlib.suppress(Exception):
                body = Webhook(secret).verify(got.body, got.headers)
                break
        if body is None:
            raise SystemExit(f"FAIL: a delivery did not verify ({got.headers.get('webhook-id')})")
        ids.setdefault(body["data"]["id"], set()).add(got.headers["webhook-id"])
    return ids


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"FAIL: timed out waiting for {what}")
        time.sleep(0.2)


def latency(stack, n: int) -> None:
    from conversion_jobs.models import ConversionJob
    from conversion_jobs.webhooks.endpoints import webhook_endpoint_create
    from tests.webhook_receiver import Receiver

    receiver = Receiver()
    endpoint, secret = webhook_endpoint_create(
        tenant="bench", actor="bench", url=receiver.url, events=ALL
    )
    stack.cluster.notifier(QUIRE_WEBHOOK_RETRY_SCHEDULE=SHORT_SCHEDULE)
    time.sleep(2)
    gaps: list[float] = []
    for _ in range(n):
        before = len(receiver.requests)
        job_id, _ = submit_job(tenant="bench")
        _wait(lambda b=before: len(receiver.requests) > b, 60, "a delivery")
        got = receiver.requests[-1]
        finished = ConversionJob.objects.get(id=job_id).finished_at.timestamp()
        gaps.append((got.at - finished) * 1000)
    _verify_all(receiver, [secret])
    gaps.sort()
    p50, p99 = percentile(gaps, 50), percentile(gaps, 99)
    print(
        f"(a) latency terminal commit -> receiver, {n} jobs: p50 {p50:.1f} ms (target ≤ 100), "
        f"p99 {p99:.1f} ms (target ≤ 500), max {gaps[-1]:.1f} ms; load {os.getloadavg()}",
        flush=True,
    )
    receiver.close()
    from conversion_jobs.models import WebhookEndpoint

    WebhookEndpoint.objects.filter(id=endpoint.id).delete()
    for proc in list(stack.cluster.procs):
        if proc.kind == "notifier":
            proc.stop()


def flaky(stack, jobs: int) -> None:
    from conversion_jobs.models import ConversionJob, WebhookMessage
    from conversion_jobs.webhooks.endpoints import webhook_endpoint_create, webhook_endpoint_rotate
    from tests.webhook_receiver import Receiver, Reply

    receiver = Receiver(lambda got, seen: Reply(500) if seen < 3 else Reply(200))
    endpoint, old = webhook_endpoint_create(
        tenant="flaky", actor="bench", url=receiver.url, events=ALL
    )
    env = {"QUIRE_WEBHOOK_RETRY_SCHEDULE": SHORT_SCHEDULE}
    notifier = stack.cluster.notifier(**env)
    started = time.monotonic()
    ids = []
    new = old
    kills = 0
    for i in range(jobs):
        ids.append(submit_job(tenant="flaky")[0])
        if i == jobs // 3 or i == 2 * jobs // 3:
            notifier.kill9()
            kills += 1
            if i == jobs // 3:
                _, new = webhook_endpoint_rotate(
                    tenant="flaky", endpoint_id=endpoint.id, actor="bench"
                )
            notifier = stack.cluster.notifier(**env)
    submitted = time.monotonic() - started

    def finished() -> bool:
        terminal = ConversionJob.objects.filter(
            id__in=ids, state__in=["succeeded", "partial", "failed", "cancelled"]
        ).count()
        delivered = WebhookMessage.objects.filter(endpoint=endpoint, state="delivered").count()
        return terminal == len(ids) and delivered == terminal

    _wait(finished, 1800, "every event acknowledged")
    elapsed = time.monotonic() - started
    by_job = _verify_all(receiver, [old, new])
    terminal = ConversionJob.objects.filter(id__in=ids).exclude(finished_at=None).count()
    acked = WebhookMessage.objects.filter(endpoint=endpoint, state="delivered").count()
    one_id = all(len(v) == 1 for v in by_job.values())
    print(
        f"(b) flaky receiver (500 x3 then 200), {jobs} jobs, schedule {SHORT_SCHEDULE}, "
        f"{kills} notifier kill -9s, a rotation at 1/3: terminal {terminal}, acknowledged "
        f"{acked}, jobs seen by the receiver {len(by_job)}, requests {len(receiver.requests)}, "
        f"one webhook-id per job: {one_id}; every request verified; submitted in "
        f"{submitted:.0f} s, all acknowledged after {elapsed:.0f} s; load {os.getloadavg()}",
        flush=True,
    )
    if not (terminal == acked == len(by_job) == jobs and one_id):
        raise SystemExit("FAIL: flaky run lost or duplicated an event")
    receiver.close()
    for proc in list(stack.cluster.procs):
        if proc.kind == "notifier":
            proc.stop()


def down(stack, down_s: float, jobs: int, schedule: str = DOWN_SCHEDULE) -> None:
    from conversion_jobs.models import WebhookMessage
    from conversion_jobs.webhooks.endpoints import webhook_endpoint_create
    from tests.webhook_receiver import Receiver

    receiver = Receiver()
    port = receiver.port
    endpoint, secret = webhook_endpoint_create(
        tenant="down", actor="bench", url=receiver.url, events=ALL
    )
    stack.cluster.notifier(QUIRE_WEBHOOK_RETRY_SCHEDULE=schedule)
    receiver.close()
    went_down = time.monotonic()
    for _ in range(jobs):
        submit_job(tenant="down")
    time.sleep(max(0.0, down_s - (time.monotonic() - went_down)))
    back = Receiver(port=port)
    back_at = time.monotonic()
    _wait(
        lambda: WebhookMessage.objects.filter(endpoint=endpoint, state="delivered").count() == jobs,
        1800,
        "every message after the receiver came back",
    )
    after = time.monotonic() - back_at
    failed = WebhookMessage.objects.filter(endpoint=endpoint, state="failed").count()
    by_job = _verify_all(back, [secret])
    print(
        f"(c) receiver down {down_s:.0f} s (schedule {schedule}, shortened), {jobs} jobs: "
        f"delivered {len(by_job)}/{jobs}, failed {failed}, last delivered {after:.1f} s after "
        f"it came back; load {os.getloadavg()}",
        flush=True,
    )
    back.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--latency-jobs", type=int, default=100)
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--down-s", type=float, default=120.0)
    parser.add_argument("--down-jobs", type=int, default=50)
    parser.add_argument("--down-schedule", default=DOWN_SCHEDULE)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--skip", default="")
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    skip = set(args.skip.split(","))
    print(f"load at start: {os.getloadavg()}", flush=True)
    with quire_stack(db_name="quire_bench_webhooks", keep=args.keep, **HOOK_ENV) as stack:
        stack.start("worker", WORKER_CONCURRENCY=str(args.concurrency))
        stack.start("sweeper")
        stack.start("beat")
        if "latency" not in skip:
            latency(stack, args.latency_jobs)
        if "flaky" not in skip:
            flaky(stack, args.jobs)
        if "down" not in skip:
            down(stack, args.down_s, args.down_jobs, args.down_schedule)


if __name__ == "__main__":
    main()
