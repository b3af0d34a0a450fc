"""Helpers for the API acceptance tests of issue 2."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from django.db import connections

from conversion_jobs.models import (
    CancellationRequest,
    ConversionJob,
    ConversionOutbox,
    ExecutionAuditEvent,
    IdempotencyRecord,
)


def submit(
    client: Any, path: Path, *, output: str = "text", options: Any = None, key: str | None = None
) -> Any:
    data: dict[str, Any] = {"output": output}
    if options is not None:
        data["options"] = options if isinstance(options, str) else json.dumps(options)
    headers = {"HTTP_IDEMPOTENCY_KEY": key} if key is not None else {}
    with open(path, "rb") as fh:
        data["file"] = fh
        return client.post("/api/v1/jobs", data, format="multipart", **headers)


def row_counts() -> dict[str, int]:
    return {
        "jobs": ConversionJob.objects.count(),
        "outbox": ConversionOutbox.objects.count(),
        "idempotency": IdempotencyRecord.objects.count(),
        "audit": ExecutionAuditEvent.objects.count(),
        "cancellations": CancellationRequest.objects.count(),
    }


def run_concurrently(fns: list[Callable[[], Any]], *, timeout: float = 120) -> list[Any]:
    """Run each callable in its own thread, released together by a barrier. Each thread closes
    its own database connections. Returns results in order; re-raises the first exception."""
    barrier = threading.Barrier(len(fns))
    results: list[Any] = [None] * len(fns)
    failures: list[BaseException] = []

    def runner(i: int, fn: Callable[[], Any]) -> None:
        try:
            barrier.wait(timeout=30)
            results[i] = fn()
        except BaseException as exc:
            failures.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=runner, args=(i, fn)) for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "a submitting thread hung"
    if failures:
        raise failures[0]
    return results


def problem(response: Any, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, (response.status_code, response.content[:500])
    assert response["Content-Type"] == "application/problem+json"
    body = json.loads(response.content)
    assert body["code"] == code, body
    assert body["status"] == status
    return body


@pytest.fixture
def settings_quire(settings: Any) -> Callable[..., None]:
    """``settings_quire(TENANT_QUOTA=3)``: override keys of settings.QUIRE for one test."""

    def apply(**overrides: Any) -> None:
        settings.QUIRE = {**settings.QUIRE, **overrides}

    return apply


def stored_objects() -> list[Any]:
    """Every stored artifact (either backend)."""
    from conversion_jobs import storage

    return [o for prefix in ("sources", "pages", "results") for o in storage.list_objects(prefix)]


def staged_uploads() -> list[Path]:
    """Staged uploads (the store's staging area on the filesystem, the web's upload dir on S3)."""
    from django.conf import settings

    dirs = (Path(settings.QUIRE["STORAGE_DIR"]) / "staging", Path(settings.QUIRE["UPLOAD_DIR"]))
    return [p for d in dirs if d.exists() for p in d.rglob("*") if p.is_file()]
