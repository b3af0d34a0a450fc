"""Erase a tenant (docs/OPERABILITY.md "Tenant erasure"): ``manage.py erase_tenant TENANT``.
Cancels its live jobs, deletes its rows, then its objects; run it again after any interruption
(it resumes) - running it for an erased tenant changes nothing. Prints the erasure record (the
tenant as its pseudonym)."""

from __future__ import annotations

import getpass
import json
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from conversion_jobs.pseudonym import actor_pseudonym
from conversion_jobs.services.erasure import erasure_representation, tenant_erase


class Command(BaseCommand):
    help = "Erase every row and object of a tenant (resumable, idempotent)."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("tenant")

    def handle(self, *args: Any, **options: Any) -> None:
        actor = actor_pseudonym(tenant="operators", subject=getpass.getuser())
        record = tenant_erase(tenant=options["tenant"], actor=actor)
        self.stdout.write(json.dumps(erasure_representation(record), sort_keys=True))
        if record.finished_at is None:
            raise CommandError(
                f"erasure {record.id} stopped at step {record.step} (a job is still live):"
                " run the command again"
            )
