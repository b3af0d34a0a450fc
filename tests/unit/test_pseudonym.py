"""Keyed pseudonyms (``conversion_jobs/pseudonym.py``): remembered per key, never across keys."""

import hashlib
import hmac

from django.test import override_settings

from conversion_jobs.pseudonym import actor_pseudonym, pseudonym


def _quire(key: str) -> dict:
    from django.conf import settings

    return {**settings.QUIRE, "PSEUDONYM_KEY": key}


def test_pseudonym__is_the_keyed_hmac_of_kind_and_value():
    with override_settings(QUIRE=_quire("k1")):
        digest = hmac.new(b"k1", b"tenant:acme", hashlib.sha256).hexdigest()
        assert pseudonym("tenant", "acme") == f"t_{digest[:24]}"
        assert pseudonym("tenant", "acme") == f"t_{digest[:24]}"  # remembered: the same


def test_pseudonym__a_rotated_key_gives_another_one():
    with override_settings(QUIRE=_quire("k1")):
        first = pseudonym("tenant", "acme")
    with override_settings(QUIRE=_quire("k2")):
        second = pseudonym("tenant", "acme")
    assert first != second
    assert second == "t_" + hmac.new(b"k2", b"tenant:acme", hashlib.sha256).hexdigest()[:24]


def test_pseudonym__kinds_and_values_are_apart():
    with override_settings(QUIRE=_quire("k1")):
        assert pseudonym("tenant", "acme") != pseudonym("tenant", "acme2")
        assert pseudonym("tenant", "a/b") != actor_pseudonym(tenant="a", subject="b")
