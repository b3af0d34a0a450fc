"""The tables of docs/DATA_MODEL.md, with their invariants in the database.

Every state change goes through ``conversion_jobs.services`` as one guarded UPDATE; nothing
here saves a job after reading it.
"""

from __future__ import annotations

import uuid

from django.db import models
from django.db.models import F, Q
from django.db.models.functions import Now

from conversion_jobs.states import LEASED_STATES, LIVE_STATES, TERMINAL_STATES, State


def _in(states: frozenset[State]) -> list[str]:
    return sorted(s.value for s in states)


class Output(models.TextChoices):
    #: UTF-8 text, pages separated by form feeds.
    TEXT = "text"
    #: A ZIP of one PNG per page.
    PNG = "png"
    #: One PDF document.
    PDF = "pdf"


class ConversionJobQuerySet(models.QuerySet["ConversionJob"]):
    def for_tenant(self, tenant: str) -> ConversionJobQuerySet:
        return self.filter(tenant=tenant)

    def live(self) -> ConversionJobQuerySet:
        return self.filter(state__in=_in(LIVE_STATES))

    def due_for_retry(self) -> ConversionJobQuerySet:
        return self.filter(state=State.RETRY_WAIT, next_attempt_at__lte=Now())


class ConversionJob(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    tenant = models.CharField(max_length=64)
    state = models.CharField(max_length=16, choices=State.choices, default=State.QUEUED)
    generation = models.PositiveIntegerField(default=1)
    state_version = models.PositiveIntegerField(default=1)

    source_key = models.CharField(max_length=128)
    source_sha256 = models.CharField(max_length=64)
    source_size = models.BigIntegerField()
    source_media_type = models.CharField(max_length=128)
    source_page_count = models.PositiveIntegerField(null=True, blank=True)
    pages_done = models.PositiveIntegerField(default=0)
    pages_failed = models.PositiveIntegerField(default=0)

    output = models.CharField(max_length=8, choices=Output.choices)
    options = models.JSONField(default=dict)
    #: sha256 of the canonical JSON of ``options``: part of the content identity.
    options_digest = models.CharField(max_length=64)
    #: ``options.password`` sealed with the service key (``conversion_jobs/passwords.py``) while
    #: the job may still run; wiped (NULL) once it is terminal. Never in ``options`` or the API.
    password_sealed = models.TextField(null=True, blank=True, editable=False)
    policy_version = models.PositiveIntegerField(default=1)
    #: the client's own ``metadata`` object (at most 2 KB of JSON), echoed in the job and its
    #: webhook events; not part of the content identity (docs/API_CONTRACT.md §3)
    metadata = models.JSONField(null=True, blank=True)

    attempts = models.PositiveIntegerField(default=0)
    max_attempts = models.PositiveIntegerField(default=5)
    next_attempt_at = models.DateTimeField(null=True, blank=True)
    queued_at = models.DateTimeField(null=True, blank=True)
    # fair dispatch (docs/ARCHITECTURE.md §2b): what one dispatch of this job costs, in page
    # units (services/fair.py ``dispatch_cost``), and which generation was last sent to a worker
    dispatch_cost = models.PositiveIntegerField(default=1, db_default=1)
    dispatched_generation = models.PositiveIntegerField(null=True, blank=True)
    dispatched_at = models.DateTimeField(null=True, blank=True)
    #: The fence: set at claim, cleared when the lease ends. ``worker_lease`` holds its expiry.
    lease_token = models.UUIDField(null=True, blank=True)
    #: The lease of an attempt that stepped aside (ADR 0022): while it equals ``lease_token``
    #: the job's slot is handed back (the fair relay's busy count skips it). Never cleared: the
    #: next claim's new token ends it.
    aside_lease = models.UUIDField(null=True, blank=True)
    traceparent = models.CharField(max_length=64, blank=True, default="")

    result_key = models.CharField(max_length=128, null=True, blank=True)
    result_sha256 = models.CharField(max_length=64, null=True, blank=True)
    result_size = models.BigIntegerField(null=True, blank=True)
    result_media_type = models.CharField(max_length=64, null=True, blank=True)

    error_code = models.CharField(max_length=64, null=True, blank=True)
    error_retryable = models.BooleanField(default=False)
    error_detail = models.CharField(max_length=256, blank=True, default="")

    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    #: Retention: the result and artifacts expired (rows first) ...
    expired_at = models.DateTimeField(null=True, blank=True)
    #: ... and their files were deleted (files second; a crash in between is redone).
    purged_at = models.DateTimeField(null=True, blank=True)
    #: The head of this job's audit hash chain (its last event's seq and hash): an append reads
    #: and moves it under the job row's lock, in the statement that moves the job.
    audit_seq = models.PositiveIntegerField(default=0)
    audit_head = models.CharField(max_length=64, default="0" * 64)

    objects = ConversionJobQuerySet.as_manager()

    class Meta:
        db_table = "conversion_job"
        constraints = [
            models.CheckConstraint(
                name="job_terminal_iff_finished",
                condition=(Q(state__in=_in(TERMINAL_STATES)) & Q(finished_at__isnull=False))
                | (~Q(state__in=_in(TERMINAL_STATES)) & Q(finished_at__isnull=True)),
            ),
            models.CheckConstraint(
                name="job_retry_wait_has_timer",
                condition=~Q(state=State.RETRY_WAIT) | Q(next_attempt_at__isnull=False),
            ),
            models.CheckConstraint(
                name="job_leased_iff_token",
                condition=(Q(state__in=_in(LEASED_STATES)) & Q(lease_token__isnull=False))
                | (~Q(state__in=_in(LEASED_STATES)) & Q(lease_token__isnull=True)),
            ),
            models.CheckConstraint(
                name="job_published_has_result",
                condition=~Q(state__in=[State.SUCCEEDED, State.PARTIAL])
                | Q(result_key__isnull=False, result_sha256__isnull=False),
            ),
            models.CheckConstraint(
                name="job_failed_has_code",
                condition=~Q(state=State.FAILED) | Q(error_code__isnull=False),
            ),
            models.CheckConstraint(name="job_generation_positive", condition=Q(generation__gte=1)),
            models.CheckConstraint(
                name="job_purged_after_expired",
                condition=Q(purged_at__isnull=True) | Q(expired_at__isnull=False),
            ),
            models.CheckConstraint(
                name="job_attempts_within_max", condition=Q(attempts__lte=models.F("max_attempts"))
            ),
            models.UniqueConstraint(
                name="job_content_identity_live_or_succeeded",
                fields=["tenant", "source_sha256", "output", "options_digest", "policy_version"],
                # Expired jobs leave the identity: their result is gone, a resubmit is new work.
                condition=Q(
                    state__in=[*_in(LIVE_STATES), State.SUCCEEDED.value], expired_at__isnull=True
                ),
            ),
        ]
        indexes = [
            models.Index(name="job_tenant_created", fields=["tenant", "-created_at", "-id"]),
            models.Index(
                name="job_password_sealed",
                fields=["state"],
                condition=Q(password_sealed__isnull=False),
            ),
            models.Index(
                name="job_live_tenant",
                fields=["tenant"],
                condition=Q(state__in=_in(LIVE_STATES)),
            ),
            models.Index(
                name="job_retry_due",
                fields=["next_attempt_at"],
                condition=Q(state=State.RETRY_WAIT),
            ),
            models.Index(
                name="job_queued_since", fields=["queued_at"], condition=Q(state=State.QUEUED)
            ),
            # the repair sweep's candidates: leased jobs only (one per running attempt)
            models.Index(
                name="job_leased", fields=["id"], condition=Q(state__in=_in(LEASED_STATES))
            ),
            # retention and the orphan sweep ask who still uses a (shared) source
            models.Index(name="job_source_sha256", fields=["source_sha256"]),
            # the fair relay's "sent, not yet claimed" count: queued jobs that were dispatched
            models.Index(
                name="job_dispatched_queued",
                fields=["dispatched_at"],
                condition=Q(state=State.QUEUED, dispatched_at__isnull=False),
            ),
            models.Index(
                name="job_expired_unpurged",
                fields=["expired_at"],
                condition=Q(expired_at__isnull=False, purged_at__isnull=True),
            ),
            models.Index(
                name="job_finished_unexpired",
                fields=["finished_at"],
                condition=Q(finished_at__isnull=False, expired_at__isnull=True),
            ),
        ]

    def __str__(self) -> str:
        return f"job {self.id} ({self.state})"


class ConversionOutbox(models.Model):
    id = models.BigAutoField(primary_key=True)
    job = models.ForeignKey(ConversionJob, on_delete=models.CASCADE, related_name="outbox")
    generation = models.PositiveIntegerField()
    traceparent = models.CharField(max_length=64, blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)
    published_at = models.DateTimeField(null=True, blank=True)
    publish_attempts = models.PositiveIntegerField(default=0)
    last_error_code = models.CharField(max_length=64, null=True, blank=True)
    #: A page range's message (``job_range``, ADR 0023): the range's first page and its
    #: generation; both null for the job's own message.
    range_first = models.PositiveIntegerField(null=True, blank=True)
    range_generation = models.PositiveIntegerField(null=True, blank=True)
    #: this dispatch unit's cost in page units when it is not the job's whole ``dispatch_cost``
    #: (a page range's); NULL: the job's
    cost = models.PositiveIntegerField(null=True, blank=True)
    #: the job's tenant, copied by a Postgres trigger on insert (migration 0020), so the fair
    #: pick reads each tenant's first waiting units from ``outbox_waiting_tenant`` instead of
    #: ordering every waiting unit (ADR 0021, "The pick's cost"). NULL on SQLite (its pick
    #: reads the job's).
    tenant = models.CharField(max_length=64, null=True, blank=True, editable=False)

    class Meta:
        db_table = "conversion_outbox"
        indexes = [
            models.Index(
                name="outbox_unpublished", fields=["id"], condition=Q(published_at__isnull=True)
            ),
            models.Index(
                name="outbox_waiting_tenant",
                fields=["tenant", "id"],
                condition=Q(published_at__isnull=True),
            ),
            models.Index(
                name="outbox_published_at",
                fields=["published_at"],
                condition=Q(published_at__isnull=False),
            ),
        ]

    def __str__(self) -> str:
        return f"outbox {self.id} job {self.job_id} g{self.generation}"


class AttemptOutcome(models.TextChoices):
    #: The attempt published the result (succeeded or partial).
    SUCCEEDED = "succeeded"
    #: A retryable error: the job went to retry_wait (or failed, attempts exhausted).
    RETRYABLE_ERROR = "retryable_error"
    #: A terminal error: the job failed.
    TERMINAL_ERROR = "terminal_error"
    #: The lease ended before the attempt did (expiry, another worker, a fenced write lost).
    LEASE_LOST = "lease_lost"
    #: The job was cancelled during the attempt.
    CANCELLED = "cancelled"
    #: The attempt used its fair-share slice while another tenant waited and gave its worker
    #: back (the job is queued again; not counted as an attempt).
    YIELDED = "yielded"


class ConversionAttempt(models.Model):
    id = models.BigAutoField(primary_key=True)
    job = models.ForeignKey(ConversionJob, on_delete=models.CASCADE, related_name="attempt_set")
    generation = models.PositiveIntegerField()
    number = models.PositiveIntegerField()
    worker = models.CharField(max_length=128)
    started_at = models.DateTimeField(auto_now_add=True)
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    outcome = models.CharField(max_length=16, choices=AttemptOutcome.choices, null=True)
    error_code = models.CharField(max_length=64, null=True, blank=True)
    pages_converted = models.PositiveIntegerField(default=0)

    class Meta:
        db_table = "conversion_attempt"
        constraints = [
            # One claim per generation: the claim CAS makes a second one impossible anyway.
            models.UniqueConstraint(
                name="attempt_one_per_generation", fields=["job", "generation"]
            ),
            models.CheckConstraint(
                name="attempt_outcome_iff_finished",
                condition=Q(outcome__isnull=True, finished_at__isnull=True)
                | Q(outcome__isnull=False, finished_at__isnull=False),
            ),
        ]
        indexes = [
            models.Index(
                name="attempt_open", fields=["job"], condition=Q(finished_at__isnull=True)
            ),
        ]

    def __str__(self) -> str:
        return f"attempt {self.id} job {self.job_id} g{self.generation}"


class WorkerLease(models.Model):
    job = models.OneToOneField(
        ConversionJob, on_delete=models.CASCADE, primary_key=True, related_name="lease"
    )
    generation = models.PositiveIntegerField()
    attempt = models.ForeignKey(ConversionAttempt, on_delete=models.CASCADE)
    token = models.UUIDField()
    expires_at = models.DateTimeField()

    class Meta:
        db_table = "worker_lease"
        indexes = [models.Index(name="lease_expires", fields=["expires_at"])]

    def __str__(self) -> str:
        return f"lease job {self.job_id} g{self.generation}"


class PageState(models.TextChoices):
    #: Not converted yet (or failed with attempts left).
    PENDING = "pending"
    #: Converted, promoted to storage, checkpointed.
    DONE = "done"
    #: Failed permanently (its own attempt budget is spent).
    FAILED = "failed"


class PageCheckpoint(models.Model):
    id = models.BigAutoField(primary_key=True)
    job = models.ForeignKey(ConversionJob, on_delete=models.CASCADE, related_name="pages")
    page_number = models.PositiveIntegerField()
    state = models.CharField(max_length=8, choices=PageState.choices, default=PageState.PENDING)
    attempts = models.PositiveIntegerField(default=0)
    artifact_key = models.CharField(max_length=160, null=True, blank=True)
    artifact_sha256 = models.CharField(max_length=64, null=True, blank=True)
    artifact_size = models.BigIntegerField(null=True, blank=True)
    media_type = models.CharField(max_length=64, null=True, blank=True)
    error_code = models.CharField(max_length=64, null=True, blank=True)
    generation = models.PositiveIntegerField()
    updated_at = models.DateTimeField(auto_now=True)
    #: A small (text) page artifact stored in the row itself, written with its checkpoint: no
    #: file, no fsync of its own. ``artifact_key`` is then ``inline:`` + the page's would-be key.
    content = models.BinaryField(null=True, blank=True)

    class Meta:
        db_table = "page_checkpoint"
        constraints = [
            models.UniqueConstraint(name="page_unique_per_job", fields=["job", "page_number"]),
            models.CheckConstraint(
                name="page_done_has_artifact",
                condition=~Q(state=PageState.DONE)
                | Q(artifact_key__isnull=False, artifact_sha256__isnull=False),
            ),
            models.CheckConstraint(name="page_number_positive", condition=Q(page_number__gte=1)),
        ]

    def __str__(self) -> str:
        return f"page {self.page_number} of job {self.job_id} ({self.state})"


class RangeState(models.TextChoices):
    #: Waiting for a worker; a message for its generation is (or will be) in the queue.
    QUEUED = "queued"
    #: Claimed by a worker that holds the range's lease (``lease_token``, ``expires_at``).
    RUNNING = "running"
    #: Every page of the range is checkpointed (done or failed).
    DONE = "done"
    #: The job was cancelled, or left the fanned-out run this range belonged to.
    CANCELLED = "cancelled"


class JobRange(models.Model):
    """A page range of a fanned-out job (ADR 0023): a fenced unit of work with its own lease and
    generation, claimed by any worker. Its pages' checkpoints stay the job's (``page_checkpoint``,
    absolute page numbers). ``job_generation`` is the job generation that planned it: every write
    of the range is fenced on the job's generation and lease token too."""

    id = models.BigAutoField(primary_key=True)
    job = models.ForeignKey(ConversionJob, on_delete=models.CASCADE, related_name="ranges")
    job_generation = models.PositiveIntegerField()
    first_page = models.PositiveIntegerField()
    last_page = models.PositiveIntegerField()
    state = models.CharField(max_length=10, choices=RangeState.choices, default=RangeState.QUEUED)
    generation = models.PositiveIntegerField(default=1)
    lease_token = models.UUIDField(null=True, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    attempts = models.PositiveIntegerField(default=0)
    worker = models.CharField(max_length=128, blank=True, default="")
    #: the document the range's pages are taken from when it is not the job's source (the PDF
    #: an Office document was converted to once, by the planner): a ``pages/<job>/00000`` key
    document_key = models.CharField(max_length=160, null=True, blank=True)
    #: when the fair relay last sent this range's message: a range sent and not yet claimed
    #: holds a slot for ``QUIRE_FAIR_LOST_S`` (ADR 0021 "Page ranges")
    dispatched_at = models.DateTimeField(null=True, blank=True)
    #: when the range's current generation was claimed (its worker's start: timelines, ADR 0023)
    claimed_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        db_table = "job_range"
        constraints = [
            models.UniqueConstraint(name="range_unique_per_job", fields=["job", "first_page"]),
            models.CheckConstraint(
                name="range_pages_ordered",
                condition=Q(first_page__gte=1, last_page__gte=F("first_page")),
            ),
            models.CheckConstraint(
                name="range_running_leased",
                condition=~Q(state="running")
                | Q(lease_token__isnull=False, expires_at__isnull=False),
            ),
        ]
        indexes = [
            models.Index(
                name="range_running_expires",
                fields=["expires_at"],
                condition=Q(state="running"),
            ),
            # the fair pick's busy count and waiting set read only live ranges
            models.Index(
                name="range_live",
                fields=["job"],
                condition=Q(state__in=["queued", "running"]),
            ),
        ]

    def __str__(self) -> str:
        return f"range {self.first_page}-{self.last_page} of job {self.job_id} ({self.state})"


class InlineSource(models.Model):
    """A small source's bytes, stored with its job in the acceptance's own statement (no
    staging file, no store put; ADR 0017 session 10). The job's ``source_key`` is then
    ``inline:`` + the key a stored copy would have (``storage.inline_source_key``). One row per
    job (replays and content-identity duplicates answer from the existing job and write none);
    deleted with the job (``ON DELETE CASCADE`` on Postgres) and by the retention purge."""

    job = models.OneToOneField(
        ConversionJob,
        on_delete=models.CASCADE,
        primary_key=True,
        related_name="inline_source",
        # The constraint is migration 0012's own, with ON DELETE CASCADE on Postgres.
        db_constraint=False,
    )
    #: The source's bytes (at most ``QUIRE_INLINE_SOURCE_MAX_BYTES``). On Postgres the column's
    #: storage is EXTERNAL: documents are compressed formats already, not worth compressing again.
    content = models.BinaryField()

    class Meta:
        db_table = "inline_source"

    def __str__(self) -> str:
        return f"inline source of job {self.job_id}"


class CancellationOutcome(models.TextChoices):
    #: queued / retry_wait -> cancelled at once.
    CANCELLED = "cancelled"
    #: running -> cancelling; resolved when the worker (or the lease sweep) ends it.
    CANCELLING = "cancelling"
    #: The job was already cancelling or cancelled: nothing changed.
    ALREADY_CANCELLED = "already_cancelled"
    #: The job had already finished: 409, the result stands.
    TOO_LATE = "too_late"
    #: The cancel lost the race to a completion that committed first.
    LOST_TO_COMPLETION = "lost_to_completion"


class CancellationRequest(models.Model):
    id = models.BigAutoField(primary_key=True)
    job = models.ForeignKey(ConversionJob, on_delete=models.CASCADE, related_name="cancellations")
    tenant = models.CharField(max_length=64)
    actor = models.CharField(max_length=64)
    generation_seen = models.PositiveIntegerField()
    state_seen = models.CharField(max_length=16, choices=State.choices)
    requested_at = models.DateTimeField(auto_now_add=True)
    resolved_at = models.DateTimeField(null=True, blank=True)
    outcome = models.CharField(max_length=20, choices=CancellationOutcome.choices)

    class Meta:
        db_table = "cancellation_request"
        indexes = [
            models.Index(
                name="cancel_unresolved", fields=["job"], condition=Q(resolved_at__isnull=True)
            )
        ]

    def __str__(self) -> str:
        return f"cancel {self.id} job {self.job_id} ({self.outcome})"


class IdempotencyRecord(models.Model):
    id = models.BigAutoField(primary_key=True)
    tenant = models.CharField(max_length=64)
    key = models.CharField(max_length=255)
    fingerprint = models.CharField(max_length=64)
    job = models.ForeignKey(ConversionJob, on_delete=models.CASCADE, related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        db_table = "idempotency_record"
        constraints = [
            models.UniqueConstraint(name="idempotency_tenant_key", fields=["tenant", "key"])
        ]

    def __str__(self) -> str:
        return f"idempotency {self.id} job {self.job_id}"


class ExecutionAuditEvent(models.Model):
    """Append-only evidence, hash-chained per job. Postgres rejects UPDATE/DELETE by trigger."""

    id = models.BigAutoField(primary_key=True)
    # No foreign key: audit events outlive the job rows they describe (their own retention).
    job_id = models.UUIDField()
    seq = models.PositiveIntegerField()
    event_type = models.CharField(max_length=48)
    generation = models.PositiveIntegerField(null=True)
    attempt_id = models.BigIntegerField(null=True)
    actor = models.CharField(max_length=64)
    details = models.JSONField(default=dict)
    created_at = models.DateTimeField()
    prev_hash = models.CharField(max_length=64)
    hash = models.CharField(max_length=64)

    class Meta:
        db_table = "execution_audit_event"
        constraints = [
            models.UniqueConstraint(name="audit_seq_per_job", fields=["job_id", "seq"]),
        ]
        indexes = [models.Index(name="audit_created", fields=["created_at"])]

    def __str__(self) -> str:
        return f"audit {self.job_id}#{self.seq} {self.event_type}"


class SweepStatus(models.Model):
    """One row per beat sweep (docs/DATA_MODEL.md §8a): ``install_beat_schedule`` writes its
    interval and install time, the sweep itself writes ``last_success_at`` each time it finishes.
    Any web process reads them, so ``/health/ready`` and the gauge see a stalled beat or sweeper."""

    name = models.CharField(max_length=64, primary_key=True)
    interval_s = models.FloatField()
    installed_at = models.DateTimeField()
    last_success_at = models.DateTimeField(null=True)

    class Meta:
        db_table = "sweep_status"

    def __str__(self) -> str:
        return f"sweep {self.name}"


class DocumentQuarantine(models.Model):
    """One document of one tenant under one engine version whose converter crashed
    (docs/DATA_MODEL.md §8c, services/quarantine.py). Never keyed across tenants. The row is
    also the lock its crash recorders take (an upsert), so two crashes recorded at once are
    counted in turn; ``crashes`` is the count of its ``document_crash`` rows, written under
    that lock. Quarantined while ``quarantined_at`` is set."""

    id = models.BigAutoField(primary_key=True)
    tenant = models.CharField(max_length=64)
    source_sha256 = models.CharField(max_length=64)
    #: the converter's engine and its version (``converters.engine_version``)
    engine_version = models.CharField(max_length=128)
    crashes = models.PositiveIntegerField(default=0)
    hosts = models.PositiveIntegerField(default=0)
    quarantined_at = models.DateTimeField(null=True, blank=True)
    #: the job failed ``document_quarantined`` when the quarantine began
    job_id = models.UUIDField(null=True, blank=True)
    lifted_at = models.DateTimeField(null=True, blank=True)
    #: pseudonymous operator who lifted it last
    lifted_by = models.CharField(max_length=64, blank=True, default="")
    created_at = models.DateTimeField()
    updated_at = models.DateTimeField()

    class Meta:
        db_table = "document_quarantine"
        constraints = [
            models.UniqueConstraint(
                name="quarantine_key", fields=["tenant", "source_sha256", "engine_version"]
            )
        ]
        indexes = [
            models.Index(
                name="quarantine_active",
                fields=["quarantined_at"],
                condition=Q(quarantined_at__isnull=False),
            )
        ]

    def __str__(self) -> str:
        return f"quarantine {self.id}"


class DocumentCrash(models.Model):
    """One attempt whose converter crashed on the document of ``quarantine``."""

    id = models.BigAutoField(primary_key=True)
    quarantine = models.ForeignKey(
        DocumentQuarantine, on_delete=models.CASCADE, related_name="crash_rows"
    )
    job_id = models.UUIDField()
    attempt_id = models.BigIntegerField()
    #: the machine (``QUIRE_WORKER_HOST``), never a tenant or a file name
    host = models.CharField(max_length=128)
    code = models.CharField(max_length=64)
    at = models.DateTimeField()

    class Meta:
        db_table = "document_crash"
        constraints = [models.UniqueConstraint(name="crash_one_per_attempt", fields=["attempt_id"])]

    def __str__(self) -> str:
        return f"crash {self.id}"


class TenantErasure(models.Model):
    """The record of one tenant's erasure (docs/DATA_MODEL.md §8d, services/erasure.py): the
    tenant only as its pseudonym, what was deleted, when and by whom. ``finished_at`` null: in
    progress (a new run resumes it); ``step`` says how far it got."""

    id = models.BigAutoField(primary_key=True)
    tenant_pseudonym = models.CharField(max_length=32)
    actor = models.CharField(max_length=64)
    step = models.CharField(max_length=16, default="cancel")
    jobs_cancelled = models.PositiveIntegerField(default=0)
    jobs_deleted = models.PositiveIntegerField(default=0)
    rows_deleted = models.PositiveIntegerField(default=0)
    audit_events_deleted = models.PositiveIntegerField(default=0)
    objects_deleted = models.PositiveIntegerField(default=0)
    runs = models.PositiveIntegerField(default=0)
    started_at = models.DateTimeField()
    updated_at = models.DateTimeField()
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "tenant_erasure"
        constraints = [
            models.UniqueConstraint(
                name="erasure_one_open_per_tenant",
                fields=["tenant_pseudonym"],
                condition=Q(finished_at__isnull=True),
            )
        ]

    def __str__(self) -> str:
        return f"erasure {self.id}"


class ErasureObject(models.Model):
    """An object (or a key prefix) of an erased tenant still to delete from the artifact store:
    written with the rows that named it, deleted once the object is gone (rows first, files
    second, resumable)."""

    id = models.BigAutoField(primary_key=True)
    erasure = models.ForeignKey(TenantErasure, on_delete=models.CASCADE, related_name="+")
    #: ``prefix`` (a job's results/ or pages/), ``source`` (a shared, content-addressed source)
    kind = models.CharField(max_length=8)
    key = models.CharField(max_length=160)

    class Meta:
        db_table = "erasure_object"

    def __str__(self) -> str:
        return f"erasure object {self.id}"


class TenantShare(models.Model):
    """A tenant's fair-share settings and the relay's virtual time for it (docs/DATA_MODEL.md,
    ``tenant_share``). ``weight`` and ``running_cap`` are the operator's (admin, manage command
    ``tenant_share``); ``vtime`` is written only by the fair relay, under its lock."""

    tenant = models.CharField(max_length=64, primary_key=True)
    weight = models.PositiveIntegerField(default=1)
    #: at most this many of the tenant's dispatch units running or sent at once; NULL: no cap
    running_cap = models.PositiveIntegerField(null=True, blank=True)
    #: virtual finish time of the tenant's last dispatched unit (page units / weight)
    vtime = models.FloatField(default=0.0)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        db_table = "tenant_share"
        constraints = [
            models.CheckConstraint(
                name="tenant_share_weight_range", condition=Q(weight__gte=1, weight__lte=1000)
            ),
            models.CheckConstraint(
                name="tenant_share_cap_positive",
                condition=Q(running_cap__isnull=True) | Q(running_cap__gte=1),
            ),
        ]

    def __str__(self) -> str:
        return "tenant share"


class DispatchClock(models.Model):
    """The fair relay's system virtual time (one row, id 1): the start tag of the last unit it
    dispatched. A tenant that was idle starts again from here, never from its old ``vtime``."""

    id = models.PositiveSmallIntegerField(primary_key=True, default=1)
    vclock = models.FloatField(default=0.0)

    class Meta:
        db_table = "dispatch_clock"
        constraints = [models.CheckConstraint(name="dispatch_clock_one_row", condition=Q(id=1))]

    def __str__(self) -> str:
        return f"dispatch clock {self.vclock}"


class WorkerSlot(models.Model):
    """One conversion slot (a worker pool process) that announced itself; the fair relay's
    credits are the slots seen within ``QUIRE_FAIR_SLOT_TTL_S`` (services/fair.py)."""

    name = models.CharField(max_length=160, primary_key=True)
    slots = models.PositiveSmallIntegerField(default=1)
    seen_at = models.DateTimeField()

    class Meta:
        db_table = "worker_slot"

    def __str__(self) -> str:
        return f"worker slot {self.name}"


# The webhook tables live beside their service (conversion_jobs/webhooks/); imported here so
# the app registers them.
from conversion_jobs.webhooks.models import (  # noqa: E402, F401
    EventType,
    MessageState,
    WebhookAttempt,
    WebhookEndpoint,
    WebhookMessage,
)
