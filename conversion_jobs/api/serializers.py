"""Serializers that document the API's shapes in the OpenAPI schema (drf-spectacular)."""

from __future__ import annotations

from rest_framework import serializers

from conversion_jobs.models import Output
from conversion_jobs.states import State


class SubmitSerializer(serializers.Serializer):
    file = serializers.FileField(help_text="The document. Its type is sniffed from the bytes.")
    output = serializers.ChoiceField(choices=Output.choices)
    options = serializers.JSONField(
        required=False,
        help_text='JSON object: {"dpi": 150, "pages": "1-5", "allow_partial": true}',
    )


class SourceSerializer(serializers.Serializer):
    media_type = serializers.CharField()
    size = serializers.IntegerField()
    sha256 = serializers.CharField()
    page_count = serializers.IntegerField(allow_null=True)


class PagesSummarySerializer(serializers.Serializer):
    total = serializers.IntegerField(allow_null=True)
    done = serializers.IntegerField()
    failed = serializers.IntegerField()


class ErrorSerializer(serializers.Serializer):
    code = serializers.CharField()
    retryable = serializers.BooleanField()
    detail = serializers.CharField()


class ResultSummarySerializer(serializers.Serializer):
    sha256 = serializers.CharField()
    size = serializers.IntegerField()
    media_type = serializers.CharField()


class LinksSerializer(serializers.Serializer):
    self = serializers.CharField()
    result = serializers.CharField()
    cancel = serializers.CharField()
    pages = serializers.CharField()
    events = serializers.CharField()


class JobSerializer(serializers.Serializer):
    id = serializers.UUIDField()
    state = serializers.ChoiceField(choices=State.choices)
    generation = serializers.IntegerField()
    state_version = serializers.IntegerField()
    output = serializers.ChoiceField(choices=Output.choices)
    options = serializers.JSONField()
    source = SourceSerializer()  # type: ignore[assignment]
    attempts = serializers.IntegerField()
    max_attempts = serializers.IntegerField()
    pages = PagesSummarySerializer()
    error = ErrorSerializer(allow_null=True)
    next_attempt_at = serializers.DateTimeField(allow_null=True)
    created_at = serializers.DateTimeField()
    updated_at = serializers.DateTimeField()
    finished_at = serializers.DateTimeField(allow_null=True)
    result = ResultSummarySerializer(allow_null=True)
    links = LinksSerializer()


class JobPageSerializer(serializers.Serializer):
    jobs = JobSerializer(many=True)
    next_cursor = serializers.CharField(allow_null=True)


class PageSerializer(serializers.Serializer):
    page = serializers.IntegerField()
    state = serializers.CharField()
    attempts = serializers.IntegerField()
    media_type = serializers.CharField(allow_null=True)
    sha256 = serializers.CharField(allow_null=True)
    size = serializers.IntegerField(allow_null=True)
    error_code = serializers.CharField(allow_null=True)


class EventSerializer(serializers.Serializer):
    seq = serializers.IntegerField()
    type = serializers.CharField()
    generation = serializers.IntegerField(allow_null=True)
    attempt = serializers.IntegerField(allow_null=True)
    actor = serializers.CharField()
    details = serializers.JSONField()
    at = serializers.DateTimeField()
    hash = serializers.CharField()


class ProblemSerializer(serializers.Serializer):
    type = serializers.CharField()
    title = serializers.CharField()
    status = serializers.IntegerField()
    code = serializers.CharField()
    detail = serializers.CharField(required=False)
    retry_after = serializers.IntegerField(required=False)
