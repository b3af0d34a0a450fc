"""``POST /api/v1/erasures`` (docs/API_CONTRACT.md §10): an operator erases a tenant. Scope
``tenants:erase``, which only operators' tokens carry; the tenant to erase is named in the body
(never in the path, which the access log records), and answered only as its pseudonym."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response

from conversion_jobs.api.auth import TENANT_MAX
from conversion_jobs.api.serializers import problems
from conversion_jobs.api.views import AUTHENTICATED, QuireView
from conversion_jobs.exceptions import InvalidRequest
from conversion_jobs.services.erasure import erasure_representation, tenant_erase

SCOPE = "tenants:erase"
#: How long one request works on an erasure before it answers 202 (call again to go on).
REQUEST_BUDGET_S = 20.0


class ErasureInSerializer(serializers.Serializer):
    tenant = serializers.CharField(max_length=TENANT_MAX)


class ErasureCountsSerializer(serializers.Serializer):
    jobs_cancelled = serializers.IntegerField()
    jobs_deleted = serializers.IntegerField()
    rows_deleted = serializers.IntegerField()
    audit_events_deleted = serializers.IntegerField()
    objects_deleted = serializers.IntegerField()


class ErasureSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    tenant = serializers.CharField(help_text="the tenant's pseudonym (t_…), never its id")
    state = serializers.ChoiceField(choices=["in_progress", "finished"])
    step = serializers.ChoiceField(choices=["cancel", "rows", "objects", "done"])
    counts = ErasureCountsSerializer()
    runs = serializers.IntegerField()
    actor = serializers.CharField()
    started_at = serializers.DateTimeField()
    finished_at = serializers.DateTimeField(allow_null=True)


class ErasureCollectionView(QuireView):
    required_scopes = {"POST": SCOPE}

    @extend_schema(
        request=ErasureInSerializer,
        responses={200: ErasureSerializer, 202: ErasureSerializer, **problems(*AUTHENTICATED)},
        summary="Erase a tenant: its live jobs cancelled, then its rows, then its objects"
        " (200 finished; 202 still in progress: call again, it resumes)",
        operation_id="erasures_create",
    )
    def post(self, request: Request) -> Response:
        data = request.data
        tenant = data.get("tenant") if isinstance(data, dict) else None
        if not isinstance(tenant, str) or not 0 < len(tenant) <= TENANT_MAX:
            raise InvalidRequest(f"tenant must be a string of 1 to {TENANT_MAX} characters")
        record = tenant_erase(
            tenant=tenant, actor=self.principal.actor, deadline_s=REQUEST_BUDGET_S
        )
        status = 200 if record.finished_at is not None else 202
        return Response(erasure_representation(record), status=status)
