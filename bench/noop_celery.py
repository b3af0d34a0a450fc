"""The plain-Celery baseline of ``bench/throughput.py``: a bare Celery app (no Django, no Quire)
with the delivery guarantees Quire uses: a durable quorum queue, persistent messages, publisher
confirms, ``acks_late``, prefetch 1, results ignored.

The task is a no-op that leaves one line (its start and finish times) in a per-process file
opened with ``O_APPEND``: one ``write(2)``, no fsync, so completions can be counted and timed
without adding work of its own.

Worker: ``celery -A bench.noop_celery worker -Q bench.noop …`` with ``BENCH_BROKER_URL`` and
``BENCH_DONE_DIR`` set (bench/throughput.py starts it with the Procfile worker's flags).
"""

from __future__ import annotations

import os
import time

from celery import Celery
from kombu import Exchange, Queue

QUEUE = "bench.noop"

app = Celery("bench_noop")
app.conf.update(
    broker_url=os.environ.get("BENCH_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672//"),
    broker_transport_options={"confirm_publish": True},
    task_queues=(
        Queue(
            QUEUE,
            Exchange(QUEUE, type="direct"),
            routing_key=QUEUE,
            queue_arguments={"x-queue-type": "quorum"},
        ),
    ),
    task_default_queue=QUEUE,
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    task_ignore_result=True,
    result_backend=None,
    task_serializer="json",
    accept_content=["json"],
    task_default_delivery_mode="persistent",
    worker_detect_quorum_queues=True,
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
)

_fd: int | None = None


def _done_fd() -> int:
    global _fd
    if _fd is None:
        path = os.path.join(os.environ["BENCH_DONE_DIR"], f"done-{os.getpid()}.txt")
        _fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    return _fd


@app.task(name="bench.noop", acks_late=True)
def noop(job_id: str, generation: int) -> None:
    started = time.time()
    os.write(_done_fd(), f"{started:.6f} {time.time():.6f}\n".encode())
