"""The client's Retry-After handling and error typing (client/quire_client/_core.py, errors.py).

The server is the outside world from the client's view: a tiny ``httpx.MockTransport`` plays
it here only to pin the parsing and wait logic (what a 429 / 503 with each ``Retry-After`` form
makes the client do). Everything else is tested against a live stack
(tests/e2e/test_client_cli.py)."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import httpx
import pytest
from quire_client import AsyncClient, Client, RetryPolicy, errors, parse_retry_after
from quire_client.models import Problem

NOW = datetime(2026, 12, 3, 12, 0, 0, tzinfo=UTC)


def test_parse_retry_after__seconds_and_http_dates():
    assert parse_retry_after("7") == 7.0
    assert parse_retry_after(" 0 ") == 0.0
    later = format_datetime(NOW + timedelta(seconds=42), usegmt=True)
    assert parse_retry_after(later, now=NOW) == pytest.approx(42.0)
    earlier = format_datetime(NOW - timedelta(seconds=5), usegmt=True)
    assert parse_retry_after(earlier, now=NOW) == 0.0


@pytest.mark.parametrize("value", [None, "", "soon", "-3", "1.5e3x"])
def test_parse_retry_after__unreadable_is_none(value):
    assert parse_retry_after(value) is None


def test_retry_policy__caps_the_wait():
    policy = RetryPolicy(max_attempts=3, max_wait_s=10.0, backoff_s=1.0)
    assert policy.delay(1, 300.0) == 10.0
    assert policy.delay(1, 2.0) == 2.0
    assert 0.5 <= policy.delay(1, None) <= 1.0
    assert policy.delay(20, None) == 10.0


def _server(answers: list[httpx.Response], seen: list[httpx.Request]) -> httpx.MockTransport:
    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return answers.pop(0)

    return httpx.MockTransport(handle)


def _problem(status: int, code: str, **headers: str) -> httpx.Response:
    body = {
        "type": f"https://quire.dev/problems/{code}",
        "title": code,
        "status": status,
        "code": code,
    }
    return httpx.Response(
        status, json=body, headers={"Content-Type": "application/problem+json", **headers}
    )


def test_client__429_waits_as_retry_after_says_then_succeeds():
    seen: list[httpx.Request] = []
    date = format_datetime(datetime.now(UTC) + timedelta(seconds=4), usegmt=True)
    answers = [
        _problem(429, "tenant_quota_exceeded", **{"Retry-After": "3"}),
        _problem(503, "capacity_exceeded", **{"Retry-After": date}),
        _problem(503, "database_unavailable", **{"Retry-After": "999"}),
        httpx.Response(200, json={"conversions": {}}),
    ]
    waits: list[float] = []
    with Client(
        "http://quire.test",
        "t",
        transport=_server(answers, seen),
        retry=RetryPolicy(max_attempts=5, max_wait_s=20.0),
    ) as client:
        client._sleep = waits.append
        assert client.capabilities() == {"conversions": {}}
    assert len(seen) == 4
    assert waits[0] == 3.0
    assert 2.0 <= waits[1] <= 4.0  # an HTTP date, a second or two of clock in between
    assert waits[2] == 20.0  # capped


def test_client__gives_up_after_max_attempts_with_the_typed_error():
    seen: list[httpx.Request] = []
    answers = [_problem(429, "tenant_quota_exceeded", **{"Retry-After": "1"}) for _ in range(3)]
    with Client(
        "http://quire.test",
        "t",
        transport=_server(answers, seen),
        retry=RetryPolicy(max_attempts=3),
    ) as client:
        client._sleep = lambda s: None
        with pytest.raises(errors.TenantQuotaExceeded) as caught:
            client.capabilities()
    assert len(seen) == 3
    assert caught.value.retry_after == 1.0
    assert isinstance(caught.value, errors.ClientError)
    assert not isinstance(caught.value, errors.ServerError)


def test_async_client__honours_retry_after_too():
    seen: list[httpx.Request] = []
    answers = [
        _problem(503, "storage_unavailable", **{"Retry-After": "2"}),
        httpx.Response(200, json={"ok": True}),
    ]
    waits: list[float] = []

    async def run() -> dict:
        async def sleep(s: float) -> None:
            waits.append(s)

        async with AsyncClient("http://quire.test", "t", transport=_async(answers, seen)) as client:
            client._sleep = sleep
            return await client.capabilities()

    assert asyncio.run(run()) == {"ok": True}
    assert waits == [2.0]


def _async(answers: list[httpx.Response], seen: list[httpx.Request]) -> httpx.MockTransport:
    return _server(answers, seen)


@pytest.mark.parametrize(
    ("status", "code", "cls"),
    [
        (404, "not_found", errors.NotFound),
        (409, "too_late", errors.TooLate),
        (415, "unsupported_media_type", errors.UnsupportedMediaType),
        (503, "capacity_exceeded", errors.CapacityExceeded),
        (409, "brand_new_conflict", errors.Conflict),
        (418, "brand_new_code", errors.ClientError),
        (503, "brand_new_outage", errors.ServiceUnavailable),
        (502, "bad_gateway", errors.ServerError),
        # a known 5xx code sent with a 4xx status stays a client error (never counted as 5xx)
        (400, "internal_error", errors.ClientError),
    ],
)
def test_error_for__typed_from_code_within_the_status_family(status, code, cls):
    error = errors.error_for(Problem.from_dict({"code": code, "title": code}, status=status))
    assert type(error) is cls
    assert error.code == code
    assert error.status == status
    assert isinstance(error, errors.QuireError)
    assert isinstance(error, errors.ClientError) == (status < 500)
