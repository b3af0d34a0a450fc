"""Gauges read from the database at scrape time: one scrape is the truth for the cluster."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any

from django.conf import settings
from django.db.models import Count, Min
from django.utils import timezone
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from conversion_jobs.converters import sandbox
from conversion_jobs.models import ConversionJob, ConversionOutbox, SweepStatus, WorkerLease
from conversion_jobs.states import State
from conversion_jobs.webhooks.models import MessageState, WebhookEndpoint, WebhookMessage


class DatabaseGauges(Collector):
    def collect(self) -> Iterator[GaugeMetricFamily]:
        now = timezone.now()
        by_state = GaugeMetricFamily("quire_jobs", "Jobs by state", labels=["state"])
        counts = dict(
            ConversionJob.objects.values_list("state")
            .annotate(n=Count("id"))
            .values_list("state", "n")
        )
        for state in State.values:
            by_state.add_metric([state], counts.get(state, 0))
        yield by_state

        queued = ConversionJob.objects.filter(state=State.QUEUED)
        oldest = queued.aggregate(m=Min("queued_at"))["m"]
        yield GaugeMetricFamily(
            "quire_queue_depth", "Jobs queued", value=counts.get(State.QUEUED, 0)
        )
        yield GaugeMetricFamily(
            "quire_queue_oldest_age_seconds",
            "Age of the oldest queued job",
            value=(now - oldest).total_seconds() if oldest else 0.0,
        )
        backlog = ConversionOutbox.objects.filter(published_at__isnull=True)
        agg = backlog.aggregate(n=Count("id"), m=Min("created_at"))
        yield GaugeMetricFamily("quire_outbox_backlog", "Unpublished outbox rows", value=agg["n"])
        yield GaugeMetricFamily(
            "quire_outbox_oldest_age_seconds",
            "Age of the oldest unpublished outbox row",
            value=(now - agg["m"]).total_seconds() if agg["m"] else 0.0,
        )
        leases = GaugeMetricFamily("quire_leases", "Worker leases", labels=["status"])
        leases.add_metric(["active"], WorkerLease.objects.filter(expires_at__gte=now).count())
        leases.add_metric(["expired"], WorkerLease.objects.filter(expires_at__lt=now).count())
        yield leases
        live = sum(
            counts.get(s, 0)
            for s in (State.QUEUED, State.RUNNING, State.RETRY_WAIT, State.CANCELLING)
        )
        yield GaugeMetricFamily(
            "quire_capacity_utilisation_ratio",
            "Live jobs / global capacity",
            value=live / max(1, settings.QUIRE["GLOBAL_CAPACITY"]),
        )
        last_success = GaugeMetricFamily(
            "quire_sweep_last_success_timestamp_seconds",
            "Unix time of each sweep's last success (0: none yet)",
            labels=["sweep"],
        )
        for name, at in SweepStatus.objects.order_by("name").values_list("name", "last_success_at"):
            last_success.add_metric([name], at.timestamp() if at else 0.0)
        yield last_success
        yield from _webhook_gauges(now)
        yield _quarantine_gauge()
        yield from _fair_gauges()

    @classmethod
    def registry(cls) -> CollectorRegistry:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(cls())
        return registry


class SandboxGauges(Collector):
    """The converter sandbox on this host, at scrape time (the probe is cached 30 s)."""

    def collect(self) -> Iterator[GaugeMetricFamily]:
        status = sandbox.status(work_dir=settings.QUIRE["WORK_DIR"])
        yield GaugeMetricFamily(
            "quire_sandbox_enabled",
            "1 unless an operator turned the converter sandbox off (QUIRE_SANDBOX=off)",
            value=1 if status.enabled else 0,
        )
        yield GaugeMetricFamily(
            "quire_sandbox_available",
            "1 if the converter sandbox can be set up on this host",
            value=1 if status.available else 0,
        )

    @classmethod
    def registry(cls) -> CollectorRegistry:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(cls())
        return registry


def _quarantine_gauge() -> GaugeMetricFamily:
    """Quarantined documents per tenant, the tenant as its pseudonym (read through the
    ``quarantine_active`` partial index: only quarantined rows)."""
    from conversion_jobs.models import DocumentQuarantine
    from conversion_jobs.pseudonym import pseudonym

    gauge = GaugeMetricFamily(
        "quire_quarantined_documents",
        "Documents quarantined now, by tenant pseudonym",
        labels=["tenant"],
    )
    rows = (
        DocumentQuarantine.objects.filter(quarantined_at__isnull=False)
        .values_list("tenant")
        .annotate(n=Count("id"))
        .values_list("tenant", "n")
    )
    for tenant, n in rows:
        gauge.add_metric([pseudonym("tenant", tenant)], n)
    return gauge


def _webhook_gauges(now: datetime) -> Iterator[GaugeMetricFamily]:
    """The webhook backlog (pending messages, and the age of the oldest one due) and the
    disabled endpoints (docs/OPERABILITY.md, webhooks)."""
    pending = WebhookMessage.objects.filter(state=MessageState.PENDING)
    agg = pending.aggregate(n=Count("id"), m=Min("created_at"))
    yield GaugeMetricFamily(
        "quire_webhook_backlog", "Webhook messages not yet delivered or failed", value=agg["n"]
    )
    yield GaugeMetricFamily(
        "quire_webhook_backlog_oldest_age_seconds",
        "Age of the oldest pending webhook message",
        value=(now - agg["m"]).total_seconds() if agg["m"] else 0.0,
    )
    yield GaugeMetricFamily(
        "quire_webhook_endpoints_disabled",
        "Webhook endpoints disabled (by their tenant, a 410, or failing too long)",
        value=WebhookEndpoint.objects.filter(enabled=False).count(),
    )


#: The per-tenant fairness rows' reader, registered by ``services/fair.py`` when it loads
#: (observability sits below the services: a hook, not an import; docs/ARCHITECTURE.md §9).
fairness_rows: Callable[[], Any] | None = None
fairness_capacity: Callable[[], int] | None = None


def _fair_gauges() -> Iterator[GaugeMetricFamily]:
    """Per tenant (a keyed pseudonym, never the tenant id; docs/THREAT_MODEL.md §3): waiting
    dispatch units and their cost, slots in use, and the share of pages checkpointed over the
    last ``QUIRE_FAIR_SHARE_WINDOW_S`` (docs/OPERABILITY.md "Fair share")."""
    from conversion_jobs.pseudonym import pseudonym

    if fairness_rows is None or fairness_capacity is None:  # services/fair.py is not loaded
        return
    rows = fairness_rows()
    families = {
        "backlog_units": GaugeMetricFamily(
            "quire_tenant_backlog_units", "Dispatch units waiting, per tenant", labels=["tenant"]
        ),
        "backlog_cost": GaugeMetricFamily(
            "quire_tenant_backlog_cost",
            "Page units of the dispatch units waiting, per tenant",
            labels=["tenant"],
        ),
        "running": GaugeMetricFamily(
            "quire_tenant_running",
            "Worker slots in use (running or sent), per tenant",
            labels=["tenant"],
        ),
        "page_share": GaugeMetricFamily(
            "quire_tenant_page_share_ratio",
            "Share of the pages converted over the fair-share window, per tenant",
            labels=["tenant"],
        ),
    }
    for row in rows:
        label = [pseudonym("tenant", row.tenant)]
        for field, family in families.items():
            family.add_metric(label, float(getattr(row, field)))
    yield from families.values()
    yield GaugeMetricFamily(
        "quire_fair_capacity_slots",
        "Worker slots the fair relay may fill",
        value=fairness_capacity(),
    )
