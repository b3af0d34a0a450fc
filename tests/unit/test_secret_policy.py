"""The production profile's secret rule (conversion_jobs/secret_policy.py): pure functions of
the environment. The processes themselves: tests/e2e/test_production_secrets.py."""

from __future__ import annotations

import io
import secrets

import pytest

from conversion_jobs import secret_policy
from conversion_jobs.secret_policy import (
    DEVELOPMENT_VALUES,
    EXIT_CODE,
    SECRET_VARIABLES,
    enforce,
    problems,
    refusal,
)
from tests.services import secrets_env

PRODUCTION = {"DATABASE_URL": "postgres://quire@db/quire", "CELERY_BROKER_URL": "amqp://b/quire"}


def good_env(**overrides: str) -> dict[str, str]:
    env = {**PRODUCTION, **{name: secrets.token_urlsafe(48) for name in SECRET_VARIABLES}}
    env.update(overrides)
    return {k: v for k, v in env.items() if v is not None}


def test_problems__standalone_profile_requires_nothing():
    assert problems({}) == []
    assert secret_policy.development_defaults_in_use({}) == list(DEVELOPMENT_VALUES)


@pytest.mark.parametrize("url", ["DATABASE_URL", "CELERY_BROKER_URL"])
def test_problems__either_service_url_is_the_production_profile(url):
    assert problems({url: PRODUCTION[url]}) == [f"{name} is unset" for name in SECRET_VARIABLES]


def test_problems__proper_values_pass():
    assert problems(good_env()) == []
    assert refusal(good_env()) is None


@pytest.mark.parametrize("name", SECRET_VARIABLES)
def test_problems__each_variable_unset_or_empty_is_named(name):
    for value in (None, ""):
        env = good_env()
        env.pop(name)
        if value is not None:
            env[name] = value
        assert problems(env) == [f"{name} is unset"]


@pytest.mark.parametrize("name", list(DEVELOPMENT_VALUES))
def test_problems__the_published_development_value_is_refused(name):
    assert problems(good_env(**{name: DEVELOPMENT_VALUES[name]})) == [
        f"{name} holds a published development value (quire-dev-only-…)"
    ]
    # padded or re-cased copies of it too
    padded = "X" + DEVELOPMENT_VALUES[name].upper() + secrets.token_hex(16)
    assert len(problems(good_env(**{name: padded}))) == 1


@pytest.mark.parametrize(
    ("name", "value", "why"),
    [
        ("QUIRE_JWT_KEY", secrets.token_hex(15), "is shorter than 32 characters"),
        ("QUIRE_METRICS_TOKEN", "short", "is shorter than 32 characters"),
        ("DJANGO_SECRET_KEY", secrets.token_hex(24), "is shorter than 50 characters"),
        ("QUIRE_PSEUDONYM_KEY", "a" * 64, "has fewer than 10 distinct characters"),
        ("QUIRE_PASSWORD_KEY", "changeme" * 8, "has fewer than 10 distinct characters"),
    ],
)
def test_problems__weak_values_are_refused(name, value, why):
    assert problems(good_env(**{name: value})) == [f"{name} {why}"]


def test_problems__at_the_limits_are_accepted():
    env = good_env(
        QUIRE_JWT_KEY=secrets.token_hex(16),  # 32 characters
        DJANGO_SECRET_KEY=secrets.token_hex(25),  # 50 characters
        QUIRE_METRICS_TOKEN="0123456789" * 4,  # exactly 10 distinct
    )
    assert problems(env) == []


def test_problems__jwt_key_is_not_required_with_an_identity_provider():
    env = good_env(QUIRE_JWT_JWKS_URL="https://idp.example/jwks.json")
    env.pop("QUIRE_JWT_KEY")
    assert problems(env) == []
    env.pop("QUIRE_PSEUDONYM_KEY")
    assert problems(env) == ["QUIRE_PSEUDONYM_KEY is unset"]


def test_refusal__is_one_line_naming_every_variable_never_a_value():
    env = good_env(QUIRE_JWT_KEY=DEVELOPMENT_VALUES["QUIRE_JWT_KEY"])
    env.pop("DJANGO_SECRET_KEY")
    line = refusal(env)
    assert line is not None and "\n" not in line
    assert "DJANGO_SECRET_KEY is unset" in line and "QUIRE_JWT_KEY holds" in line
    for name in ("QUIRE_PSEUDONYM_KEY", "QUIRE_PASSWORD_KEY", "QUIRE_METRICS_TOKEN"):
        assert env[name] not in line and name not in line


def test_enforce__production_with_a_problem_exits_78_with_one_line():
    env = good_env()
    env.pop("QUIRE_PASSWORD_KEY")
    out = io.StringIO()
    with pytest.raises(SystemExit) as exited:
        enforce(env, out)
    assert exited.value.code == EXIT_CODE == 78
    assert out.getvalue().count("\n") == 1
    assert out.getvalue().startswith("quire: refusing to start in the production profile: ")
    assert "QUIRE_PASSWORD_KEY is unset" in out.getvalue()


def test_enforce__production_with_proper_values_says_nothing():
    out = io.StringIO()
    enforce(good_env(), out)
    assert out.getvalue() == ""


def test_enforce__standalone_warns_once_naming_the_defaults_in_use():
    out = io.StringIO()
    enforce({"QUIRE_JWT_KEY": secrets.token_urlsafe(48)}, out)
    line = out.getvalue()
    assert line.count("\n") == 1 and line.startswith("quire: WARNING standalone profile")
    assert "QUIRE_JWT_KEY" not in line
    for name in ("DJANGO_SECRET_KEY", "QUIRE_PSEUDONYM_KEY", "QUIRE_PASSWORD_KEY"):
        assert name in line


def test_secrets_env__the_test_runs_values_pass_the_policy_and_keep_what_is_set():
    generated = secrets_env(PRODUCTION)
    assert set(generated) == set(SECRET_VARIABLES)
    assert problems({**PRODUCTION, **generated}) == []
    assert "QUIRE_JWT_KEY" not in secrets_env({**PRODUCTION, "QUIRE_JWT_KEY": "set"})
    assert secrets_env({}) == {}
