"""Which secrets a process needs, and the start-up refusal (docs/OPERABILITY.md §2 "Required
in production").

The standalone profile runs out of the box on published development values (``quire-dev-only-…``)
and says so in one warning line at start. The production profile (``DATABASE_URL`` or
``CELERY_BROKER_URL`` set: :func:`production_profile`, which the settings ask too) refuses to
start while a secret it uses is unset, holds a development value, or is weak: anyone who has
read this repository could otherwise mint a token for any tenant and reverse the audit
pseudonyms (docs/THREAT_MODEL.md).

:func:`enforce` runs when the ``project`` package is imported, which every process does first
(``manage.py`` through the settings, ``celery -A project``; gunicorn's master runs it when it
loads ``conversion_jobs.web.worker``), so each process says it once, in one line, before it
binds, connects or forks anything. Pure functions of the environment otherwise (no Django).
"""

from __future__ import annotations

import os
import secrets
import sys
from collections.abc import Mapping
from typing import TextIO

#: The published development values: the standalone profile's defaults, never accepted in the
#: production profile.
DEVELOPMENT_VALUES = {
    "DJANGO_SECRET_KEY": "quire-dev-only-secret-key-change-me-0123456789abcdef",
    "QUIRE_JWT_KEY": "quire-dev-only-jwt-key-change-me-0123456789abcdef",
    "QUIRE_PSEUDONYM_KEY": "quire-dev-only-pseudonym-key-change-me",
    "QUIRE_PASSWORD_KEY": "quire-dev-only-password-key-change-me",
}
DEVELOPMENT_MARK = "quire-dev-only"
#: Every secret the production profile may require (``QUIRE_JWT_KEY`` only without an identity
#: provider: with ``QUIRE_JWT_JWKS_URL`` nothing verifies with it).
SECRET_VARIABLES = (*DEVELOPMENT_VALUES, "QUIRE_METRICS_TOKEN")
#: Strength rule: Django's own for its key (check --deploy's security.W009 wants 50 characters),
#: 32 characters for the others (an HS256 key at least as long as the hash, RFC 7518 §3.2), and
#: at least this many distinct characters (refuses "aaaa…" or one word repeated; any generated
#: value passes).
MIN_LENGTH = {"DJANGO_SECRET_KEY": 50}
DEFAULT_MIN_LENGTH = 32
MIN_DISTINCT = 10
#: EX_CONFIG (sysexits.h): a configuration error, not a crash; supervisors should not retry.
EXIT_CODE = 78
HOW_TO_GENERATE = "python -m conversion_jobs.secret_policy"


def production_profile(environ: Mapping[str, str]) -> bool:
    """The profile ``project/settings.py`` runs: production when either service URL is set."""
    return bool(environ.get("DATABASE_URL") or environ.get("CELERY_BROKER_URL"))


def required_secrets(environ: Mapping[str, str]) -> tuple[str, ...]:
    """What the production profile uses, so requires."""
    return tuple(
        name
        for name in SECRET_VARIABLES
        if not (name == "QUIRE_JWT_KEY" and environ.get("QUIRE_JWT_JWKS_URL"))
    )


def secret_problem(name: str, value: str | None) -> str | None:
    """Why ``value`` may not be ``name`` in production (never quoting the value), or None."""
    if not value:
        return f"{name} is unset"
    if DEVELOPMENT_MARK in value.lower():
        return f"{name} holds a published development value ({DEVELOPMENT_MARK}-…)"
    min_length = MIN_LENGTH.get(name, DEFAULT_MIN_LENGTH)
    if len(value) < min_length:
        return f"{name} is shorter than {min_length} characters"
    if len(set(value)) < MIN_DISTINCT:
        return f"{name} has fewer than {MIN_DISTINCT} distinct characters"
    return None


def problems(environ: Mapping[str, str]) -> list[str]:
    """Every reason the production profile refuses to start; empty in the standalone profile."""
    if not production_profile(environ):
        return []
    found = (secret_problem(name, environ.get(name)) for name in required_secrets(environ))
    return [problem for problem in found if problem]


def refusal(environ: Mapping[str, str]) -> str | None:
    """The one line a refusing process prints, or None."""
    found = problems(environ)
    if not found:
        return None
    return (
        f"quire: refusing to start in the production profile: {'; '.join(found)}. "
        f"Set each to a random value of at least {DEFAULT_MIN_LENGTH} characters "
        f"(DJANGO_SECRET_KEY {MIN_LENGTH['DJANGO_SECRET_KEY']}); `{HOW_TO_GENERATE}` prints a "
        "set (docs/OPERABILITY.md §2 Required in production)"
    )


def development_defaults_in_use(environ: Mapping[str, str]) -> list[str]:
    """The secrets a standalone process falls back to development values for."""
    if production_profile(environ):
        return []
    return [name for name in DEVELOPMENT_VALUES if not environ.get(name)]


#: Whether this process (or the one it was forked from) has checked its own environment.
_checked = False


def enforce(environ: Mapping[str, str] = os.environ, stream: TextIO | None = None) -> None:
    """Production: exit :data:`EXIT_CODE` with one line on stderr if a secret is missing or
    weak. Standalone: one warning line if development values are in use. The process's own
    environment is checked once: the web's gunicorn master checks it when it loads the worker
    class (``conversion_jobs.web.worker``), and the workers it forks import ``project`` later."""
    global _checked
    if environ is os.environ:
        if _checked:
            return
        _checked = True
    stream = stream or sys.stderr
    line = refusal(environ)
    if line:
        print(line, file=stream, flush=True)
        raise SystemExit(EXIT_CODE)
    defaults = development_defaults_in_use(environ)
    if defaults:
        print(
            "quire: WARNING standalone profile: published development secrets in use "
            f"({', '.join(defaults)}); never expose this instance (docs/OPERABILITY.md §2)",
            file=stream,
            flush=True,
        )


def generated() -> dict[str, str]:
    """A fresh random value for every secret (each passes :func:`secret_problem`)."""
    return {name: secrets.token_urlsafe(48) for name in SECRET_VARIABLES}


if __name__ == "__main__":
    # `python -m conversion_jobs.secret_policy`: NAME=value lines (an environment file)
    for name, value in generated().items():
        print(f"{name}={value}")
