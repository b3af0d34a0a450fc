"""The Procfile's ``web`` process in an e2e cluster, and a small HTTP client for it.

The outage tests talk to the API the way a client does (multipart submissions, reads, health
probes) over a real socket to the real web server, so what they see is what a client sees.
"""

from __future__ import annotations

import json
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests

from tests import testdocs
from tests.conftest import metrics_headers, token
from tests.e2e import harness
from tests.e2e.private_services import free_port


@dataclass
class Web:
    proc: harness.Proc
    base: str
    tenant: str = "tenant-outage"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {token(tenant=self.tenant)}"}

    def submit(
        self,
        *,
        pages: int = 1,
        options: dict[str, Any] | None = None,
        idempotency_key: str | None = None,
        timeout: float = 10,
    ) -> requests.Response:
        """POST /api/v1/jobs with a fresh PDF of ``pages`` pages (unique text: never a
        duplicate of an earlier submission)."""
        salt = uuid.uuid4().hex
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "doc.pdf"
            testdocs.make_pdf(path, pages=pages, text_of=lambda n: f"Page {n} {salt}")
            pdf = path.read_bytes()
        data: dict[str, str] = {"output": "text"}
        if options:
            data["options"] = json.dumps(options)
        return requests.post(
            f"{self.base}/api/v1/jobs",
            headers={
                **self.headers,
                **({"Idempotency-Key": idempotency_key} if idempotency_key else {}),
            },
            files={"file": ("doc.pdf", pdf, "application/pdf")},
            data=data,
            timeout=timeout,
        )

    def get(self, path: str, *, timeout: float = 10) -> requests.Response:
        return requests.get(f"{self.base}{path}", headers=self.headers, timeout=timeout)

    def metrics(self, *, timeout: float = 10) -> requests.Response:
        """A scrape of ``/metrics`` with the run's ``QUIRE_METRICS_TOKEN``."""
        return requests.get(f"{self.base}/metrics", headers=metrics_headers(), timeout=timeout)

    def ready(self, *, timeout: float = 10) -> requests.Response:
        return requests.get(f"{self.base}/health/ready", timeout=timeout)

    def live(self) -> bool:
        try:
            return requests.get(f"{self.base}/health/live", timeout=2).status_code == 200
        except requests.RequestException:
            return False


def start_web(cluster: harness.Cluster, **env: str) -> Web:
    """The Procfile's ``web`` line on a free port (two processes unless ``env`` says
    otherwise), waited for until ``/health/live`` answers."""
    port = free_port()
    env.setdefault("WEB_CONCURRENCY", "2")
    proc = cluster.start("web", QUIRE_BIND=f"127.0.0.1:{port}", **env)
    web = Web(proc=proc, base=f"http://127.0.0.1:{port}")
    harness.wait_until(
        lambda: harness._check_alive(proc) and web.live(), timeout=60, what="web answering"
    )
    return web
