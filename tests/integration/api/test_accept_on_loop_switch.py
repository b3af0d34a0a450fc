"""When the web accepts a small upload on the event loop (ADR 0017 session 11), and when every
submission stays on the sync path: on in the production profile as shipped; off on SQLite (the
standalone profile), by ``QUIRE_ACCEPT_ON_LOOP=0``, without inline sources, without the
background publisher, with tracing on, and with an API middleware chain other than the shipped
one or a setting that makes it redirect or refuse by itself."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from django.conf import settings as django_settings

from conversion_jobs.observability import tracing
from conversion_jobs.services import publisher
from conversion_jobs.web import handler as web

POSTGRES = django_settings.DATABASES["default"]["ENGINE"].endswith("postgresql")


@pytest.fixture
def background_publisher(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(publisher, "current", lambda: SimpleNamespace(submit=lambda item: True))


def _quire(settings: Any, **changes: Any) -> None:
    settings.QUIRE = {**settings.QUIRE, **changes}


def test_on_as_shipped_in_the_production_profile_only(background_publisher):
    """Postgres: on; SQLite: every submission on the sync path."""
    assert web.loop_accept_possible() is POSTGRES
    assert (web.QuireASGIHandler(accept_on_loop=True).loop_handler is not None) is POSTGRES
    assert web.QuireASGIHandler().loop_handler is None  # the handler's own switch


@pytest.mark.postgres
@pytest.mark.parametrize(
    "switch",
    [
        "QUIRE_ACCEPT_ON_LOOP=0",
        "inline sources off",
        "no background publisher",
        "tracing on",
        "another API middleware",
        "SECURE_SSL_REDIRECT",
        "PREPEND_WWW",
        "DISALLOWED_USER_AGENTS",
    ],
)
def test_postgres__each_switch_turns_it_off(switch, settings, monkeypatch, background_publisher):
    if switch == "QUIRE_ACCEPT_ON_LOOP=0":
        _quire(settings, ACCEPT_ON_LOOP=False)
    elif switch == "inline sources off":
        _quire(settings, INLINE_SOURCE_MAX_BYTES=0)
    elif switch == "no background publisher":
        monkeypatch.setattr(publisher, "current", lambda: None)
    elif switch == "tracing on":
        monkeypatch.setattr(tracing, "enabled", lambda: True)
    elif switch == "another API middleware":
        settings.MIDDLEWARE = [*settings.MIDDLEWARE, "django.middleware.gzip.GZipMiddleware"]
    elif switch == "SECURE_SSL_REDIRECT":
        settings.SECURE_SSL_REDIRECT = True
    elif switch == "PREPEND_WWW":
        settings.PREPEND_WWW = True
    else:
        settings.DISALLOWED_USER_AGENTS = ["curl"]
    assert not web.loop_accept_possible()
    assert web.QuireASGIHandler(accept_on_loop=True).loop_handler is None
