"""A real JWKS endpoint for tests: an http.server on 127.0.0.1 in a thread, keys generated with
cryptography, tokens signed with them. Rotate by replacing ``keys``; stop it for an outage."""

from __future__ import annotations

import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import jwt
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from jwt.algorithms import ECAlgorithm, RSAAlgorithm

ISSUER = "https://idp.quire.test/"
AUDIENCE = "quire-api"


class SigningKey:
    def __init__(self, algorithm: str = "RS256") -> None:
        self.algorithm = algorithm
        self.kid = uuid.uuid4().hex
        if algorithm == "RS256":
            self.private: Any = rsa.generate_private_key(public_exponent=65537, key_size=2048)
            public = json.loads(RSAAlgorithm.to_jwk(self.private.public_key()))
        else:
            self.private = ec.generate_private_key(ec.SECP256R1())
            public = json.loads(ECAlgorithm.to_jwk(self.private.public_key()))
        self.jwk = {**public, "kid": self.kid, "use": "sig", "alg": algorithm}

    def sign(self, *, kid: str | None = None, headers: dict | None = None, **overrides: Any) -> str:
        claims: dict[str, Any] = {
            "sub": "user-1",
            "tenant": "tenant-a",
            "scope": "jobs:read jobs:submit jobs:cancel",
            "iss": ISSUER,
            "aud": AUDIENCE,
            "exp": int(time.time()) + 300,
        }
        claims.update(overrides)
        claims = {k: v for k, v in claims.items() if v is not None}
        header = {"kid": kid or self.kid, **(headers or {})}
        return jwt.encode(claims, self.private, algorithm=self.algorithm, headers=header)


class JwksServer:
    def __init__(self) -> None:
        self.keys: list[SigningKey] = []
        #: None: serve the keys; else (status, body) to answer instead (a broken IdP).
        self.answer: tuple[int, bytes] | None = None
        self.requests = 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                server.requests += 1
                status, body = server.answer or (
                    200,
                    json.dumps({"keys": [k.jwk for k in server.keys]}).encode(),
                )
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}/.well-known/jwks.json"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5)
