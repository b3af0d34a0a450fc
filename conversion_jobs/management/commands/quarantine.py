"""Quarantined documents (docs/OPERABILITY.md "Quarantine"): ``list`` them (tenants as their
pseudonyms, never the document's digest) or ``lift`` one by its id."""

from __future__ import annotations

import getpass
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from conversion_jobs.models import DocumentQuarantine
from conversion_jobs.pseudonym import actor_pseudonym, pseudonym
from conversion_jobs.services.quarantine import document_quarantine_lift


class Command(BaseCommand):
    help = "List quarantined documents, or lift a quarantine (by id)."

    def add_arguments(self, parser: Any) -> None:
        sub = parser.add_subparsers(dest="action", required=True)
        listing = sub.add_parser("list", help="quarantined documents, newest first")
        listing.add_argument("--tenant", default=None, help="only this tenant's")
        listing.add_argument("--all", action="store_true", help="lifted ones and counts too")
        lift = sub.add_parser("lift", help="lift quarantines: their documents convert again")
        lift.add_argument("ids", nargs="+", type=int)

    def handle(self, *args: Any, **options: Any) -> None:
        if options["action"] == "list":
            rows = DocumentQuarantine.objects.order_by("-updated_at")
            if not options["all"]:
                rows = rows.filter(quarantined_at__isnull=False)
            if options["tenant"]:
                rows = rows.filter(tenant=options["tenant"])
            self.stdout.write("id\ttenant\tengine\tcrashes\thosts\tquarantined_at\tjob")
            for row in rows.iterator():
                self.stdout.write(
                    f"{row.id}\t{pseudonym('tenant', row.tenant)}\t{row.engine_version}\t"
                    f"{row.crashes}\t{row.hosts}\t"
                    f"{row.quarantined_at.isoformat() if row.quarantined_at else '-'}\t"
                    f"{row.job_id or '-'}"
                )
            return
        actor = actor_pseudonym(tenant="operators", subject=getpass.getuser())
        missing = []
        for quarantine_id in options["ids"]:
            if document_quarantine_lift(quarantine_id=quarantine_id, actor=actor):
                self.stdout.write(f"{quarantine_id}: lifted")
            else:
                missing.append(quarantine_id)
                self.stdout.write(f"{quarantine_id}: not quarantined")
        if missing:
            raise CommandError(f"{len(missing)} id(s) were not quarantined")
