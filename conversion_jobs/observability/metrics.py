"""Prometheus counters and histograms (docs/OPERABILITY.md §8).

Counters and histograms are per process and aggregated across gunicorn and Celery processes by
prometheus-client's multiprocess mode when ``PROMETHEUS_MULTIPROC_DIR`` is set (the Procfile sets
it). Gauges are read from the database at scrape time (``gauges.py``), so one scrape tells the
truth for the whole cluster. No label ever carries a tenant, subject or file name.
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram

from conversion_jobs.converters.base import IMAGE_TYPES, OFFICE_TYPES, PDF

ADMISSIONS = Counter("quire_admissions", "Submissions by admission result", ["result", "reason"])
IDEMPOTENT_REPLAYS = Counter("quire_idempotent_replays", "Idempotency-Key replays answered")
OUTBOX_PUBLISHED = Counter("quire_outbox_published", "Outbox rows published", ["path"])
OUTBOX_PUBLISH_FAILURES = Counter(
    "quire_outbox_publish_failures", "Outbox publish failures", ["path", "code"]
)
FAIR_DISPATCHED = Counter("quire_fair_dispatched", "Dispatch units the fair relay sent")
FAIR_SENT_AT_ACCEPTANCE = Counter(
    "quire_fair_sent_at_acceptance",
    "Jobs whose acceptance sent their unit itself (an idle system: no pick before the publish)",
)
FAIR_YIELDS = Counter("quire_fair_yields", "Attempts that yielded their worker at a slice's end")
FAIR_STEPPED_ASIDE = Counter(
    "quire_fair_stepped_aside",
    "Attempts that handed their slot back during a long LibreOffice conversion",
)
REDISPATCHES = Counter("quire_redispatches", "Jobs dispatched again", ["reason"])
DUPLICATE_DELIVERIES = Counter(
    "quire_duplicate_deliveries", "Deliveries acked without work", ["reason"]
)
CLAIMS = Counter("quire_claims", "Successful claims")
ATTEMPT_DURATION = Histogram(
    "quire_attempt_duration_seconds",
    "Duration of attempts by outcome",
    ["outcome"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900, 3600),
)
RETRY_DELAY = Histogram(
    "quire_retry_delay_seconds",
    "Backoff delays scheduled for retryable failures",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 300, 600),
)
RECOVERIES = Counter("quire_recoveries", "Jobs recovered from an expired lease", ["result"])
#: Fenced writes that matched no row (ADR 0023): a stale range, generation or finalizer tried
#: to write and wrote nothing. Counted from the fenced statements' row counts.
FENCED_WRITES_REFUSED = Counter(
    "quire_fenced_writes_refused",
    "Fenced writes that matched no row and wrote nothing",
    ["statement"],
)
#: Page ranges of fanned-out jobs (ADR 0023): planned, and recovered from an expired lease.
RANGES_PLANNED = Counter("quire_ranges_planned", "Page ranges planned by fanned-out jobs")
RANGE_RECOVERIES = Counter(
    "quire_range_recoveries", "Page ranges recovered from an expired lease", ["result"]
)
#: Should stay 0: a leased-state job with no lease row and no open attempt (docs/OPERABILITY.md).
REPAIRS = Counter(
    "quire_jobs_repaired", "Leased-state jobs found with no lease and repaired", ["result"]
)
CANCELLATIONS = Counter("quire_cancellations", "Cancel requests by outcome", ["outcome"])
CANCELLATION_LATENCY = Histogram(
    "quire_cancellation_latency_seconds",
    "Cancel request to cancelled",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 3, 5, 10, 20, 60),
)
DEAD_LETTERS = Counter("quire_dead_letters", "Messages dead-lettered as poison")
PAGES = Counter("quire_pages", "Pages converted by outcome", ["outcome"])
TERMINAL = Counter("quire_jobs_finished", "Jobs that reached a terminal state", ["state"])
RETENTION_PURGES = Counter("quire_retention_purges", "Rows and files purged by retention", ["kind"])
ENGINE_STARTS = Counter("quire_engine_starts", "Warm engines started", ["engine"])
ENGINE_RECYCLES = Counter(
    "quire_engine_recycles", "Warm engines ended, by reason", ["engine", "reason"]
)
ENGINE_LIFE_CONVERSIONS = Histogram(
    "quire_engine_conversions_per_life",
    "Conversions a warm engine served before it was recycled",
    ["engine"],
    buckets=(0, 1, 2, 5, 10, 20, 50, 100, 200, 500),
)
CONVERSION_DURATION = Histogram(
    "quire_conversion_duration_seconds",
    "Time to open a document (count its pages; for Office input, the conversion to PDF) by "
    "input type and converter",
    ["input", "engine"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 180),
)
WEBHOOK_DELIVERIES = Counter(
    "quire_webhook_deliveries",
    "Webhook delivery attempts by outcome (delivered, retry, failed, refused)",
    ["outcome"],
)
WEBHOOK_LATENCY = Histogram(
    "quire_webhook_delivery_seconds",
    "Time from a webhook request's start to its answer's headers",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 15),
)
#: Poison documents (services/quarantine.py): ``engine`` is the converter (pdfium, image,
#: libreoffice), never a tenant or a document.
DOCUMENT_CRASHES = Counter(
    "quire_document_crashes",
    "Converter crashes recorded against a document (signal, memory limit, timeout, cut answer)",
    ["engine", "code"],
)
QUARANTINES = Counter("quire_quarantines", "Documents quarantined", ["engine"])
QUARANTINE_LIFTS = Counter(
    "quire_quarantine_lifts", "Quarantines lifted by an operator", ["engine"]
)
QUARANTINE_REFUSALS = Counter(
    "quire_quarantine_refusals", "Submissions answered 422 document_quarantined"
)
#: Tenant erasures (services/erasure.py) that finished.
TENANT_ERASURES = Counter("quire_tenant_erasures", "Tenant erasures finished")
#: the converters' names as the quarantine metrics label them
QUARANTINE_ENGINES = ("pdfium", "image", "libreoffice")

#: the outcomes of a webhook delivery attempt (``webhook_attempt.outcome``)
WEBHOOK_OUTCOMES = ("delivered", "retry", "failed", "refused")

#: Every label value the code can set, so each series exists (at zero) from the first scrape
#: after a start or a deploy instead of appearing with its first event (docs/OPERABILITY.md §8).
#: Kept in step with the enums they come from by tests/unit/test_metrics_series.py.
KNOWN_SERIES: dict[Counter | Histogram, list[dict[str, str]]] = {
    ADMISSIONS: [
        {"result": "accepted", "reason": ""},
        {"result": "replayed", "reason": ""},
        {"result": "duplicate", "reason": ""},
        {"result": "rejected", "reason": "tenant_quota_exceeded"},
        {"result": "rejected", "reason": "capacity_exceeded"},
    ],
    OUTBOX_PUBLISHED: [{"path": "fast"}, {"path": "sweep"}, {"path": "wake"}],
    OUTBOX_PUBLISH_FAILURES: [
        {"path": path, "code": code}
        for path in ("fast", "sweep", "wake")
        for code in ("broker_timeout", "broker_unreachable", "publish_failed")
    ]
    + [{"path": "fast", "code": "queue_full"}],
    REDISPATCHES: [
        {"reason": r}
        for r in (
            "dispatch_timeout",
            "retry_due",
            "operator_retry",
            "yielded",
            "unconfirmed",
        )
    ],
    DUPLICATE_DELIVERIES: [{"reason": "duplicate"}, {"reason": "stale"}],
    ATTEMPT_DURATION: [
        {"outcome": o}
        for o in (
            "succeeded",
            "retryable_error",
            "terminal_error",
            "lease_lost",
            "cancelled",
            "yielded",
        )
    ],
    RECOVERIES: [{"result": r} for r in ("requeued", "exhausted", "cancelled")],
    FENCED_WRITES_REFUSED: [
        {"statement": s}
        for s in ("job_pages", "job_publish", "range_pages", "range_done", "range_heartbeat")
    ],
    RANGE_RECOVERIES: [{"result": r} for r in ("requeued", "exhausted", "cancelled", "stale")],
    REPAIRS: [{"result": r} for r in ("requeued", "exhausted", "cancelled")],
    CANCELLATIONS: [
        {"outcome": o}
        for o in ("cancelled", "cancelling", "already_cancelled", "too_late", "lost_to_completion")
    ],
    PAGES: [{"outcome": o} for o in ("done", "failed")],
    TERMINAL: [{"state": s} for s in ("succeeded", "partial", "failed", "cancelled")],
    RETENTION_PURGES: [
        {"kind": k}
        for k in ("outbox_rows", "jobs_expired", "jobs_purged", "audit_events", "webhook_messages")
    ],
    ENGINE_STARTS: [{"engine": "libreoffice"}],
    WEBHOOK_DELIVERIES: [{"outcome": o} for o in WEBHOOK_OUTCOMES],
    ENGINE_RECYCLES: [
        {"engine": "libreoffice", "reason": r}
        for r in (
            "max_conversions",
            "memory",
            "failure",
            "timeout",
            "stopped",
            "crashed",
            "idle",
            "settings",
            "start_failed",
            "shutdown",
            "stepped_aside",
        )
    ],
    ENGINE_LIFE_CONVERSIONS: [{"engine": "libreoffice"}],
    DOCUMENT_CRASHES: [
        {"engine": e, "code": c}
        for e in QUARANTINE_ENGINES
        for c in ("converter_crashed", "conversion_timeout")
    ],
    QUARANTINES: [{"engine": e} for e in QUARANTINE_ENGINES],
    QUARANTINE_LIFTS: [{"engine": e} for e in QUARANTINE_ENGINES],
    CONVERSION_DURATION: [
        {"input": media_type, "engine": engine}
        for engines, media_types in (
            (("pdfium",), (PDF,)),
            (("image",), sorted(IMAGE_TYPES)),
            (("libreoffice-warm", "libreoffice-fresh"), sorted(OFFICE_TYPES)),
        )
        for engine in engines
        for media_type in media_types
    ],
}


def _zero_known_series() -> None:
    for metric, series in KNOWN_SERIES.items():
        for labels in series:
            metric.labels(**labels)


_zero_known_series()
