"""Empty ``PROMETHEUS_MULTIPROC_DIR`` before the processes of a new release start (the Procfile's
``release``): prometheus-client's multiprocess files must not outlive the processes that wrote
them across deploys. Counters restart from zero, which Prometheus handles as a reset."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand


class Command(BaseCommand):
    help = "Reset the prometheus-client multiprocess directory."

    def handle(self, *args: Any, **options: Any) -> None:
        target = Path(os.environ.get("PROMETHEUS_MULTIPROC_DIR") or "var/metrics")
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True, exist_ok=True)
        self.stdout.write(f"metrics directory reset: {target}")
