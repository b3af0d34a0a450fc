"""Walk every job's audit hash chain (or one job's) and report any break. Exit 1 on a break."""

from __future__ import annotations

import uuid
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from conversion_jobs.services.audit import audit_chain_verify


class Command(BaseCommand):
    help = "Verify the per-job hash chains of execution_audit_event."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--job", type=uuid.UUID, default=None)

    def handle(self, *args: Any, **options: Any) -> None:
        checked, breaks = audit_chain_verify(job_id=options["job"])
        for b in breaks:
            self.stdout.write(f"BREAK job={b.job_id} event={b.event_id} seq={b.seq}: {b.reason}")
        if breaks:
            raise CommandError(f"{len(breaks)} break(s) in {checked} event(s)")
        self.stdout.write(f"ok: {checked} event(s), no breaks")
