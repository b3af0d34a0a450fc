"""Show or set a tenant's fair share (docs/OPERABILITY.md "Fair share"): its weight and its
optional cap on running work. Without a tenant: every tenant's weight, cap, backlog, running
work and share of pages over the last ``QUIRE_FAIR_SHARE_WINDOW_S``."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError

from conversion_jobs.services import fair


class Command(BaseCommand):
    help = "Show or set tenants' fair-share weight and running cap."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("tenant", nargs="?", default=None)
        parser.add_argument("--weight", type=int, default=None, help="1-1000 (default 1)")
        cap = parser.add_mutually_exclusive_group()
        cap.add_argument("--cap", type=int, default=None, help="most units running at once")
        cap.add_argument("--no-cap", action="store_true", help="remove the running cap")

    def handle(self, *args: Any, **options: Any) -> None:
        tenant = options["tenant"]
        if tenant is not None:
            try:
                fair.tenant_share_set(
                    tenant=tenant,
                    weight=options["weight"],
                    running_cap=options["cap"],
                    no_cap=options["no_cap"],
                )
            except ValueError as exc:
                raise CommandError(str(exc)) from exc
        elif options["weight"] is not None or options["cap"] is not None or options["no_cap"]:
            raise CommandError("name the tenant to change")
        self.stdout.write("tenant\tweight\tcap\tbacklog\tbacklog_cost\trunning\tpages\tshare")
        for row in fair.tenants_fairness():
            if tenant is not None and row.tenant != tenant:
                continue
            cap = "-" if row.running_cap is None else str(row.running_cap)
            self.stdout.write(
                f"{row.tenant}\t{row.weight}\t{cap}\t{row.backlog_units}\t{row.backlog_cost}"
                f"\t{row.running}\t{row.pages_window}\t{row.page_share:.3f}"
            )
