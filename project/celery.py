"""The Celery app.

Configuration lives in ``project/settings.py`` (``CELERY_*``). Two things are code:

* :class:`QuireConsumer` drops Celery's native-delayed-delivery bootstep. Celery >= 5.5 declares
  a ``celery_delayed_*`` topology whenever it sees a quorum queue, for ETA tasks; Quire has no
  ETA or countdown anywhere (retry timers are Postgres rows), and the least-privilege worker user
  may not declare those objects (docs/adr/0003-no-native-delayed-delivery.md).
* worker process hooks: OpenTelemetry instrumentation after fork; the converter fork server
  (``conversion_jobs/converters/zygote.py``) and a spare child started before the first job.

This module loads with the ``project`` package, before Django's settings and apps, in every
process: ``conversion_jobs`` is imported inside the hooks, which run only in a worker.
"""

from __future__ import annotations

import os
import threading

from billiard.process import current_process
from celery import Celery
from celery.signals import celeryd_after_setup, worker_process_init, worker_process_shutdown
from celery.worker.consumer import Consumer
from django.conf import settings

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")

DELAYED_DELIVERY_STEP = "celery.worker.consumer.delayed_delivery:DelayedDelivery"


class QuireConsumer(Consumer):
    """The standard consumer without the native delayed delivery bootstep, and with undecodable
    messages dead-lettered (Celery's default acks them, losing the evidence)."""

    class Blueprint(Consumer.Blueprint):  # type: ignore[misc,valid-type,name-defined]
        default_steps = [
            step for step in Consumer.Blueprint.default_steps if step != DELAYED_DELIVERY_STEP
        ]

    def connection_for_write(self, url=None, heartbeat=None):  # type: ignore[no-untyped-def]
        """The connection of the ``Events`` bootstep, this method's only caller: monitoring
        events (``-E``: received / started / succeeded per task, for Flower) are published
        without publisher confirms. With the broker's ``confirm_publish`` the consumer's event
        loop stopped for a broker round trip per event, three per job, between handing tasks
        to the pool (ADR 0017, session 8). Task messages and every other publish keep their
        confirms; an event lost in a broker crash costs a monitor one line, never a job."""
        return self.ensure_connected(
            self.app.connection_for_write(
                url=url, heartbeat=heartbeat, transport_options={"confirm_publish": False}
            )
        )

    def on_decode_error(self, message, exc):  # type: ignore[no-untyped-def]
        from conversion_jobs.observability import metrics

        metrics.DEAD_LETTERS.inc()
        message.reject(requeue=False)


app = Celery("quire")
# Celery's current app is per thread; as the default it is every thread's. conversion_jobs reaches
# it this way (services/broker.py's celery_app), never by importing this package.
app.set_default()
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(["tasks.conversion", "tasks.sweeps"], related_name=None)  # type: ignore[arg-type]


@worker_process_init.connect
def _instrument_worker_process(**_: object) -> None:
    from conversion_jobs.observability import tracing

    tracing.instrument_worker()


@celeryd_after_setup.connect
def _instrument_threaded_worker(sender: str, instance: object, **_: object) -> None:
    """A worker whose pool forks no process (the sweeper's threads pool: no
    ``worker_process_init``) is instrumented in its own process, before it consumes."""
    if any(kind in _pool_name(instance) for kind in ("prefork", "solo")):
        return  # instrumented by worker_process_init, in each pool process
    from conversion_jobs.observability import tracing

    tracing.instrument_worker()


def _pool_name(instance: object) -> str:
    """The worker's pool as named on its command line, or the pool class's module."""
    pool = getattr(instance, "pool_cls", "prefork")
    return pool if isinstance(pool, str) else getattr(pool, "__module__", "")


@celeryd_after_setup.connect
def _check_converter_sandbox(sender: str, instance: object, **_: object) -> None:
    """A worker that would consume conversions checks the converter sandbox (ADR 0013)
    before it consumes anything. Off by the operator's switch: logged loudly, then it works
    unsandboxed. On but impossible to set up: it does not consume the conversion queue at all
    (the jobs stay queued for a worker that can sandbox them; none is claimed, failed or
    lost), logs why, and the web's /health/ready says why."""
    from conversion_jobs.converters import sandbox

    queues = instance.app.amqp.queues  # type: ignore[attr-defined]
    if settings.CONVERSION_QUEUE not in queues.consume_from:
        return
    sandbox.configure(work_dir=settings.QUIRE["WORK_DIR"])
    status = sandbox.announce()
    if status.enabled and not status.available:
        queues.deselect([settings.CONVERSION_QUEUE])


@celeryd_after_setup.connect
def _conversion_slots(sender: str, instance: object, **_: object) -> None:
    """After the sandbox check (connected after it, so it runs after it): a worker that still
    consumes conversions offers each pool process as a slot to the fair relay."""
    from django.conf import settings

    global _CONVERSION_SLOTS, _POOL_SLOTS
    queues = instance.app.amqp.queues  # type: ignore[attr-defined]
    if settings.CONVERSION_QUEUE not in queues.consume_from:
        return
    _CONVERSION_SLOTS = True
    concurrency = int(getattr(instance, "concurrency", 1) or 1)
    _POOL_SLOTS = max(1, concurrency - settings.QUIRE["WORKER_SPARES"])
    if "prefork" not in _pool_name(instance):
        # No forked pool processes to announce themselves: this process has all the slots.
        from conversion_jobs.services import fair

        fair.slot_beat_start(slots=_POOL_SLOTS)


@celeryd_after_setup.connect
def _relay_wake(sender: str, instance: object, **_: object) -> None:
    """The sweeper (it consumes the sweeps queue, and its broker user may publish) runs the
    relay as soon as ``NOTIFY quire_dispatch`` says ranges were planned or a worker slot was
    freed (conversion_jobs/services/relay_wake.py), not at the outbox sweep's next tick."""
    queues = instance.app.amqp.queues  # type: ignore[attr-defined]
    if settings.SWEEP_QUEUE not in queues.consume_from:
        return
    from conversion_jobs.services import relay_wake

    relay_wake.start()


#: This worker consumes conversions: each of its pool processes is a slot the fair relay may
#: fill (conversion_jobs/services/fair.py). Set before the pool forks, so children inherit it.
_CONVERSION_SLOTS = False
#: Of the pool's processes, those with an index below this are slots; the others
#: (``QUIRE_WORKER_SPARES``) are spares, announced with 0 slots: the relay fills one only
#: while an attempt stepped aside (ADR 0022).
_POOL_SLOTS = 1


@worker_process_init.connect
def _announce_conversion_slot(**_: object) -> None:
    if _CONVERSION_SLOTS:
        from conversion_jobs.services import fair

        index = getattr(current_process(), "index", None) or 0  # billiard's pool index
        fair.slot_beat_start(slots=1 if index < _POOL_SLOTS else 0)


@worker_process_shutdown.connect
def _withdraw_conversion_slot(**_: object) -> None:
    if _CONVERSION_SLOTS:
        from conversion_jobs.services import fair

        try:
            fair.slot_withdraw()
        except Exception:  # the row lapses after QUIRE_FAIR_SLOT_TTL_S anyway
            return


@worker_process_init.connect
def _start_converter_fork_server(**_: object) -> None:
    from conversion_jobs import converters
    from conversion_jobs.converters import sandbox

    sandbox.configure(work_dir=settings.QUIRE["WORK_DIR"])
    # In the background: this hook runs under the pool's start-up timeout.
    threading.Thread(target=converters.warm, name="quire-warm", daemon=True).start()
