"""Install the beat schedule of ``beat_schedules/`` into django-celery-beat's tables."""

from __future__ import annotations

import math
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand
from django.db import transaction
from django_celery_beat.models import IntervalSchedule, PeriodicTask

from beat_schedules.schedule import sweeps
from conversion_jobs.services.sweep_health import sweep_statuses_install


class Command(BaseCommand):
    help = "Create or update one periodic task per Quire sweep (idempotent)."

    def handle(self, *args: Any, **options: Any) -> None:
        with transaction.atomic():
            names = []
            for sweep in sweeps():
                # IntervalSchedule counts whole units: sub-second ticks use microseconds.
                if sweep.every_s >= 1 and float(sweep.every_s).is_integer():
                    every, period = int(sweep.every_s), IntervalSchedule.SECONDS
                else:
                    every, period = int(sweep.every_s * 1_000_000), IntervalSchedule.MICROSECONDS
                interval, _ = IntervalSchedule.objects.get_or_create(every=every, period=period)
                PeriodicTask.objects.update_or_create(
                    name=sweep.name,
                    defaults={
                        "task": sweep.task,
                        "interval": interval,
                        "enabled": True,
                        "queue": settings.SWEEP_QUEUE,
                        "routing_key": settings.SWEEP_QUEUE,
                        "exchange": "quire.sweeps",
                        "expire_seconds": max(2, math.ceil(sweep.every_s * 5)),
                        "description": sweep.why,
                    },
                )
                names.append(sweep.name)
            stale = PeriodicTask.objects.filter(name__startswith="quire: ").exclude(name__in=names)
            stale.delete()
            # Each sweep's row for /health/ready and the metric (services/sweep_health.py).
            sweep_statuses_install(intervals={s.key: s.every_s for s in sweeps()})
        self.stdout.write(f"installed {len(names)} sweeps")
