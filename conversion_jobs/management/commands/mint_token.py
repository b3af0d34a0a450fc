"""Mint a bearer JWT for development: ``manage.py mint_token --tenant T --scope jobs:submit …``."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from conversion_jobs.api.auth import SCOPES, token_mint


class Command(BaseCommand):
    help = "Print a signed bearer token for a tenant and scopes."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--tenant", required=True)
        parser.add_argument("--subject", default="dev")
        parser.add_argument(
            "--scope", nargs="+", default=["jobs:submit", "jobs:read", "jobs:cancel"]
        )
        parser.add_argument("--ttl", type=int, default=3600, help="seconds")

    def handle(self, *args: Any, **options: Any) -> None:
        scopes = [s for chunk in options["scope"] for s in chunk.replace(",", " ").split()]
        unknown = set(scopes) - set(SCOPES)
        if unknown:
            raise CommandError(f"unknown scope(s): {', '.join(sorted(unknown))}")
        if settings.QUIRE["JWT_JWKS_URL"]:
            # Tokens are verified against the identity provider's keys only: a shared-secret
            # token would be refused, and production has no QUIRE_JWT_KEY to sign it with.
            raise CommandError("QUIRE_JWT_JWKS_URL is set: tokens come from the identity provider")
        self.stdout.write(
            token_mint(
                tenant=options["tenant"],
                subject=options["subject"],
                scopes=scopes,
                ttl_s=options["ttl"],
            )
        )
