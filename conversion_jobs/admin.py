"""Django admin for operators (staff only): read-only views, the actions (cancel, retry,
lift a quarantine) that go through the same services as the API and the manage commands, and
the tenants' fair-share settings."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest

from conversion_jobs.exceptions import QuireError
from conversion_jobs.models import (
    CancellationRequest,
    ConversionAttempt,
    ConversionJob,
    DocumentQuarantine,
    ExecutionAuditEvent,
    PageCheckpoint,
    TenantErasure,
    TenantShare,
)
from conversion_jobs.pseudonym import actor_pseudonym
from conversion_jobs.services import fair
from conversion_jobs.services.cancellation import conversion_job_cancel
from conversion_jobs.services.quarantine import document_quarantine_lift
from conversion_jobs.services.recovery import conversion_job_retry_failed


class ReadOnlyAdmin(admin.ModelAdmin):
    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class ReadOnlyWithActionsAdmin(ReadOnlyAdmin):
    """Read-only but for its ``actions``: they need "change" on the changelist; the form
    itself stays read-only."""

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return obj is None and bool(request.user.is_staff)

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        return [f.name for f in self.model._meta.fields]


def _operator(request: HttpRequest) -> str:
    return actor_pseudonym(tenant="operators", subject=str(request.user.pk))


@admin.action(description="Cancel selected jobs")
def cancel_jobs(modeladmin: Any, request: HttpRequest, queryset: QuerySet[ConversionJob]) -> None:
    for job in queryset:
        try:
            result = conversion_job_cancel(
                job_id=job.id, tenant=job.tenant, actor=_operator(request)
            )
            modeladmin.message_user(request, f"{job.id}: {result.outcome}")
        except QuireError as exc:
            modeladmin.message_user(request, f"{job.id}: {exc.code}", level=messages.WARNING)


@admin.action(description="Retry selected failed or cancelled jobs")
def retry_jobs(modeladmin: Any, request: HttpRequest, queryset: QuerySet[ConversionJob]) -> None:
    for job in queryset:
        try:
            conversion_job_retry_failed(job_id=job.id, tenant=None, actor=_operator(request))
            modeladmin.message_user(request, f"{job.id}: queued")
        except QuireError as exc:
            modeladmin.message_user(request, f"{job.id}: {exc.code}", level=messages.WARNING)


@admin.register(ConversionJob)
class ConversionJobAdmin(ReadOnlyWithActionsAdmin):
    list_display = ("id", "state", "generation", "output", "attempts", "created_at", "finished_at")
    list_filter = ("state", "output")
    search_fields = ("id",)
    actions = [cancel_jobs, retry_jobs]


@admin.register(ConversionAttempt)
class ConversionAttemptAdmin(ReadOnlyAdmin):
    list_display = (
        "id",
        "job_id",
        "generation",
        "number",
        "worker",
        "outcome",
        "started_at",
        "finished_at",
    )
    list_filter = ("outcome",)


@admin.register(PageCheckpoint)
class PageCheckpointAdmin(ReadOnlyAdmin):
    list_display = ("job_id", "page_number", "state", "attempts", "generation", "error_code")
    list_filter = ("state",)


@admin.register(CancellationRequest)
class CancellationRequestAdmin(ReadOnlyAdmin):
    list_display = (
        "job_id",
        "outcome",
        "generation_seen",
        "state_seen",
        "requested_at",
        "resolved_at",
    )
    list_filter = ("outcome",)


@admin.register(ExecutionAuditEvent)
class ExecutionAuditEventAdmin(ReadOnlyAdmin):
    list_display = ("job_id", "seq", "event_type", "generation", "created_at")
    list_filter = ("event_type",)


@admin.action(description="Lift the quarantine of the selected documents")
def lift_quarantines(
    modeladmin: Any, request: HttpRequest, queryset: QuerySet[DocumentQuarantine]
) -> None:
    for row in queryset:
        lifted = document_quarantine_lift(quarantine_id=row.id, actor=_operator(request))
        modeladmin.message_user(request, f"{row.id}: {'lifted' if lifted else 'not quarantined'}")


@admin.register(DocumentQuarantine)
class DocumentQuarantineAdmin(ReadOnlyWithActionsAdmin):
    """Poison documents (docs/OPERABILITY.md "Quarantine"): read-only but for the lift."""

    list_display = (
        "id",
        "engine_version",
        "crashes",
        "hosts",
        "quarantined_at",
        "job_id",
        "lifted_at",
    )
    list_filter = (("quarantined_at", admin.EmptyFieldListFilter),)
    search_fields = ("=job_id",)
    actions = [lift_quarantines]


@admin.register(TenantErasure)
class TenantErasureAdmin(ReadOnlyAdmin):
    list_display = (
        "id",
        "tenant_pseudonym",
        "step",
        "jobs_deleted",
        "rows_deleted",
        "objects_deleted",
        "started_at",
        "finished_at",
    )


_fairness = threading.local()


def _fairness_column(
    description: str, value: Callable[[fair.TenantFairness], Any], none: Any
) -> Callable[[Any, TenantShare], Any]:
    """A column of the fair-share list: ``value`` of the tenant's row of the stats read for
    this page (``none`` for a tenant with none)."""

    @admin.display(description=description)
    def column(modeladmin: Any, obj: TenantShare) -> Any:
        row = getattr(_fairness, "stats", {}).get(obj.tenant)
        return value(row) if row else none

    return column


@admin.register(TenantShare)
class TenantShareAdmin(admin.ModelAdmin):
    """Fair share per tenant (docs/OPERABILITY.md "Fair share"): operators set the weight and
    the running cap; the backlog, running work and share of pages over the last
    ``QUIRE_FAIR_SHARE_WINDOW_S`` are read when the page is shown. ``vtime`` is the relay's."""

    list_display = (
        "tenant",
        "weight",
        "running_cap",
        "backlog",
        "backlog_cost",
        "running",
        "pages_in_window",
        "page_share",
    )
    fields = ("tenant", "weight", "running_cap", "vtime", "updated_at")
    readonly_fields = ("vtime", "updated_at")
    search_fields = ("tenant",)

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> tuple[str, ...]:
        return ("tenant", "vtime", "updated_at") if obj is not None else ("vtime", "updated_at")

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def changelist_view(self, request: HttpRequest, extra_context: Any = None) -> Any:
        stats = {row.tenant: row for row in fair.tenants_fairness()}
        # a tenant whose work has never been sent has no row yet: list it too
        TenantShare.objects.bulk_create(
            [TenantShare(tenant=t) for t in stats], ignore_conflicts=True
        )
        _fairness.stats = stats
        try:
            response = super().changelist_view(request, extra_context)
            if hasattr(response, "render"):  # the columns read the stats while rendering
                response.render()
            return response
        finally:
            _fairness.stats = {}

    backlog = _fairness_column("backlog (units)", lambda row: row.backlog_units, 0)
    backlog_cost = _fairness_column("backlog (page units)", lambda row: row.backlog_cost, 0)
    running = _fairness_column("running + sent", lambda row: row.running, 0)
    pages_in_window = _fairness_column("pages (window)", lambda row: row.pages_window, 0)
    page_share = _fairness_column("share of pages", lambda row: f"{row.page_share:.1%}", "0.0%")
