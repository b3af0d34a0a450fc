"""Celery app used by tests/e2e/test_rabbitmq_topology.py.

It mirrors the settings Quire's real app must use against the least-privilege
users of deploy/rabbitmq/: every business queue/exchange is ``no_declare``
(the topology is owned by definitions.json, nobody but the operator has
``configure`` on it) and the worker consumer drops the native delayed
delivery bootstep (no permissions exist for ``celery_delayed_*``).

The worker subprocess is started with
``celery -A tests.e2e._topology_app worker ...`` and reads its broker URL from
``QUIRE_TOPOLOGY_BROKER_URL``; the test process builds its own instances with
:func:`make_app` and a per-role URL.
"""

from __future__ import annotations

import os
from pathlib import Path

from celery import Celery
from celery.worker.consumer import Consumer
from kombu import Exchange, Queue

DELAYED_DELIVERY_STEP = "celery.worker.consumer.delayed_delivery:DelayedDelivery"

CONVERSION_QUEUE_ARGUMENTS = {
    "x-queue-type": "quorum",
    "x-delivery-limit": 5,
    "x-dead-letter-exchange": "quire.dlx",
    "x-dead-letter-strategy": "at-most-once",
}
SWEEPS_QUEUE_ARGUMENTS = {
    "x-queue-type": "classic",
    "x-message-ttl": 5000,
    "x-max-length": 100,
    "x-overflow": "drop-head",
}


class QuireConsumer(Consumer):
    """Worker consumer without native delayed delivery (Quire has no ETA)."""

    class Blueprint(Consumer.Blueprint):
        default_steps = [s for s in Consumer.Blueprint.default_steps if s != DELAYED_DELIVERY_STEP]


def task_queues() -> tuple[Queue, Queue]:
    conversion_exchange = Exchange("quire.conversion", "direct", durable=True, no_declare=True)
    sweeps_exchange = Exchange("quire.sweeps", "direct", durable=True, no_declare=True)
    return (
        Queue(
            "conversion.v1",
            conversion_exchange,
            routing_key="conversion.v1",
            durable=True,
            queue_arguments=CONVERSION_QUEUE_ARGUMENTS,
            no_declare=True,
        ),
        Queue(
            "quire.sweeps",
            sweeps_exchange,
            routing_key="quire.sweeps",
            durable=True,
            queue_arguments=SWEEPS_QUEUE_ARGUMENTS,
            no_declare=True,
        ),
    )


def make_app(broker_url: str) -> Celery:
    app = Celery("quire_topology", broker=broker_url, set_as_current=False)
    app.conf.update(
        worker_consumer=(
            # QUIRE_TOPOLOGY_STOCK_CONSUMER=1 is only used by the negative test
            # that shows the stock consumer is refused celery_delayed_*.
            "celery.worker.consumer:Consumer"
            if os.environ.get("QUIRE_TOPOLOGY_STOCK_CONSUMER") == "1"
            else f"{__name__}:QuireConsumer"
        ),
        worker_detect_quorum_queues=True,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        broker_transport_options={"confirm_publish": True},
        broker_connection_retry_on_startup=True,
        task_ignore_result=True,
        task_queues=task_queues(),
        task_default_queue="conversion.v1",
        task_default_exchange="quire.conversion",
        task_default_routing_key="conversion.v1",
        task_create_missing_queues=False,
        # Celery publishes to the default exchange ("amq.default", routing key =
        # queue name) unless a route names BOTH exchange and routing_key. The
        # publisher may only write to quire.conversion / quire.sweeps, so every
        # route spells them out.
        task_routes={
            "quire_topology.sweep": {
                "queue": "quire.sweeps",
                "exchange": "quire.sweeps",
                "routing_key": "quire.sweeps",
            },
            "quire_topology.*": {
                "queue": "conversion.v1",
                "exchange": "quire.conversion",
                "routing_key": "conversion.v1",
            },
        },
        # Control/event plumbing: exclusive, non-durable (auto-delete) queues.
        # Exclusive queues are supported on RabbitMQ 3.x and 4.x (4.x removed
        # transient *non-exclusive* queues), and they need no quorum/global-QoS.
        control_queue_exclusive=True,
        control_queue_durable=False,
        event_queue_exclusive=True,
        event_queue_durable=False,
        worker_send_task_events=True,
        worker_hijack_root_logger=False,
        accept_content=["json"],
        task_serializer="json",
    )

    @app.task(name="quire_topology.record", acks_late=True)
    def record(token: str) -> None:
        out = os.environ.get("QUIRE_TOPOLOGY_OUT_DIR")
        if out:
            Path(out, f"{token}.done").write_text(token)

    @app.task(name="quire_topology.sweep", acks_late=True)
    def sweep(token: str) -> None:
        record(token)

    return app


app = make_app(
    os.environ.get(
        "QUIRE_TOPOLOGY_BROKER_URL", "amqp://quire_worker:quire-worker-dev@127.0.0.1:5672/quire"
    )
)
