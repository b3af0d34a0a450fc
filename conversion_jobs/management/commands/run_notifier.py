"""The ``notifier`` process (Procfile; ADR 0020): delivers webhook messages until SIGTERM or
SIGINT, letting in-flight deliveries finish. It needs the database only: no broker, no worker
credentials, no converter sandbox."""

from __future__ import annotations

import signal
import threading
from typing import Any

from django.core.management.base import BaseCommand

from conversion_jobs.webhooks import notifier


class Command(BaseCommand):
    help = "Deliver webhook messages (the notifier process)."

    def handle(self, *args: Any, **options: Any) -> None:
        stop = threading.Event()

        def on_signal(signum: int, frame: Any) -> None:
            stop.set()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        self.stdout.write("notifier: delivering webhooks", ending="\n")
        self.stdout.flush()
        notifier.run(stop)
