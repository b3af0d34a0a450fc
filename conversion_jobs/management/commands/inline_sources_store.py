"""Move every inline source to the artifact store and repoint its job (the rollback of
migration 0012, docs/MIGRATION_ROLLBACK.md). Idempotent; safe while the service runs, but set
``QUIRE_INLINE_SOURCE_MAX_BYTES=0`` on every web first, or new inline sources keep arriving."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from conversion_jobs.services.sources import inline_sources_store


class Command(BaseCommand):
    help = "Write every inline source to the artifact store and repoint its job."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--batch", type=int, default=100)

    def handle(self, *args: Any, **options: Any) -> None:
        moved = inline_sources_store(batch=options["batch"])
        self.stdout.write(f"{moved} inline sources stored")
