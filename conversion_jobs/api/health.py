"""Liveness, readiness and the Prometheus endpoint."""

from __future__ import annotations

import hmac
import os

from django.conf import settings
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.http import HttpRequest, HttpResponse, JsonResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest, multiprocess
from prometheus_client import REGISTRY as DEFAULT_REGISTRY

from conversion_jobs.converters import sandbox
from conversion_jobs.observability.gauges import DatabaseGauges, SandboxGauges
from conversion_jobs.services.broker import celery_app
from conversion_jobs.services.sweep_health import sweeps_overdue
from conversion_jobs.store import notify

_migrated = False


def live(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"status": "ok"})


def _database_ok() -> bool:
    try:
        notify.ping()
        return True
    except Exception:
        connection.close()
        return False


def _migrations_ok() -> bool:
    global _migrated
    if not _migrated:
        executor = MigrationExecutor(connection)
        _migrated = not executor.migration_plan(executor.loader.graph.leaf_nodes())
    return _migrated


def _broker_ok() -> bool:
    try:
        with celery_app().connection_for_write() as conn:
            conn.ensure_connection(max_retries=1, timeout=1)
        return True
    except Exception:
        return False


def _sweeps_overdue() -> list[dict[str, object]] | None:
    """The overdue sweeps (empty: all on time), or None when they cannot be read."""
    try:
        return [
            {"sweep": o.sweep, "age_s": o.age_s, "allowed_s": o.allowed_s} for o in sweeps_overdue()
        ]
    except Exception:
        return None


def ready(request: HttpRequest) -> JsonResponse:
    """Ready = database, migrations, broker, a converter sandbox that can be set up on this
    host (or one an operator explicitly turned off: ready, and the body says so), and no sweep
    overdue (``overdue_sweeps`` names them; services/sweep_health.py)."""
    checks = {"database": _database_ok()}
    checks["migrations"] = checks["database"] and _migrations_ok()
    checks["broker"] = _broker_ok()
    box = sandbox.status(work_dir=settings.QUIRE["WORK_DIR"])  # ADR 0013; cached 30 s
    checks["sandbox"] = box.available or not box.enabled
    overdue = _sweeps_overdue() if checks["migrations"] else None
    checks["sweeps"] = overdue == []
    ok = all(checks.values())
    body: dict[str, object] = {
        "status": "ok" if ok else "unavailable",
        "checks": checks,
        "sandbox": box.as_dict(),
    }
    if overdue:
        body["overdue_sweeps"] = overdue
    return JsonResponse(body, status=200 if ok else 503)


def metrics_view(request: HttpRequest) -> HttpResponse:
    """Prometheus text, behind the bearer ``QUIRE_METRICS_TOKEN``: the production profile
    refuses to start without one (conversion_jobs/secret_policy.py); standalone leaves it open."""
    token = settings.QUIRE.get("METRICS_TOKEN")
    if token:
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            given.strip().encode(), token.encode()
        ):
            return HttpResponse(status=401, headers={"WWW-Authenticate": 'Bearer realm="metrics"'})
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
    else:
        registry = DEFAULT_REGISTRY
    body = (
        generate_latest(registry)
        + generate_latest(DatabaseGauges.registry())
        + generate_latest(SandboxGauges.registry())
    )
    return HttpResponse(body, content_type=CONTENT_TYPE_LATEST)
