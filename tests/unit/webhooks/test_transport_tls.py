"""The pinned connection keeps TLS honest (docs/THREAT_MODEL.md "Webhooks"): the transport dials
the resolved address, sends the name as SNI and Host, and the certificate is checked against
the name - a certificate for another name fails with ``tls_failed``, never delivers."""

from __future__ import annotations

import datetime
import ssl
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from conversion_jobs.webhooks import transport


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _pki(tmp: Path, dns_name: str) -> tuple[Path, Path, Path]:
    """A CA, and a server certificate for ``dns_name`` signed by it: (ca.pem, cert, key)."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name("test ca"))
        .issuer_name(_name("test ca"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(dns_name))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(dns_name)]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    paths = tmp / "ca.pem", tmp / "cert.pem", tmp / "key.pem"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return paths


@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[Any]:
    servers: list[HTTPServer] = []

    def make(dns_name: str) -> tuple[int, Path, dict[str, Any]]:
        ca, cert, key = _pki(tmp_path, dns_name)
        seen: dict[str, Any] = {"requests": 0}

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", "0")))
                seen["requests"] += 1
                seen["host"] = self.headers.get("Host")
                self.send_response(204)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        context.sni_callback = lambda sock, name, ctx: seen.__setitem__("sni", name)
        server = HTTPServer(("127.0.0.1", 0), Handler)
        server.socket = context.wrap_socket(server.socket, server_side=True)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server.server_address[1], ca, seen

    yield make
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.fixture
def allow_localhost(settings: Any) -> None:
    settings.QUIRE = {
        **settings.QUIRE,
        "WEBHOOK_ALLOWLIST": "localhost",
        "WEBHOOK_ALLOWED_PORTS": "1024-65535",
        "WEBHOOK_TIMEOUT_S": 5.0,
    }


def _client(ca: Path) -> httpx.Client:
    return httpx.Client(verify=ssl.create_default_context(cafile=str(ca)), trust_env=False)


def test_transport_tls__pinned_address_with_the_name_as_sni_and_host(tls_server, allow_localhost):
    port, ca, seen = tls_server("localhost")
    with _client(ca) as client:
        answer = transport.post(f"https://localhost:{port}/hook", b"{}", {}, client=client)
    assert (answer.status, answer.error) == (204, None)
    assert seen == {"requests": 1, "sni": "localhost", "host": f"localhost:{port}"}


def test_transport_tls__certificate_for_another_name_fails(tls_server, allow_localhost):
    port, ca, seen = tls_server("other.example")
    with _client(ca) as client:
        answer = transport.post(f"https://localhost:{port}/hook", b"{}", {}, client=client)
    assert (answer.status, answer.error) == (None, "tls_failed")
    assert seen["requests"] == 0
