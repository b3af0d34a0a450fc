"""Quire settings: one module, driven by the environment.

Two profiles (docs/ARCHITECTURE.md §7):

* production: ``DATABASE_URL=postgres://…`` and ``CELERY_BROKER_URL=amqp://…``;
* standalone (neither set): SQLite in WAL mode under ``var/`` and kombu's server-less
  filesystem transport, so the whole pipeline runs with nothing installed.
"""

from __future__ import annotations

import math
import os
import socket
from pathlib import Path
from typing import Any

import dj_database_url
from django.core.exceptions import ImproperlyConfigured
from kombu import Exchange, Queue

from conversion_jobs import secret_policy

BASE_DIR = Path(__file__).resolve().parent.parent


def env_str(name: str, default: str) -> str:
    return os.environ.get(name, default)


def env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def env_float(name: str, default: float) -> float:
    return float(os.environ.get(name, default))


def env_bool(name: str, default: bool) -> bool:
    return os.environ.get(name, str(default)).strip().lower() in {"1", "true", "yes", "on"}


def env_pages_by_output(name: str, defaults: dict[str, int]) -> dict[str, int]:
    """``"64"`` (every output) or ``"text=20000, png=64"`` (those outputs; the others keep their
    ``defaults``) -> {output: pages >= 0}."""
    raw = os.environ.get(name, "").strip()
    out = dict(defaults)
    if not raw:
        return out
    if raw.isdigit():
        return {key: int(raw) for key in out}
    for item in filter(None, (part.strip() for part in raw.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key.strip() not in out or not value.strip().isdigit():
            raise ImproperlyConfigured(
                f"{name}: {item!r} is not <{'|'.join(out)}>=<pages >= 0> (or one number)"
            )
        out[key.strip()] = int(value)
    return out


def env_seconds_by_name(name: str) -> dict[str, float]:
    """``"apply_retention=60, remove_orphaned_artifacts=30"`` -> {name: seconds > 0}."""
    out: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in os.environ.get(name, "").split(","))):
        key, sep, value = item.partition("=")
        try:
            seconds = float(value)
        except ValueError:
            seconds = 0.0
        if not sep or not key.strip() or not 0 < seconds < math.inf:
            raise ImproperlyConfigured(f"{name}: {item!r} is not <name>=<seconds > 0>")
        out[key.strip()] = seconds
    return out


VAR_DIR = Path(env_str("QUIRE_VAR_DIR", str(BASE_DIR / "var")))
if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):  # aggregated counters across processes (Procfile)
    Path(os.environ["PROMETHEUS_MULTIPROC_DIR"]).mkdir(parents=True, exist_ok=True)
STANDALONE = not secret_policy.production_profile(os.environ)
DEBUG = env_bool("DJANGO_DEBUG", False)

# Development secrets exist only so the standalone profile runs out of the box; the production
# profile refuses to start without real ones (conversion_jobs/secret_policy.py, which already
# stopped a process importing ``project``: this is for one whose environment changed since).
if _secret_refusal := secret_policy.refusal(os.environ):
    raise ImproperlyConfigured(_secret_refusal)


def env_secret(name: str) -> str:
    """The secret, or in the standalone profile its published development value (production:
    "" only for one it does not use, QUIRE_JWT_KEY with an identity provider)."""
    fallback = secret_policy.DEVELOPMENT_VALUES.get(name, "") if STANDALONE else ""
    return os.environ.get(name) or fallback


SECRET_KEY = env_secret("DJANGO_SECRET_KEY")
ALLOWED_HOSTS = env_str("DJANGO_ALLOWED_HOSTS", "*").split(",")

# HTTPS (docs/OPERABILITY.md §2 "HTTPS"): the production web serves plain HTTP behind a
# TLS-terminating proxy, which redirects http to https and sets X-Forwarded-Proto. These
# defaults keep `manage.py check --deploy` silent; each can be changed from the environment.
_PROXY_SSL_HEADER = env_str(
    "DJANGO_SECURE_PROXY_SSL_HEADER", "" if STANDALONE else "X-Forwarded-Proto"
)
SECURE_PROXY_SSL_HEADER = (
    ("HTTP_" + _PROXY_SSL_HEADER.upper().replace("-", "_"), "https") if _PROXY_SSL_HEADER else None
)
SECURE_HSTS_SECONDS = env_int("DJANGO_SECURE_HSTS_SECONDS", 0 if STANDALONE else 31536000)
SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("DJANGO_SECURE_HSTS_INCLUDE_SUBDOMAINS", not STANDALONE)
SECURE_HSTS_PRELOAD = env_bool("DJANGO_SECURE_HSTS_PRELOAD", not STANDALONE)
SESSION_COOKIE_SECURE = env_bool("DJANGO_SESSION_COOKIE_SECURE", not STANDALONE)
CSRF_COOKIE_SECURE = env_bool("DJANGO_CSRF_COOKIE_SECURE", not STANDALONE)
# Off by default: the proxy redirects. Django's redirect would answer a load balancer's plain
# HTTP probe of /health/ready with a 301, and an API client's POST with a redirect after its
# token already crossed in clear; so check --deploy's reminder (security.W008) is silenced.
SECURE_SSL_REDIRECT = env_bool("DJANGO_SECURE_SSL_REDIRECT", False)
SILENCED_SYSTEM_CHECKS = ["security.W008"]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",  # Swagger UI from the package, never a CDN
    "django_celery_beat",
    "conversion_jobs",
]

MIDDLEWARE = [
    # Outermost: any 4xx/5xx answer not yet a problem becomes one (conversion_jobs/api/middleware).
    "conversion_jobs.api.middleware.ProblemResponseMiddleware",
    # Next, so a database lost in any later middleware or view is a 503, not a 500.
    "conversion_jobs.api.problems.DatabaseUnavailableMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]
#: What only the admin needs (its session, its CSRF-protected forms, its user and messages): the
#: web's handler (conversion_jobs.web.handler) runs the API's own views through
#: ``MIDDLEWARE`` without these, the admin and everything else through all of it (ADR 0017,
#: session 7). An API request neither reads nor writes a session or a CSRF cookie.
ADMIN_ONLY_MIDDLEWARE = (
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
)
CSRF_FAILURE_VIEW = "conversion_jobs.api.problems.csrf_failure"
X_FRAME_OPTIONS = "DENY"

ROOT_URLCONF = "project.urls"
WSGI_APPLICATION = "project.wsgi.application"
ASGI_APPLICATION = "project.asgi.application"  # what the Procfile serves (ADR 0016)
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]

# --- database -------------------------------------------------------------------------------
if os.environ.get("DATABASE_URL"):
    DATABASES = {
        "default": dj_database_url.parse(
            os.environ["DATABASE_URL"], conn_max_age=env_int("QUIRE_DB_CONN_MAX_AGE", 60)
        )
    }
    DATABASES["default"].setdefault("OPTIONS", {})
    DATABASES["default"]["CONN_HEALTH_CHECKS"] = True
    if DATABASES["default"]["ENGINE"].endswith("postgresql"):
        DATABASES["default"]["OPTIONS"].setdefault("connect_timeout", 5)
        # A process paused between two statements of a transaction (a VM pause, SIGSTOP, a
        # stalled thread) keeps its row locks for as long as the pause lasts: a frozen worker's
        # lease row stayed locked and the lease sweep's SKIP LOCKED passed over it, stranding
        # the job (docs/OPERABILITY.md, "Database sessions"). Postgres ends a session idle in a
        # transaction past this bound; no Quire transaction waits that long between statements
        # (the longest wait inside one is a broker publish: 2 s connect timeout, one retry).
        idle_ms = round(env_float("QUIRE_DB_IDLE_IN_TRANSACTION_TIMEOUT_S", 10.0) * 1000)
        if idle_ms > 0:
            options = DATABASES["default"]["OPTIONS"].get("options", "")
            DATABASES["default"]["OPTIONS"]["options"] = (
                f"{options} -c idle_in_transaction_session_timeout={idle_ms}".strip()
            )
        # The hot statements' cursor (store/prepared.py) prepares each statement on its
        # first use on a connection; the ORM's client-binding cursors never prepare. Off
        # (QUIRE_DB_PREPARED_STATEMENTS=0) for a pooler that cannot keep prepared statements.
        DATABASES["default"]["OPTIONS"].setdefault(
            "prepare_threshold", 0 if env_bool("QUIRE_DB_PREPARED_STATEMENTS", True) else None
        )
else:
    VAR_DIR.mkdir(parents=True, exist_ok=True)
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": str(VAR_DIR / "quire.sqlite3"),
            # WAL + IMMEDIATE transactions: writers queue on the lock instead of failing with
            # "database is locked" half-way through a transaction.
            "OPTIONS": {
                "transaction_mode": "IMMEDIATE",
                "timeout": 30,
                "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
            },
            "TEST": {"NAME": str(VAR_DIR / "quire-test.sqlite3")},
        }
    }
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# --- static / i18n --------------------------------------------------------------------------
STATIC_URL = "/static/"
STATIC_ROOT = str(VAR_DIR / "static")
USE_TZ = True
TIME_ZONE = "UTC"
LANGUAGE_CODE = "en-us"

# --- uploads: never buffer a whole document in memory -------------------------------------------
# Under ASGI, Django first spools the request body into a SpooledTemporaryFile of this size:
# 0 would mean "never roll over to disk", i.e. the whole upload in memory. Job uploads then go
# through StagingUploadHandler (api/uploads.py), which never keeps a file part in memory.
FILE_UPLOAD_MAX_MEMORY_SIZE = 256 * 1024
DATA_UPLOAD_MAX_MEMORY_SIZE = 64 * 1024

# --- REST framework ---------------------------------------------------------------------------
REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": ["conversion_jobs.api.auth.BearerJWTAuthentication"],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "DEFAULT_PARSER_CLASSES": [
        "rest_framework.parsers.JSONParser",
        "rest_framework.parsers.MultiPartParser",
    ],
    "EXCEPTION_HANDLER": "conversion_jobs.api.problems.exception_handler",
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "UNAUTHENTICATED_USER": None,
}
SPECTACULAR_SETTINGS = {
    "TITLE": "Quire API",
    "DESCRIPTION": "Durable document conversion jobs.",
    "VERSION": "1.0.0",
    "SERVE_INCLUDE_SCHEMA": False,
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    # Component names are function and class names of generated clients (docs/API_CONTRACT.md,
    # "Generated clients"): fixed here, so a new enum elsewhere cannot rename them.
    "ENUM_NAME_OVERRIDES": {
        "StateEnum": "conversion_jobs.states.State",
        "WebhookEventTypeEnum": "conversion_jobs.webhooks.models.EventType",
    },
}

# --- Quire ----------------------------------------------------------------------------------
QUIRE: dict[str, Any] = {
    # secrets
    "JWT_KEY": env_secret("QUIRE_JWT_KEY"),
    "JWT_ALGORITHM": "HS256",
    # identity provider (production): when set, tokens are verified against its JWKS only
    # (RS256 / ES256), and iss / aud are required (conversion_jobs/api/auth.py).
    "JWT_JWKS_URL": env_str("QUIRE_JWT_JWKS_URL", ""),
    "JWT_ISSUER": env_str("QUIRE_JWT_ISSUER", ""),
    "JWT_AUDIENCE": env_str("QUIRE_JWT_AUDIENCE", ""),
    "JWT_JWKS_LIFESPAN_S": env_float("QUIRE_JWT_JWKS_LIFESPAN_S", 300.0),
    "JWT_JWKS_MIN_REFRESH_S": env_float("QUIRE_JWT_JWKS_MIN_REFRESH_S", 10.0),
    "JWT_JWKS_TIMEOUT_S": env_float("QUIRE_JWT_JWKS_TIMEOUT_S", 3.0),
    "JWT_LEEWAY_S": env_float("QUIRE_JWT_LEEWAY_S", 0.0),
    # Verified tokens are remembered (by hash) until they expire, at most this long; 0: off.
    "JWT_CACHE_S": env_float("QUIRE_JWT_CACHE_S", 60.0),
    "PSEUDONYM_KEY": env_secret("QUIRE_PSEUDONYM_KEY"),
    # seals document passwords at rest and keys their HMAC in the content identity (ADR 0019)
    "PASSWORD_KEY": env_secret("QUIRE_PASSWORD_KEY"),
    # bearer token of /metrics; required in the production profile, unset (open) standalone
    "METRICS_TOKEN": env_secret("QUIRE_METRICS_TOKEN"),
    # storage (docs/ARCHITECTURE.md §6): "filesystem" (STORAGE_DIR) or "s3" (S3; credentials
    # come from the environment's AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or the instance role)
    "STORAGE": env_str("QUIRE_STORAGE", "filesystem"),
    "STORAGE_DIR": Path(env_str("QUIRE_STORAGE_DIR", str(VAR_DIR / "storage"))),
    "S3": {
        "BUCKET": env_str("QUIRE_S3_BUCKET", ""),
        "ENDPOINT_URL": env_str("QUIRE_S3_ENDPOINT_URL", ""),
        "REGION": env_str("QUIRE_S3_REGION", "us-east-1"),
        "ADDRESSING_STYLE": env_str("QUIRE_S3_ADDRESSING_STYLE", "auto"),
        "PREFIX": env_str("QUIRE_S3_PREFIX", ""),
        # > 0: results and pages answer 302 to a presigned URL valid this long
        "PRESIGN_TTL_S": env_float("QUIRE_S3_PRESIGN_TTL_S", 0.0),
    },
    # an object older than this that no row names is an orphan (a put whose row never
    # committed); far longer than any put-to-commit gap (a lease at most)
    "ORPHAN_GRACE_S": env_float("QUIRE_ORPHAN_GRACE_S", 3600.0),
    "WORK_DIR": Path(env_str("QUIRE_WORK_DIR", str(VAR_DIR / "work"))),
    # the web's local scratch for uploads in flight on the S3 backend (the filesystem backend
    # stages inside STORAGE_DIR, so storing an upload is a rename)
    "UPLOAD_DIR": Path(env_str("QUIRE_UPLOAD_DIR", str(VAR_DIR / "uploads"))),
    # admission
    "MAX_UPLOAD_BYTES": env_int("QUIRE_MAX_UPLOAD_BYTES", 100 * 1024 * 1024),
    "TENANT_QUOTA": env_int("QUIRE_TENANT_QUOTA", 200),
    "GLOBAL_CAPACITY": env_int("QUIRE_GLOBAL_CAPACITY", 2000),
    # per-process admission snapshot (services/admission.py, ADR 0004): live counts read at most
    # this often; within this share of a limit (and before any refusal) the exact count decides
    "ADMISSION_SNAPSHOT_S": env_float("QUIRE_ADMISSION_SNAPSHOT_S", 0.25),
    "ADMISSION_EXACT_WITHIN": env_float("QUIRE_ADMISSION_EXACT_WITHIN", 0.1),
    "RETRY_AFTER_MIN_S": env_int("QUIRE_RETRY_AFTER_MIN_S", 1),
    "RETRY_AFTER_MAX_S": env_int("QUIRE_RETRY_AFTER_MAX_S", 300),
    # Retry-After of a 503 database_unavailable
    "DB_UNAVAILABLE_RETRY_AFTER_S": env_int("QUIRE_DB_UNAVAILABLE_RETRY_AFTER_S", 5),
    "POLICY_VERSION": env_int("QUIRE_POLICY_VERSION", 1),
    # execution
    "MAX_ATTEMPTS": env_int("QUIRE_MAX_ATTEMPTS", 5),
    # Warm LibreOffice per worker process (ADR 0019): "warm" or "fresh" (a new one per document).
    "OFFICE_ENGINE": env_str("QUIRE_OFFICE_ENGINE", "warm"),
    "OFFICE_ENGINE_MAX_CONVERSIONS": env_int("QUIRE_OFFICE_ENGINE_MAX_CONVERSIONS", 50),
    "OFFICE_ENGINE_MAX_RSS_MB": env_int("QUIRE_OFFICE_ENGINE_MAX_RSS_MB", 800),
    # Converter reuse (ADR 0019): "attempt" (a fresh child per attempt) or "tenant" (a child
    # may serve up to N consecutive attempts of one tenant; converters/sessions.py).
    "CONVERTER_REUSE": env_str("QUIRE_CONVERTER_REUSE", "attempt"),
    "CONVERTER_REUSE_MAX_ATTEMPTS": env_int("QUIRE_CONVERTER_REUSE_MAX_ATTEMPTS", 200),
    "CONVERTER_REUSE_MAX_RSS_MB": env_int("QUIRE_CONVERTER_REUSE_MAX_RSS_MB", 512),
    # The claim's commit does not wait for its WAL flush; the attempt's next synchronous commit
    # makes it durable (services/transitions.py _CLAIM_ASYNC_COMMIT, ADR 0017 session 5).
    "CLAIM_ASYNC_COMMIT": env_bool("QUIRE_CLAIM_ASYNC_COMMIT", True),
    "HEARTBEAT_S": env_float("QUIRE_HEARTBEAT_S", 2.0),
    "LEASE_S": env_float("QUIRE_LEASE_S", 10.0),
    "PAGE_MAX_ATTEMPTS": env_int("QUIRE_PAGE_MAX_ATTEMPTS", 3),
    # Poison documents (services/quarantine.py, docs/OPERABILITY.md "Quarantine"): a document
    # whose converter crashed (signal, memory limit, timeout, cut answer) on this many attempts
    # - on two hosts, when the last QUARANTINE_HOST_WINDOW attempts ran on more than one - is
    # quarantined for its tenant and engine version.
    "QUARANTINE_AFTER_CRASHES": env_int("QUIRE_QUARANTINE_AFTER_CRASHES", 2),
    "QUARANTINE_HOST_WINDOW": env_int("QUIRE_QUARANTINE_HOST_WINDOW", 1000),
    # The machine a worker runs on, as its attempts name it (worker = "<host>:<pid>"); set it
    # to the node's name where containers on one machine have their own host names.
    "WORKER_HOST": env_str("QUIRE_WORKER_HOST", "") or socket.gethostname(),
    # Tenant erasure (services/erasure.py): how long one run waits for the tenant's cancelling
    # jobs to end before it stops (to be run again) — above LEASE_S + a sweep.
    "ERASURE_CANCEL_WAIT_S": env_float("QUIRE_ERASURE_CANCEL_WAIT_S", 60.0),
    # Converter limits (conversion_jobs/converters/base.py Limits; the others keep their
    # defaults there). Office containers are checked against these before LibreOffice reads
    # them (converters/containers.py, docs/THREAT_MODEL.md).
    "CONVERTER_LIMITS": {
        # pages (or image frames) a document may have (ADR 0023: long documents fan out)
        "max_pages": env_int("QUIRE_MAX_PAGES", 20_000),
        "max_inflated_bytes": env_int("QUIRE_MAX_INFLATED_BYTES", 256 * 1024 * 1024),
        "max_inflate_ratio": env_int("QUIRE_MAX_INFLATE_RATIO", 100),
        "inflate_ratio_min_bytes": env_int("QUIRE_INFLATE_RATIO_MIN_BYTES", 10 * 1024 * 1024),
        # one child call of a document's preparation (LibreOffice's conversion to PDF)
        "prepare_timeout_s": env_float("QUIRE_PREPARE_TIMEOUT_S", 180.0),
    },
    # Fan-out (ADR 0023, docs/ARCHITECTURE.md "Page ranges"): a job with more pages to convert
    # than FANOUT_MIN_PAGES is split into page ranges, each a fenced unit of work any worker
    # claims; a range has ceil(pages / (4 x FANOUT_SLOTS)) pages, bounded to
    # [FANOUT_RANGE_MIN_PAGES, FANOUT_RANGE_MAX_PAGES]. FANOUT_SLOTS: the conversion slots
    # (worker processes x concurrency) the ranges are sized for.
    "FANOUT": env_bool("QUIRE_FANOUT", True),
    # FANOUT_MIN_PAGES is per output ("ocr": text from an image), chosen from measured per-page
    # costs against a range's fixed cost (docs/OPERABILITY.md "Fan-out thresholds"): text from
    # a PDF costs ≈ 0.1 ms a page, so it never pays below the page limit.
    "FANOUT_MIN_PAGES": env_pages_by_output(
        "QUIRE_FANOUT_MIN_PAGES", {"text": 20_000, "ocr": 64, "png": 64, "pdf": 64}
    ),
    "FANOUT_RANGE_MIN_PAGES": env_int("QUIRE_FANOUT_RANGE_MIN_PAGES", 32),
    "FANOUT_RANGE_MAX_PAGES": env_int("QUIRE_FANOUT_RANGE_MAX_PAGES", 256),
    "FANOUT_SLOTS": env_int("QUIRE_FANOUT_SLOTS", 2),
    # Ranges shrink towards the end of the document (fanout.range_sizes), so that the last
    # ones, which decide when every slot is done, are short.
    "FANOUT_RANGE_TAPER": env_bool("QUIRE_FANOUT_RANGE_TAPER", False),
    # Text pages up to this size live in their checkpoint row (written with the batch, no file,
    # no fsync of their own); 0 turns it off.
    "INLINE_PAGE_MAX_BYTES": env_int("QUIRE_INLINE_PAGE_MAX_BYTES", 65536),
    # An upload up to this size is kept in the web's memory and stored in Postgres in the
    # acceptance's own statement (table inline_source: no staging file, no store put, no
    # fsyncs); 0 turns it off. Workers must be upgraded first (docs/OPERABILITY.md).
    "INLINE_SOURCE_MAX_BYTES": env_int("QUIRE_INLINE_SOURCE_MAX_BYTES", 65536),
    # A text result made of inline pages is joined in the web's memory when downloaded: above
    # this many bytes it is assembled into a stored file instead (streamed, never held whole).
    "INLINE_RESULT_MAX_BYTES": env_int("QUIRE_INLINE_RESULT_MAX_BYTES", 4 * 1024 * 1024),
    "BACKOFF_BASE_S": env_float("QUIRE_BACKOFF_BASE_S", 2.0),
    "BACKOFF_CAP_S": env_float("QUIRE_BACKOFF_CAP_S", 300.0),
    # dispatch
    "PUBLISH_CONFIRM_TIMEOUT_S": env_float("QUIRE_PUBLISH_CONFIRM_TIMEOUT_S", 0.5),
    # The web's fast path (ADR 0017 addendum): "background" hands committed rows to a
    # per-process publisher thread (bounded queue, batches confirmed together); "inline"
    # publishes in the request's after-commit hook.
    "FAST_PUBLISH": env_str("QUIRE_FAST_PUBLISH", "background"),
    "PUBLISH_QUEUE_MAX": env_int("QUIRE_PUBLISH_QUEUE_MAX", 10000),
    "PUBLISH_BATCH": env_int("QUIRE_PUBLISH_BATCH", 200),
    "DISPATCH_TIMEOUT_S": env_float("QUIRE_DISPATCH_TIMEOUT_S", 600.0),
    "SWEEP_BATCH": env_int("QUIRE_SWEEP_BATCH", 500),
    # fair dispatch (docs/ARCHITECTURE.md §2b, ADR 0021; docs/OPERABILITY.md "Fair share")
    "FAIR_DISPATCH": env_bool("QUIRE_FAIR_DISPATCH", True),
    # worker slots the relay may fill; 0: the slots worker processes announce (worker_slot)
    "FAIR_CAPACITY": env_int("QUIRE_FAIR_CAPACITY", 0),
    "FAIR_SLOT_BEAT_S": env_float("QUIRE_FAIR_SLOT_BEAT_S", 2.0),
    "FAIR_SLOT_TTL_S": env_float("QUIRE_FAIR_SLOT_TTL_S", 10.0),
    # a sent unit not claimed within this long counts as lost: its credit returns and the
    # stale-dispatch sweep sends the job again
    "FAIR_LOST_S": env_float("QUIRE_FAIR_LOST_S", 30.0),
    # a running attempt yields at a checkpoint batch after this long when another tenant waits
    # with no free slot; 0: never
    "FAIR_SLICE_S": env_float("QUIRE_FAIR_SLICE_S", 30.0),
    # past its slice, how often a running unit asks whether another tenant waits (at a page
    # boundary): the longest another tenant waits for a yield, beyond the page in progress
    "FAIR_CHECK_S": env_float("QUIRE_FAIR_CHECK_S", 0.1),
    # Stepping aside (ADR 0022): a LibreOffice conversion still running after this long, while
    # a unit waits and a spare pool process is free, hands its slot back and goes on at the
    # lowest CPU priority, its limit then the CPU time QUIRE_PREPARE_TIMEOUT_S (a wall clock
    # cap of WALL_FACTOR x that); 0: never. WORKER_SPARES: how many of a worker's pool processes
    # (the last by index) are spares, not slots (the Procfile runs concurrency + spares).
    "STEP_ASIDE_AFTER_S": env_float("QUIRE_STEP_ASIDE_AFTER_S", 1.0),
    "STEP_ASIDE_WALL_FACTOR": env_float("QUIRE_STEP_ASIDE_WALL_FACTOR", 4.0),
    "WORKER_SPARES": env_int("QUIRE_WORKER_SPARES", 0),
    # the window of the per-tenant page-share gauge and admin page
    "FAIR_SHARE_WINDOW_S": env_float("QUIRE_FAIR_SHARE_WINDOW_S", 300.0),
    "SWEEP_INTERVAL_S": env_float("QUIRE_SWEEP_INTERVAL_S", 1.0),
    # per-sweep interval overrides by short name (beat_schedules/schedule.py), applied by
    # install_beat_schedule: "apply_retention=60,remove_orphaned_artifacts=30"
    "SWEEP_INTERVALS_S": env_seconds_by_name("QUIRE_SWEEP_INTERVALS_S"),
    "LONG_POLL_MAX_S": 30,
    # sweep health (docs/OPERABILITY.md §7): a sweep is overdue past FACTOR x its interval since its
    # last success; one that never succeeded also gets the start-up grace, counted from the install.
    "SWEEP_OVERDUE_FACTOR": env_float("QUIRE_SWEEP_OVERDUE_FACTOR", 10.0),
    "SWEEP_STARTUP_GRACE_S": env_float("QUIRE_SWEEP_STARTUP_GRACE_S", 60.0),
    # waiting clients (ADR 0016): the SSE event stream
    "SSE_HEARTBEAT_S": env_float("QUIRE_SSE_HEARTBEAT_S", 15.0),
    "SSE_MAX_S": env_float("QUIRE_SSE_MAX_S", 300.0),
    "SSE_RETRY_MS": env_int("QUIRE_SSE_RETRY_MS", 1000),
    # retention
    "RESULT_RETENTION_S": env_float("QUIRE_RESULT_RETENTION_S", 7 * 86400),
    "OUTBOX_RETENTION_S": env_float("QUIRE_OUTBOX_RETENTION_S", 86400),
    "AUDIT_RETENTION_S": env_float("QUIRE_AUDIT_RETENTION_S", 400 * 86400),
    # delivered and failed webhook messages (and their attempts) are kept this long
    "WEBHOOK_RETENTION_S": env_float("QUIRE_WEBHOOK_RETENTION_S", 30 * 86400),
    # webhooks (docs/OPERABILITY.md, ADR 0020): the notifier's retry schedule (seconds after
    # each failed attempt; Svix's by default), the rotation grace of a replaced secret, how long
    # an endpoint may fail without a success before it is disabled
    "WEBHOOK_RETRY_SCHEDULE": env_str(
        "QUIRE_WEBHOOK_RETRY_SCHEDULE", "5,300,1800,7200,18000,36000,36000"
    ),
    "WEBHOOK_ROTATION_GRACE_S": env_float("QUIRE_WEBHOOK_ROTATION_GRACE_S", 86400.0),
    "WEBHOOK_DISABLE_AFTER_S": env_float("QUIRE_WEBHOOK_DISABLE_AFTER_S", 5 * 86400.0),
    # the transport (docs/THREAT_MODEL.md, SSRF): CIDRs and host names admitted although not
    # globally routable (empty: none), ports besides 80 and 443, the per-request timeout
    "WEBHOOK_ALLOWLIST": env_str("QUIRE_WEBHOOK_ALLOWLIST", ""),
    "WEBHOOK_ALLOWED_PORTS": env_str("QUIRE_WEBHOOK_ALLOWED_PORTS", ""),
    "WEBHOOK_TIMEOUT_S": env_float("QUIRE_WEBHOOK_TIMEOUT_S", 15.0),
    # a Retry-After answer delays the next attempt, at most this long
    "WEBHOOK_RETRY_AFTER_MAX_S": env_float("QUIRE_WEBHOOK_RETRY_AFTER_MAX_S", 3600.0),
    # at most this many deliveries in flight per endpoint, and in all (notifier threads)
    "WEBHOOK_ENDPOINT_CONCURRENCY": env_int("QUIRE_WEBHOOK_ENDPOINT_CONCURRENCY", 4),
    "WEBHOOK_CONCURRENCY": env_int("QUIRE_WEBHOOK_CONCURRENCY", 16),
    # the notifier's polling fallback (Postgres wakes it with NOTIFY on every commit)
    "WEBHOOK_POLL_S": env_float("QUIRE_WEBHOOK_POLL_S", 1.0),
}

if QUIRE["FAST_PUBLISH"] not in ("background", "inline"):
    raise ImproperlyConfigured("QUIRE_FAST_PUBLISH must be 'background' or 'inline'")

if QUIRE["JWT_JWKS_URL"] and not (QUIRE["JWT_ISSUER"] and QUIRE["JWT_AUDIENCE"]):
    raise ImproperlyConfigured("QUIRE_JWT_JWKS_URL needs QUIRE_JWT_ISSUER and QUIRE_JWT_AUDIENCE")

# --- Celery (project/celery.py reads these with namespace "CELERY") --------------------------
if os.environ.get("CELERY_BROKER_URL"):
    CELERY_BROKER_URL = os.environ["CELERY_BROKER_URL"]
    CELERY_BROKER_TRANSPORT_OPTIONS: dict = {
        "confirm_publish": True,
        "confirm_timeout": QUIRE["PUBLISH_CONFIRM_TIMEOUT_S"],
    }
else:
    _broker_dir = VAR_DIR / "broker"
    for _sub in ("queue", "processed", "control"):
        (_broker_dir / _sub).mkdir(parents=True, exist_ok=True)
    CELERY_BROKER_URL = "filesystem://"
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(_broker_dir / "queue"),
        "data_folder_out": str(_broker_dir / "queue"),
        "processed_folder": str(_broker_dir / "processed"),
        "control_folder": str(_broker_dir / "control"),
        "store_processed": False,
    }

AMQP_BROKER = CELERY_BROKER_URL.startswith(("amqp", "pyamqp"))
CONVERSION_QUEUE = "conversion.v1"
CONVERSION_EXCHANGE = "quire.conversion"
SWEEP_QUEUE = "quire.sweeps"
_quorum_args = {
    "x-queue-type": "quorum",
    "x-delivery-limit": 5,
    "x-dead-letter-exchange": "quire.dlx",
}
# The publisher only publishes (no configure permission), so queues are never declared by
# producers; deploy/rabbitmq/ declares them, workers declare passively-compatible copies.
CELERY_TASK_QUEUES = (
    Queue(
        CONVERSION_QUEUE,
        Exchange(CONVERSION_EXCHANGE, type="direct"),
        routing_key=CONVERSION_QUEUE,
        queue_arguments=_quorum_args if AMQP_BROKER else None,
        no_declare=AMQP_BROKER,
    ),
    Queue(
        SWEEP_QUEUE,
        Exchange("quire.sweeps", type="direct"),
        routing_key=SWEEP_QUEUE,
        queue_arguments=(
            {"x-message-ttl": 5000, "x-max-length": 100, "x-overflow": "drop-head"}
            if AMQP_BROKER
            else None
        ),
        no_declare=AMQP_BROKER,
    ),
)
CELERY_TASK_DEFAULT_QUEUE = CONVERSION_QUEUE
CELERY_TASK_ROUTES = {"tasks.sweeps.*": {"queue": SWEEP_QUEUE, "routing_key": SWEEP_QUEUE}}
CELERY_TASK_CREATE_MISSING_QUEUES = False
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_TASK_ACKS_ON_FAILURE_OR_TIMEOUT = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
# The sweeper's pool (the Procfile sets QUIRE_SWEEPER=1 on its line; ADR 0002, "The pool"): one
# thread on RabbitMQ, where the solo pool's acks could wait for a heartbeat tick; solo on the
# server-less broker, where the threads pool ran one sweep per polling interval (1 s).
if env_bool("QUIRE_SWEEPER", False):
    CELERY_WORKER_POOL = "threads" if AMQP_BROKER else "solo"
CELERY_TASK_IGNORE_RESULT = True
CELERY_RESULT_BACKEND = None
CELERY_TASK_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_TASK_DEFAULT_DELIVERY_MODE = "persistent"
# Every publish without its own policy (beat's sweeps, the outbox) goes through kombu's
# Connection.ensure: on a dead connection it reconnects once, revives the producer's channel and
# publishes again. Without it a long-lived producer (beat caches one for its lifetime) keeps
# publishing on the socket the broker closed, forever (docs/adr/0015-publishers-reconnect.md).
# One immediate retry, bounded by the connect timeout: a publish never blocks for long, and
# anything more is the outbox sweeper's job.
CELERY_TASK_PUBLISH_RETRY = True
CELERY_TASK_PUBLISH_RETRY_POLICY = {
    "max_retries": 1,
    "interval_start": 0,
    "interval_step": 0,
    "interval_max": 0,
}
CELERY_BROKER_CONNECTION_TIMEOUT = env_float("QUIRE_BROKER_CONNECT_TIMEOUT_S", 2.0)
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# Consumers (workers, the sweeper, Flower's event capture) and beat's first connection retry
# for as long as the broker is away; Celery's default gives up after 100 attempts (~50 min) and
# the worker exits. Publishes are bounded separately (CELERY_TASK_PUBLISH_RETRY_POLICY).
CELERY_BROKER_CONNECTION_MAX_RETRIES = None
CELERY_BROKER_HEARTBEAT = 10
CELERY_WORKER_DETECT_QUORUM_QUEUES = True
CELERY_WORKER_SEND_TASK_EVENTS = env_bool("QUIRE_TASK_EVENTS", True)
# The sweeper turns remote control off (Procfile): its replies would be published as the
# publisher user, which may not declare reply.celery.pidbox, so Flower's periodic inspect
# broadcasts made it log ACCESS_REFUSED. It sends no events or heartbeats either.
CELERY_WORKER_ENABLE_REMOTE_CONTROL = env_bool("QUIRE_REMOTE_CONTROL", True)
CELERY_WORKER_ENABLE_SOFT_SHUTDOWN_ON_IDLE = True
CELERY_WORKER_SOFT_SHUTDOWN_TIMEOUT = env_float("QUIRE_SOFT_SHUTDOWN_S", 10.0)
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
# Celery's Django fix-up closes every database connection after every task unless this is set:
# a new Postgres backend per job (fork + authentication) cost more Postgres CPU than the job's
# queries. With it Celery closes them every 2 x N tasks; CONN_MAX_AGE and the health check still
# apply, because the runner calls close_old_connections() before each claim.
CELERY_DB_REUSE_MAX = env_int("QUIRE_WORKER_DB_REUSE_MAX", 500)
CELERY_WORKER_CONSUMER = "project.celery:QuireConsumer"
# RabbitMQ 4 removes transient non-exclusive queues: make control / event queues exclusive.
CELERY_CONTROL_QUEUE_EXCLUSIVE = True
CELERY_CONTROL_QUEUE_DURABLE = False
CELERY_EVENT_QUEUE_EXCLUSIVE = True
CELERY_EVENT_QUEUE_DURABLE = False
CELERY_BEAT_SCHEDULER = "django_celery_beat.schedulers:DatabaseScheduler"
CELERY_BEAT_MAX_LOOP_INTERVAL = 1

# --- logging: structured, content-free (conversion_jobs/logging.py) ---------------------------
LOG_FORMAT = env_str("QUIRE_LOG_FORMAT", "text" if STANDALONE else "json")
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "filters": {"redact": {"()": "conversion_jobs.logging.RedactFilter"}},
    "formatters": {
        "json": {
            "()": "pythonjsonlogger.json.JsonFormatter",
            "fmt": "%(asctime)s %(levelname)s %(name)s %(message)s",
        },
        "text": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"},
    },
    "handlers": {
        "console": {
            "class": "logging.StreamHandler",
            "formatter": LOG_FORMAT,
            "filters": ["redact"],
        }
    },
    "root": {"handlers": ["console"], "level": env_str("QUIRE_LOG_LEVEL", "INFO")},
    "loggers": {
        "django.request": {"level": "ERROR"},
        # the server's own access log writes query strings: conversion_jobs.web.access
        # .AccessLog replaces it
        "uvicorn.access": {"level": "WARNING"},
        "quire.access": {"level": env_str("QUIRE_ACCESS_LOG_LEVEL", "INFO")},
        # what each sweep moved (counts only, only when it moved something), whatever the
        # sweeper's own -l level
        "quire.sweeps": {"level": "INFO"},
        # Celery's two INFO lines per task ("received", "succeeded in") cost the worker a log
        # record, a format and a write each per job (ADR 0017, session 4); failures and retries
        # are still logged at WARNING / ERROR. QUIRE_TASK_LOG_LEVEL=INFO brings them back.
        "celery.app.trace": {"level": env_str("QUIRE_TASK_LOG_LEVEL", "WARNING")},
        "celery.worker.strategy": {"level": env_str("QUIRE_TASK_LOG_LEVEL", "WARNING")},
    },
}
