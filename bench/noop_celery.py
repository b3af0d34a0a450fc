"""The plain-Celery peers of ``bench/throughput.py``: a bare Celery app (no Django, no Quire)
with the delivery guarantees Quire uses: durable quorum queues, persistent messages, publisher
confirms, ``acks_late``, prefetch 1, results ignored.

* ``bench.noop`` (queue ``bench.noop``): a no-op;
* ``bench.convert`` (queue ``bench.plain``): the Celery task a team would otherwise write
  (docs/TEST_STRATEGY.md §6.1): open the PDF in-process with pypdfium2, extract every page's text,
  write the text to a file (no fsync), mark the job's Postgres row done with one UPDATE (autocommit,
  one connection per worker process, ``BENCH_DB_URL``). No sandbox, no lease, no audit, no retry
  state.

Each leaves one line (its start and finish times) in a per-process file opened with
``O_APPEND``: one ``write(2)``, no fsync, so completions can be counted and timed without
adding work of its own.

Worker: ``celery -A bench.noop_celery worker -Q bench.noop|bench.plain …`` with
``BENCH_BROKER_URL`` and ``BENCH_DONE_DIR`` set (bench/throughput.py starts it with the Procfile
worker's flags).
"""

from __future__ import annotations

import os
import time

from celery import Celery
from kombu import Exchange, Queue

QUEUE = "bench.noop"
PLAIN_QUEUE = "bench.plain"


def _queue(name: str) -> Queue:
    return Queue(
        name,
        Exchange(name, type="direct"),
        routing_key=name,
        queue_arguments={"x-queue-type": "quorum"},
    )


app = Celery("bench_noop")
app.conf.update(
    broker_url=os.environ.get("BENCH_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672//"),
    broker_transport_options={"confirm_publish": True},
    task_queues=(_queue(QUEUE), _queue(PLAIN_QUEUE)),
    task_routes={"bench.convert": {"queue": PLAIN_QUEUE, "routing_key": PLAIN_QUEUE}},
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


_db = None


def _connection():  # type: ignore[no-untyped-def]
    global _db
    if _db is None:
        import psycopg

        _db = psycopg.connect(os.environ["BENCH_DB_URL"], autocommit=True)
    return _db


@app.task(name="bench.convert", acks_late=True)
def convert(job_id: str, source: str) -> None:
    """The peer: PDF -> text in-process, the text to a file, one UPDATE of the job's row."""
    import pypdfium2

    started = time.time()
    document = pypdfium2.PdfDocument(source)
    try:
        parts = []
        for page in document:
            textpage = page.get_textpage()
            parts.append(textpage.get_text_range())
            textpage.close()
            page.close()
    finally:
        document.close()
    out = os.path.join(os.environ["BENCH_DONE_DIR"], f"{job_id}.txt")
    with open(out, "w", encoding="utf-8") as fh:
        fh.write("\f".join(parts))
    _connection().execute(
        "UPDATE bench_plain_job SET state = 'done', text_path = %s, finished_at = now()"
        " WHERE id = %s",
        (out, job_id),
    )
    os.write(_done_fd(), f"{started:.6f} {time.time():.6f}\n".encode())
