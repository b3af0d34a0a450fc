"""The webhook transport, safe against SSRF (docs/THREAT_MODEL.md "Webhooks", ADR 0020).

A delivery resolves the receiver's name once, refuses every address that is not globally
routable - including the IPv4-mapped, IPv4-compatible, NAT64 and 6to4 / Teredo forms of one,
which ``ipaddress.is_global`` (Python 3.11) calls global - and connects to that pinned address,
sending the name as ``Host`` and as the TLS server name (the certificate is checked against the
name). No redirect is followed, only ports 80 and 443 are dialled unless the operator allows
more, and at most ``EXCERPT_BYTES`` of the answer are read. The operator's allowlist
(``QUIRE_WEBHOOK_ALLOWLIST``: CIDRs and host names) admits internal receivers. Every refusal has
a stable code (``Refused.code``), recorded on the attempt. The same checks run when an endpoint is
registered (``url_check``) and again at every delivery (``post``): DNS may have changed since.
"""

from __future__ import annotations

import ipaddress
import socket
import time
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import Any
from urllib.parse import SplitResult, urlsplit

import httpx
from django.conf import settings

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
EXCERPT_BYTES = 1024
DEFAULT_PORTS = frozenset({80, 443})
DEFAULT_PORT_RANGES = ((80, 80), (443, 443))

_SHARED = ipaddress.ip_network("100.64.0.0/10")  # CGNAT (RFC 6598)
_NAT64 = ipaddress.ip_network("64:ff9b::/96")  # well-known NAT64 prefix (RFC 6052)
_NAT64_LOCAL = ipaddress.ip_network("64:ff9b:1::/48")  # local-use NAT64 (RFC 8215)
_COMPATIBLE = ipaddress.ip_network("::/96")  # deprecated IPv4-compatible (RFC 4291 §2.5.5.1)


class Refused(Exception):
    """The transport refused the target before connecting (``code``: the stable reason)."""

    def __init__(self, code: str, detail: str = "") -> None:
        super().__init__(detail or code)
        self.code = code


@dataclass(frozen=True)
class Target:
    scheme: str
    host: str  # lower case, IPv6 without brackets
    port: int
    #: path and query, as sent
    target: str
    #: the Host header (the name, with a port that is not the scheme's default)
    host_header: str


@dataclass(frozen=True)
class Policy:
    networks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]
    hosts: frozenset[str]
    #: port ranges (inclusive) besides which nothing is dialled
    ports: tuple[tuple[int, int], ...]

    @classmethod
    def from_settings(cls) -> Policy:
        networks, hosts = [], set()
        for item in settings.QUIRE["WEBHOOK_ALLOWLIST"].split(","):
            item = item.strip().lower()
            if not item:
                continue
            try:
                networks.append(ipaddress.ip_network(item, strict=False))
            except ValueError:
                hosts.add(item.rstrip("."))
        ports = [(p, p) for p in sorted(DEFAULT_PORTS)]
        for item in settings.QUIRE["WEBHOOK_ALLOWED_PORTS"].split(","):
            low, _, high = item.strip().partition("-")
            if low:
                ports.append((int(low), int(high or low)))
        return cls(tuple(networks), frozenset(hosts), tuple(ports))

    def admits_port(self, port: int) -> bool:
        return any(low <= port <= high for low, high in self.ports)

    def admits(self, address: IPAddress) -> bool:
        return any(address in network for network in self.networks)


def url_check(url: str, policy: Policy | None = None) -> Target:
    """The URL's parts, or Refused: not http(s), credentials in it, no host, a port not allowed.
    A literal address is checked here too (a name is checked when resolved)."""
    policy = policy or Policy.from_settings()
    parts, port = _url_parts(url)
    host = (parts.hostname or "").rstrip(".")
    if not host or any(c.isspace() for c in url):
        raise Refused("url_invalid")
    default = 443 if parts.scheme == "https" else 80
    port = port or default
    if not policy.admits_port(port):
        raise Refused("port_not_allowed")
    _literal_check(host, policy)
    name = f"[{host}]" if ":" in host else host
    host_header = name if port == default else f"{name}:{port}"
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return Target(parts.scheme, host, port, target, host_header)


def _url_parts(url: str) -> tuple[SplitResult, int | None]:
    """The URL split, and its explicit port; Refused: unparsable, not http(s), credentials."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise Refused("url_invalid") from exc
    if parts.scheme not in ("https", "http"):
        raise Refused("url_scheme_not_allowed")
    if parts.username is not None or parts.password is not None:
        raise Refused("url_credentials")
    return parts, port


def _literal_check(host: str, policy: Policy) -> None:
    """Refused when ``host`` is an address literal the policy does not admit."""
    literal = _literal(host)
    if literal is not None and host not in policy.hosts and not policy.admits(literal):
        code = address_refusal(literal)
        if code:
            raise Refused(code)


def _literal(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def embedded_ipv4(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 form carries: IPv4-mapped, NAT64 (well-known prefix), 6to4,
    Teredo (its client), IPv4-compatible. None: it carries none."""
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address in _NAT64:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    if address.sixtofour is not None:
        return address.sixtofour
    if address.teredo is not None:
        return address.teredo[1]
    if address in _COMPATIBLE and int(address) > 1:  # :: and ::1 are themselves
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


def _category(address: IPAddress) -> str | None:
    if address.is_unspecified:
        return "address_unspecified"
    if address.is_loopback:
        return "address_loopback"
    if address.is_link_local:
        return "address_link_local"
    if address.is_multicast:
        return "address_multicast"
    if isinstance(address, ipaddress.IPv4Address) and address in _SHARED:
        return "address_shared"
    if address.is_reserved:
        return "address_reserved"
    if address.is_private:
        return "address_private"
    if not address.is_global:
        return "address_not_global"
    return None


def address_refusal(address: IPAddress) -> str | None:
    """Why ``address`` may not be dialled (a stable code), or None: it is globally routable.
    An IPv6 form that carries an IPv4 address is judged by that address: alone for the forms
    that are only a way to write it (IPv4-mapped, IPv4-compatible, NAT64, whose IPv6 prefixes
    Python calls private or reserved), as well as by itself for 6to4 and Teredo."""
    if isinstance(address, ipaddress.IPv6Address):
        if address in _NAT64_LOCAL:
            return "address_nat64_local"
        inner = embedded_ipv4(address)
        if inner is not None:
            code = _category(inner)
            if (
                code
                or address.ipv4_mapped is not None
                or address in _NAT64
                or address in _COMPATIBLE
            ):
                return code
    return _category(address)


def resolve(target: Target, policy: Policy) -> IPAddress:
    """The one address this delivery dials: the name resolved once (``getaddrinfo``, which
    also reads the integer and short IPv4 forms such as ``2130706433`` and ``127.1``), every
    address it gave checked, the first one pinned. Raises Refused."""
    try:
        infos = socket.getaddrinfo(target.host, target.port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise Refused("dns_failed") from exc
    addresses = [ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos]
    if not addresses:
        raise Refused("dns_failed")
    if target.host not in policy.hosts:
        for address in addresses:
            if policy.admits(address):
                continue
            code = address_refusal(address)
            if code:
                raise Refused(code)
    return addresses[0]


@dataclass(frozen=True)
class Answer:
    """What one delivery attempt got: a status (None when none came back), the time to it, at
    most 1 KB of the body, a failure or refusal code, the ``Retry-After`` it asked for."""

    status: int | None
    latency_ms: int | None
    excerpt: str
    error: str | None
    refused: bool = False
    retry_after_s: float | None = None


def post(url: str, body: bytes, headers: dict[str, str], *, client: httpx.Client) -> Answer:
    """POST ``body`` to ``url`` through the pinned address. Never raises for the receiver's or
    the network's sake: every outcome is an Answer."""
    policy = Policy.from_settings()
    try:
        target = url_check(url, policy)
        address = resolve(target, policy)
    except Refused as refused:
        return Answer(None, None, "", refused.code, refused=True)
    host = f"[{address}]" if address.version == 6 else str(address)
    pinned = f"{target.scheme}://{host}:{target.port}{target.target}"
    extensions: dict[str, Any] = {}
    if target.scheme == "https":
        extensions["sni_hostname"] = target.host
    started = time.monotonic()
    try:
        with client.stream(
            "POST",
            pinned,
            content=body,
            headers={**headers, "Host": target.host_header},
            extensions=extensions,
        ) as response:
            latency = int((time.monotonic() - started) * 1000)
            excerpt = _excerpt(response)
    except httpx.TimeoutException:
        return Answer(None, _ms(started), "", "timeout")
    except httpx.ConnectError as exc:
        code = "tls_failed" if "SSL" in repr(exc) or "certificate" in str(exc) else "connect_failed"
        return Answer(None, _ms(started), "", code)
    except httpx.HTTPError:
        return Answer(None, _ms(started), "", "transport_failed")
    status = response.status_code
    error = None
    if 300 <= status < 400:
        error = "redirect_refused"
    elif not 200 <= status < 300:
        error = f"http_{status}"
    return Answer(status, latency, excerpt, error, retry_after_s=_retry_after(response.headers))


def _ms(started: float) -> int:
    return int((time.monotonic() - started) * 1000)


def _excerpt(response: httpx.Response) -> str:
    """At most ``EXCERPT_BYTES`` of the body (the rest is never read)."""
    kept = b""
    for chunk in response.iter_raw():
        kept += chunk
        if len(kept) >= EXCERPT_BYTES:
            break
    return kept[:EXCERPT_BYTES].decode("utf-8", "replace")[:EXCERPT_BYTES]


def _retry_after(headers: httpx.Headers) -> float | None:
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value.strip()))
    except ValueError:
        try:
            when = parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        return max(0.0, when.timestamp() - time.time())


def client() -> httpx.Client:
    """The notifier's HTTP client: no redirects, no proxy from the environment, the timeout."""
    timeout = settings.QUIRE["WEBHOOK_TIMEOUT_S"]
    return httpx.Client(
        follow_redirects=False,
        trust_env=False,
        timeout=httpx.Timeout(timeout),
        # No kept connection: the pool is keyed by the pinned address, and a TLS session made
        # for one name must never carry another name's delivery.
        limits=httpx.Limits(max_connections=64, max_keepalive_connections=0),
        # the excerpt is read raw: nothing compressed comes back to inflate
        headers={"User-Agent": "Quire-Webhooks/1", "Accept-Encoding": "identity"},
    )
