"""The Celery app.

Configuration lives in ``project/settings.py`` (``CELERY_*``). Two things are code:

* :class:`QuireConsumer` drops Celery's native-delayed-delivery bootstep. Celery >= 5.5 declares
  a ``celery_delayed_*`` topology whenever it sees a quorum queue, for ETA tasks; Quire has no
  ETA or countdown anywhere (retry timers are Postgres rows), and the least-privilege worker user
  may not declare those objects (docs/adr/0003-no-native-delayed-delivery.md).
* worker process hooks: OpenTelemetry instrumentation after fork; the converter fork server
  (``conversion_jobs/converters/zygote.py``) and a spare child started before the first job.
"""

from __future__ import annotations

import os

from celery import Celery
from celery.signals import worker_process_init
from celery.worker.consumer import Consumer

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")

DELAYED_DELIVERY_STEP = "celery.worker.consumer.delayed_delivery:DelayedDelivery"


class QuireConsumer(Consumer):
    """The standard consumer without the native delayed delivery bootstep, and with undecodable
    messages dead-lettered (Celery's default acks them, losing the evidence)."""

    class Blueprint(Consumer.Blueprint):  # type: ignore[misc,valid-type,name-defined]
        default_steps = [
            step for step in Consumer.Blueprint.default_steps if step != DELAYED_DELIVERY_STEP
        ]

    def on_decode_error(self, message, exc):  # type: ignore[no-untyped-def]
        from conversion_jobs.observability import metrics

        metrics.DEAD_LETTERS.inc()
        message.reject(requeue=False)


app = Celery("quire")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(["tasks.conversion", "tasks.sweeps"], related_name=None)  # type: ignore[arg-type]


@worker_process_init.connect
def _instrument_worker_process(**_: object) -> None:
    from conversion_jobs.observability import tracing

    tracing.instrument_worker()


@worker_process_init.connect
def _start_converter_fork_server(**_: object) -> None:
    import threading

    from conversion_jobs import converters

    # In the background: this hook runs under the pool's start-up timeout.
    threading.Thread(target=converters.warm, name="quire-warm", daemon=True).start()
