"""Serializers that document the API's shapes in the OpenAPI schema (drf-spectacular)."""

from __future__ import annotations

from typing import Any

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema_field
from rest_framework import serializers

from conversion_jobs.models import Output
from conversion_jobs.states import State

PROBLEM = "application/problem+json"


@extend_schema_field(OpenApiTypes.BINARY)
class BinaryFileField(serializers.FileField):
    """A file part: ``type: string, format: binary`` in the multipart request body (a plain
    FileField is documented as a URI, which sends generated clients and fuzzers elsewhere)."""


class SubmitSerializer(serializers.Serializer):
    file = BinaryFileField(help_text="The document. Its type is sniffed from the bytes.")
    output = serializers.ChoiceField(choices=Output.choices)
    options = serializers.CharField(
        required=False,
        help_text='A JSON object as text: {"dpi": 150, "pages": "1-5", "allow_partial": true}',
    )
    metadata = serializers.CharField(
        required=False,
        help_text="The client's own JSON object as text (at most 2048 bytes), echoed in the job "
        "and its webhook events.",
    )


class BearerJWTScheme(OpenApiAuthenticationExtension):
    """Documents ``BearerJWTAuthentication`` as an HTTP bearer scheme with JWTs."""

    target_class = "conversion_jobs.api.auth.BearerJWTAuthentication"
    name = "bearerJWT"

    def get_security_definition(self, auto_schema: object) -> dict[str, str]:
        return {"type": "http", "scheme": "bearer", "bearerFormat": "JWT"}


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
    metadata = serializers.JSONField(allow_null=True)
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


class PageLinksSerializer(serializers.Serializer):
    self = serializers.CharField()


class PageSerializer(serializers.Serializer):
    page = serializers.IntegerField()
    state = serializers.CharField()
    attempts = serializers.IntegerField()
    media_type = serializers.CharField(allow_null=True)
    sha256 = serializers.CharField(allow_null=True)
    size = serializers.IntegerField(allow_null=True)
    error_code = serializers.CharField(allow_null=True)
    links = PageLinksSerializer()


class PageListSerializer(serializers.Serializer):
    pages = PageSerializer(many=True)


class EventSerializer(serializers.Serializer):
    seq = serializers.IntegerField()
    type = serializers.CharField()
    generation = serializers.IntegerField(allow_null=True)
    attempt = serializers.IntegerField(allow_null=True)
    actor = serializers.CharField()
    details = serializers.JSONField()
    at = serializers.DateTimeField()
    hash = serializers.CharField()


class EventListSerializer(serializers.Serializer):
    events = EventSerializer(many=True)


class ProblemSerializer(serializers.Serializer):
    type = serializers.CharField()
    title = serializers.CharField()
    status = serializers.IntegerField()
    code = serializers.CharField()
    detail = serializers.CharField(required=False)
    retry_after = serializers.IntegerField(required=False)


def problems(*statuses: int) -> dict[tuple[int, str], OpenApiResponse]:
    """The RFC 9457 answers an operation can give, for ``extend_schema(responses=…)``."""
    body = OpenApiResponse(
        ProblemSerializer, description="An RFC 9457 problem; its code says which"
    )
    return {(status, PROBLEM): body for status in statuses}


#: The media type a generated client reads as bytes. openapi-python-client (0.29) parses a
#: response by the first media type it knows: ``text/*`` as text, ``application/json`` and
#: ``+json`` as JSON, ``application/octet-stream`` as bytes, any other skipped. Listed first, it
#: makes a download a ``File`` over ``response.content`` (``text/plain`` first made it
#: ``BytesIO(response.text)``, a TypeError: issue 27); the types actually served follow it
#: (docs/API_CONTRACT.md, "Generated clients").
OCTET_STREAM = "application/octet-stream"
#: What ``/result`` serves, by output: text, pdf, png (the ZIP of the page PNGs).
RESULT_TYPES = ("text/plain", "application/pdf", "application/zip")
#: What ``/pages/{n}`` serves, by output: text, pdf, png.
PAGE_TYPES = ("text/plain", "application/pdf", "image/png")


#: A download's headers: the ETag of its 200, 302 and 304, the Location of its 302.
DOWNLOAD_HEADERS = [
    OpenApiParameter(
        "ETag",
        OpenApiTypes.STR,
        OpenApiParameter.HEADER,
        description='"<sha256 of the bytes>" (a 302 and a 304 carry it too)',
        response=[200, 302, 304],
    ),
    OpenApiParameter(
        "Location",
        OpenApiTypes.URI,
        OpenApiParameter.HEADER,
        description="The presigned URL, valid QUIRE_S3_PRESIGN_TTL_S seconds",
        response=[302],
    ),
]


def download(description: str, *media_types: str) -> dict[Any, OpenApiResponse]:
    """A download's answers but its problems, for ``extend_schema(responses=…)``: the 200's
    binary body (``format: binary``) under ``application/octet-stream`` first, then
    ``media_types``; 302 to a presigned URL (S3 with ``QUIRE_S3_PRESIGN_TTL_S``); 304 for an
    ``If-None-Match`` that is the ETag."""
    body = OpenApiResponse(OpenApiTypes.BINARY, description=description)
    return {
        **{(200, media_type): body for media_type in (OCTET_STREAM, *media_types)},
        302: OpenApiResponse(description="Fetch the bytes from the presigned URL in Location"),
        304: OpenApiResponse(description="Not modified: If-None-Match is the ETag"),
    }
