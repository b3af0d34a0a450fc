"""The webhook transport's address checks (docs/THREAT_MODEL.md "Webhooks"): every form of a
non-global address the issue lists is refused with its code, at registration (a literal) and
after resolution (a name, or the integer and short IPv4 forms that ``getaddrinfo`` reads)."""

from __future__ import annotations

import ipaddress

import pytest

from conversion_jobs.webhooks import transport
from conversion_jobs.webhooks.transport import Policy, Refused, address_refusal, url_check

NONE = Policy((), frozenset(), transport.DEFAULT_PORT_RANGES)


def _refusal(url: str, policy: Policy = NONE) -> str:
    """The code ``url`` is refused with: at registration, or else when resolved."""
    try:
        target = url_check(url, policy)
        transport.resolve(target, policy)
    except Refused as refused:
        return refused.code
    return "admitted"


@pytest.mark.parametrize(
    ("url", "code"),
    [
        ("http://127.0.0.1/", "address_loopback"),
        ("http://[::1]/", "address_loopback"),
        ("http://[::ffff:127.0.0.1]/", "address_loopback"),
        ("http://0x7f000001/", "address_loopback"),
        ("http://2130706433/", "address_loopback"),
        ("http://127.1/", "address_loopback"),
        ("http://0177.0.0.1/", "address_loopback"),
        ("http://0.0.0.0/", "address_unspecified"),
        ("http://[::]/", "address_unspecified"),
        ("http://169.254.169.254/latest/meta-data/", "address_link_local"),
        ("http://[fe80::1]/", "address_link_local"),
        ("http://10.0.0.1/", "address_private"),
        ("http://192.168.1.1/", "address_private"),
        ("http://172.16.0.1/", "address_private"),
        ("http://100.64.0.1/", "address_shared"),
        ("http://224.0.0.1/", "address_multicast"),
        ("http://[ff02::1]/", "address_multicast"),
        ("http://[fc00::1]/", "address_private"),
        ("http://240.0.0.1/", "address_reserved"),
        # 6to4 and NAT64 forms of 127.0.0.1 (GO-2026-5244), IPv4-compatible, Teredo
        ("http://[2002:7f00:1::]/", "address_loopback"),
        ("http://[2002:7f00:1:1::1]/", "address_loopback"),
        ("http://[64:ff9b::7f00:1]/", "address_loopback"),
        ("http://[64:ff9b::127.0.0.1]/", "address_loopback"),
        ("http://[64:ff9b:1::7f00:1]/", "address_nat64_local"),
        ("http://[::127.0.0.1]/", "address_loopback"),
        ("http://[2002:a9fe:a9fe::]/", "address_link_local"),
        ("http://[64:ff9b::a9fe:a9fe]/", "address_link_local"),
        ("http://[::ffff:10.0.0.1]/", "address_private"),
        ("http://[2001:0:4136:e378:8000:63bf:80ff:fffe]/", "address_loopback"),
        ("http://localhost/", "address_loopback"),
    ],
)
def test_transport__non_global_address_refused(url, code):
    assert _refusal(url) == code


@pytest.mark.parametrize(
    ("url", "code"),
    [
        ("ftp://example.com/", "url_scheme_not_allowed"),
        ("file:///etc/passwd", "url_scheme_not_allowed"),
        ("https://user:pw@example.com/", "url_credentials"),
        ("https://user@example.com/", "url_credentials"),
        ("https://example.com:8443/", "port_not_allowed"),
        ("http://example.com:22/", "port_not_allowed"),
        ("https:///nohost", "url_invalid"),
        ("https://example.com:99999/", "url_invalid"),
        ("https://exa mple.com/", "url_invalid"),
    ],
)
def test_transport__url_refused(url, code):
    with pytest.raises(Refused) as refused:
        url_check(url, NONE)
    assert refused.value.code == code


@pytest.mark.parametrize(
    "address", ["8.8.8.8", "1.1.1.1", "2606:4700:4700::1111", "2002:808:808::1", "64:ff9b::808:808"]
)
def test_transport__global_address_admitted(address):
    assert address_refusal(ipaddress.ip_address(address)) is None


def test_transport__allowlist_admits_cidr_and_name():
    policy = Policy(
        (ipaddress.ip_network("127.0.0.0/8"),), frozenset({"localhost"}), ((80, 80), (8080, 8080))
    )
    assert _refusal("http://127.0.0.1:8080/hook", policy) == "admitted"
    assert _refusal("http://localhost:8080/hook", policy) == "admitted"
    # a CIDR admits only its own addresses: the mapped IPv6 form is another address
    assert _refusal("http://[::ffff:127.0.0.1]:8080/", policy) == "address_loopback"
    assert _refusal("http://10.0.0.1:8080/", policy) == "address_private"
    assert _refusal("http://127.0.0.1:8081/", policy) == "port_not_allowed"


def test_transport__policy_from_settings(settings):
    settings.QUIRE = {
        **settings.QUIRE,
        "WEBHOOK_ALLOWLIST": " 127.0.0.0/8, Receiver.Internal. ,::1",
        "WEBHOOK_ALLOWED_PORTS": "8080, 9000-9010",
    }
    policy = Policy.from_settings()
    assert policy.hosts == {"receiver.internal"}
    assert ipaddress.ip_network("::1/128") in policy.networks
    assert [p for p in (80, 443, 8080, 9000, 9005, 9010) if policy.admits_port(p)] == [
        80,
        443,
        8080,
        9000,
        9005,
        9010,
    ]
    assert not policy.admits_port(9011) and not policy.admits_port(22)


def test_transport__host_header_and_target():
    target = url_check("https://Hooks.Example.com:443/a/b?x=1", NONE)
    assert (target.host, target.port, target.target, target.host_header) == (
        "hooks.example.com",
        443,
        "/a/b?x=1",
        "hooks.example.com",
    )
    policy = Policy((), frozenset(), ((80, 80), (443, 443), (8080, 8080)))
    assert url_check("http://h.example:8080", policy).host_header == "h.example:8080"
    assert url_check("http://h.example:8080", policy).target == "/"
