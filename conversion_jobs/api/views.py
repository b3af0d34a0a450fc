"""REST views: parse the request, call one service or selector, render. No business logic."""

from __future__ import annotations

import io
import re
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings
from django.http import (
    FileResponse,
    HttpRequest,
    HttpResponse,
    HttpResponseRedirect,
    StreamingHttpResponse,
)
from django.http.response import HttpResponseBase
from django.utils.http import parse_etags
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework.negotiation import DefaultContentNegotiation
from rest_framework.renderers import BaseRenderer, JSONRenderer
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from conversion_jobs import converters, faults, selectors, storage
from conversion_jobs.api import waiting
from conversion_jobs.api.auth import (
    BearerJWTAuthentication,
    HasScope,
    Principal,
)
from conversion_jobs.api.serializers import (
    DOWNLOAD_HEADERS,
    PAGE_TYPES,
    RESULT_TYPES,
    EventListSerializer,
    JobPageSerializer,
    JobSerializer,
    PageListSerializer,
    SubmitSerializer,
    download,
    problems,
)
from conversion_jobs.api.uploads import StagedFile, StagingUploadHandler
from conversion_jobs.converters.base import PAGE_EXT, RESULT_EXT
from conversion_jobs.exceptions import (
    InvalidRequest,
    NotAuthenticated,
    NotFound,
    NotReady,
    QuireError,
    StorageUnavailable,
)
from conversion_jobs.models import ConversionJob, Output, PageState
from conversion_jobs.observability import metrics, tracing
from conversion_jobs.representation import (
    JobStatus,
    event_representation,
    job_etag_of,
    job_representation,
    page_representation,
)
from conversion_jobs.services.acceptance import (
    Acceptance,
    StagedUpload,
    conversion_job_accept,
)
from conversion_jobs.services.cancellation import conversion_job_cancel
from conversion_jobs.services.checkpoints import inline_result_read, is_inline_result
from conversion_jobs.services.recovery import conversion_job_retry_failed
from conversion_jobs.services.runner import engine_settings_from_settings, limits_from_settings
from conversion_jobs.services.zipresult import is_zip_result, zip_result_stream
from conversion_jobs.states import TERMINAL_STATES, State

IDEMPOTENCY_KEY = re.compile(r"^[\x21-\x7e]{1,255}$")
#: Every authenticated operation can answer these: a malformed request (query, host), no or an
#: invalid token, a missing scope, the identity provider unreachable with no key cached.
AUTHENTICATED = (400, 401, 403, 503)


class QuireView(APIView):
    permission_classes = [HasScope]
    required_scopes: dict[str, str] = {}

    @property
    def principal(self) -> Principal:
        user = self.request.user
        if not isinstance(user, Principal):  # HasScope runs first; this is a programming error
            raise NotAuthenticated()
        return user

    def job(self, job_id: uuid.UUID) -> ConversionJob:
        return selectors.conversion_job_get(job_id=job_id, tenant=self.principal.tenant)

    def query_limit(self, default: int) -> int:
        """The list's ``limit`` query parameter: an integer from 1 to 100, ``default`` if none."""
        try:
            limit = int(self.request.query_params.get("limit", default))
        except ValueError as exc:
            raise InvalidRequest("limit must be an integer") from exc
        if not 1 <= limit <= 100:
            raise InvalidRequest("limit must be from 1 to 100")
        return limit


def _job_response(job: ConversionJob, *, status: int, **headers: str) -> Response:
    response = Response(job_representation(job), status=status)
    response["ETag"] = job_etag_of(job)
    for name, value in headers.items():
        response[name.replace("_", "-")] = value
    return response


def _rendered_job_response(job: ConversionJob, *, status: int, **headers: str) -> HttpResponse:
    """:func:`_job_response` rendered at once, for the lean submission path: the bytes DRF's
    JSON renderer makes of it (the same renderer, negotiated as ``application/json``), the
    same headers in the same order, without a ``Response`` to render later."""
    body = _NEGOTIATED.accepted_renderer.render(job_representation(job), "application/json", {})
    response = HttpResponse(body, status=status, content_type="application/json")
    response["ETag"] = job_etag_of(job)
    for name, value in headers.items():
        response[name.replace("_", "-")] = value
    return response


class JobCollectionView(QuireView):
    required_scopes = {"GET": "jobs:read", "POST": "jobs:submit"}

    @extend_schema(
        request={"multipart/form-data": SubmitSerializer},
        parameters=[
            OpenApiParameter(
                "Idempotency-Key",
                OpenApiTypes.STR,
                OpenApiParameter.HEADER,
                pattern=IDEMPOTENCY_KEY.pattern,
                description="1-255 printable ASCII characters: a retry with the same key and"
                " the same request answers the first job (200, Idempotent-Replayed: true)",
            )
        ],
        responses={
            202: JobSerializer,
            200: JobSerializer,
            **problems(*AUTHENTICATED, 413, 415, 422, 429),
        },
        summary="Submit a document for conversion",
        operation_id="jobs_submit",
    )
    def post(self, request: Request) -> HttpResponseBase:
        return self._submit(
            request._request,
            content_type=request.content_type,
            parsed=lambda: (request.FILES.get("file"), request.data),
        )

    def dispatch(self, request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponseBase:
        """DRF's dispatch, except for the common submission: a POST that DRF would negotiate
        to JSON, with a valid token carrying ``jobs:submit``, is answered without DRF's
        per-request machinery (ADR 0017, session 7). Anything else - no or a bad token, a
        missing scope, another ``Accept``, a query string - goes through DRF as before, which
        gives every error its answer; the lean path's own errors (after authentication) are
        answered by the same exception handler and finalized by DRF's ``finalize_response``."""
        if request.method == "POST":
            response = self._lean_post(request)
            if response is not None:
                return response
        return super().dispatch(request, *args, **kwargs)

    def _lean_post(self, request: HttpRequest) -> HttpResponseBase | None:
        """The submission without DRF's ``Request``, authenticators, permission classes and
        content negotiation, with exactly their outcome; None: DRF must answer."""
        if not self._lean_authorized(request):
            return None
        content_type = _content_type(request)
        return self._lean_finish(
            lambda: self._submit(
                request, content_type=content_type, parsed=None, answer=_rendered_job_response
            )
        )

    def _lean_authorized(self, request: HttpRequest) -> bool:
        """Whether the lean path may answer: DRF would negotiate JSON, the token is valid and
        carries the method's scope (``request.user`` set, as DRF's ``Request`` sets it). False
        for anything DRF answers (no or a bad token, a missing scope)."""
        if not _lean_submit_applies(self, request):
            return False
        try:
            authenticated = BearerJWTAuthentication().authenticate(request)  # type: ignore[arg-type]
            if authenticated is None:
                return False
            request.user = authenticated[0]  # type: ignore[assignment]  # as DRF's Request sets it
            if not HasScope().has_permission(request, self):  # type: ignore[arg-type]
                return False  # refused without an exception: DRF answers it, as it would
        except QuireError:
            return False  # DRF answers it (401, 403, 503), the same way as without this path
        self.args, self.kwargs = (), {}
        self.request = request  # type: ignore[assignment]  # ``principal`` reads its user
        self.headers = self.default_response_headers
        return True

    def _lean_finish(self, produce: Callable[[], HttpResponseBase]) -> HttpResponseBase:
        """``produce``'s answer finalized as DRF would; its exceptions answered by the same
        exception handler and finalized by DRF's ``finalize_response``."""
        response: HttpResponseBase | None
        try:
            response = produce()
        except Exception as exc:
            response = self.get_exception_handler()(exc, self.get_exception_handler_context())
            if response is None:
                raise
            response.exception = True  # type: ignore[union-attr]  # as DRF marks it
        return self.finalize_response(_NEGOTIATED, response)  # type: ignore[arg-type]

    def _acceptance_args(self, submission: _Submission) -> dict[str, Any]:
        """The acceptance's arguments."""
        return {
            "tenant": self.principal.tenant,
            "actor": self.principal.actor,
            "upload": submission.upload,
            "output": submission.output,
            "raw_options": submission.raw_options,
            "raw_metadata": submission.raw_metadata,
            "idempotency_key": submission.key,
            "traceparent": tracing.current_traceparent(),
        }

    def _submit(
        self,
        request: HttpRequest,
        *,
        content_type: str,
        parsed: Callable[[], tuple[Any, Any]] | None,
        answer: Callable[..., HttpResponseBase] = _job_response,
    ) -> HttpResponseBase:
        """Stage the upload, accept the job, answer 202 / 200. ``parsed``: the upload and the
        form as DRF's parsers read them (DRF's path); without it Django's parser reads them.
        ``answer`` builds the 202 / 200 (a DRF ``Response``, or for the lean path the same
        answer rendered at once)."""
        handler = _upload_handler(request)
        try:
            submission = _submission(request, handler, content_type=content_type, parsed=parsed)
            acceptance = conversion_job_accept(**self._acceptance_args(submission))
        except QuireError as exc:
            reason = exc.code
            metrics.ADMISSIONS.labels(result="rejected", reason=reason).inc()
            raise
        finally:
            handler.cleanup()
        return _answered(acceptance, answer)

    @extend_schema(
        parameters=[
            OpenApiParameter("state", OpenApiTypes.STR, enum=State.values),
            OpenApiParameter(
                "cursor", OpenApiTypes.STR, description="The previous page's next_cursor"
            ),
            OpenApiParameter(
                "limit",
                {"type": "integer", "minimum": 1, "maximum": 100},
                description="Jobs per page (20 by default)",
            ),
        ],
        responses={200: JobPageSerializer, **problems(*AUTHENTICATED)},
        summary="List the tenant's jobs, newest first",
        operation_id="jobs_list",
    )
    def get(self, request: Request) -> Response:
        state = request.query_params.get("state") or None
        if state is not None and state not in State.values:
            raise InvalidRequest(f"state must be one of {', '.join(State.values)}")
        jobs, next_cursor = selectors.conversion_job_list(
            tenant=self.principal.tenant,
            state=state,
            cursor=request.query_params.get("cursor"),
            limit=self.query_limit(20),
        )
        return Response({"jobs": [job_representation(j) for j in jobs], "next_cursor": next_cursor})


#: What DRF's content negotiation decides for a view whose only renderer is JSON when the
#: request has no ``Accept`` or one of these: the lean submission path answers only those.
_LEAN_ACCEPT = (None, "*/*", "application/json")
_NEGOTIATED = SimpleNamespace(
    accepted_renderer=JSONRenderer(), accepted_media_type="application/json"
)


def _lean_submit_applies(view: APIView, request: HttpRequest) -> bool:
    """Whether DRF would treat this request as the lean path assumes: JSON chosen by
    negotiation (no ``?format=``: no query string at all), the view configured as shipped
    (bearer tokens, ``HasScope``, the JSON renderer, no throttles or versioning)."""
    return (
        not request.META.get("QUERY_STRING")
        and request.META.get("HTTP_ACCEPT") in _LEAN_ACCEPT
        and view.renderer_classes == [JSONRenderer]
        and view.authentication_classes == [BearerJWTAuthentication]
        and view.permission_classes == [HasScope]
        and not view.throttle_classes
        and view.versioning_class is None
        and view.content_negotiation_class is DefaultContentNegotiation
    )


@dataclass(frozen=True)
class _Submission:
    """A submission's parts, checked: the staged upload, the output, the raw options, the
    idempotency key."""

    upload: StagedUpload
    output: str
    raw_options: Any
    key: str | None
    raw_metadata: Any = None


def _content_type(request: HttpRequest) -> str:
    return str(request.META.get("CONTENT_TYPE", request.META.get("HTTP_CONTENT_TYPE", "")))


def _upload_handler(request: HttpRequest) -> StagingUploadHandler:
    handler = StagingUploadHandler(
        request,
        max_bytes=settings.QUIRE["MAX_UPLOAD_BYTES"],
        inline_max=settings.QUIRE["INLINE_SOURCE_MAX_BYTES"],
    )
    request.upload_handlers = [handler]
    return handler


def _submission(
    request: HttpRequest,
    handler: StagingUploadHandler,
    *,
    content_type: str,
    parsed: Callable[[], tuple[Any, Any]] | None = None,
) -> _Submission:
    """The upload staged by ``handler`` (in memory when small), the output and the key checked.
    ``parsed``: the upload and the form as DRF's parsers read them; without it Django's
    ``request.FILES`` / ``request.POST`` (the same parser under both). Raises a QuireError
    (400, 413, 422)."""
    if not content_type.startswith("multipart/form-data"):
        raise InvalidRequest("send multipart/form-data with a file part")
    # Django's multipart parser, streaming the file part through ``handler`` (ADR 0024: the
    # hand-written split of small bodies saved ≈ 5 % of the web's CPU per acceptance).
    form: Any
    if parsed is None:
        upload, form = request.FILES.get("file"), request.POST
    else:
        upload, form = parsed()
    if not isinstance(upload, StagedFile):
        raise InvalidRequest("the file part is required")
    output = form.get("output")
    if output not in Output.values:
        raise InvalidRequest(f"output must be one of {', '.join(Output.values)}")
    key = request.headers.get("Idempotency-Key")
    if key is not None and not IDEMPOTENCY_KEY.match(key):
        raise InvalidRequest("Idempotency-Key must be 1-255 printable ASCII characters")
    return _Submission(
        upload=upload.staged,
        output=output,
        raw_options=form.get("options"),
        key=key,
        raw_metadata=form.get("metadata"),
    )


def _answered(acceptance: Acceptance, answer: Callable[..., HttpResponseBase]) -> HttpResponseBase:
    """The 202 / 200 of an acceptance, counted."""
    faults.hit("accept.after_commit")
    if acceptance.created:
        metrics.ADMISSIONS.labels(result="accepted", reason="").inc()
        return answer(acceptance.job, status=202, Location=f"/api/v1/jobs/{acceptance.job.id}")
    if acceptance.replayed:
        metrics.ADMISSIONS.labels(result="replayed", reason="").inc()
        metrics.IDEMPOTENT_REPLAYS.inc()
        return answer(acceptance.job, status=200, Idempotent_Replayed="true")
    metrics.ADMISSIONS.labels(result="duplicate", reason="").inc()
    return answer(acceptance.job, status=200)


def _if_none_match(header: str | None) -> frozenset[str]:
    """The entity tags of ``If-None-Match``, compared weakly (RFC 9110 §13.1.2: ``W/`` is
    dropped); ``*`` and a malformed header name none."""
    tags = parse_etags(header or "")
    return frozenset(tag.removeprefix("W/") for tag in tags if tag != "*")


class JobDetailView(QuireView):
    required_scopes = {"GET": "jobs:read"}

    @extend_schema(
        parameters=[
            OpenApiParameter(
                "wait",
                OpenApiTypes.NUMBER,
                description="Long-poll: wait up to this many seconds (capped at"
                " QUIRE_LONG_POLL_MAX_S, 30 by default) for the job to change",
            )
        ],
        responses={200: JobSerializer, 304: None, **problems(*AUTHENTICATED, 404)},
        summary="Get a job (ETag names the representation; ?wait=N long-polls for a change)",
        operation_id="jobs_get",
    )
    def get(self, request: Request, job_id: uuid.UUID) -> Response | HttpResponse:
        tenant = self.principal.tenant
        try:
            wait = min(
                float(request.query_params.get("wait", 0)), settings.QUIRE["LONG_POLL_MAX_S"]
            )
        except ValueError as exc:
            raise InvalidRequest("wait must be a number of seconds") from exc
        known = _if_none_match(request.headers.get("If-None-Match"))
        row = selectors.conversion_job_wait_status(job_id=job_id, tenant=tenant)
        if row is None:
            raise NotFound()
        # The ETag from six columns: a 304 (and a long-poll's decision) needs no full row and
        # no rendering; a 200 renders the body and its ETag from one read of the full row.
        status = JobStatus(*row)
        etag = status.etag
        if (
            wait > 0
            and not getattr(request, "quire_waited", False)
            and (etag in known or not known)
            and not status.terminal
        ):
            # Nothing to say yet: the async wrapper (waitable) sleeps on the event loop, not
            # on this thread, until the representation is another one, and asks again.
            return WaitThenAsk(
                job_id=job_id, tenant=tenant, known=known or frozenset({etag}), wait_s=wait
            )
        if etag in known:
            response = HttpResponse(status=304)
            response["ETag"] = etag
            return response
        return _job_response(self.job(job_id), status=200)


class JobCancelView(QuireView):
    required_scopes = {"POST": "jobs:cancel"}

    @extend_schema(
        request=None,
        responses={
            200: JobSerializer,
            202: JobSerializer,
            **problems(*AUTHENTICATED, 404, 409),
        },
        summary="Cancel a job",
        operation_id="jobs_cancel",
    )
    def post(self, request: Request, job_id: uuid.UUID) -> Response:
        result = conversion_job_cancel(
            job_id=job_id, tenant=self.principal.tenant, actor=self.principal.actor
        )
        status = 202 if result.job.state == State.CANCELLING else 200
        return _job_response(result.job, status=status)


class JobRetryView(QuireView):
    required_scopes = {"POST": "jobs:admin"}

    @extend_schema(
        request=None,
        responses={202: JobSerializer, **problems(*AUTHENTICATED, 404, 409)},
        summary="Operator retry of a failed or cancelled job (generation + 1)",
        operation_id="jobs_retry",
    )
    def post(self, request: Request, job_id: uuid.UUID) -> Response:
        job = conversion_job_retry_failed(
            job_id=job_id, tenant=self.principal.tenant, actor=self.principal.actor
        )
        return _job_response(job, status=202)


def _artifact_response(
    *,
    key: str,
    sha256: str,
    size: int | None,
    media_type: str,
    filename: str,
    request: Request,
    content: bytes | Callable[[], bytes] | None = None,
) -> HttpResponseBase:
    """Stream the object from the artifact store, or (S3 with QUIRE_S3_PRESIGN_TTL_S) send the
    client to a short-lived presigned URL; the web never holds the whole object. ``content``:
    the artifact is stored inline in its row (a small text page) and is answered from it, or
    (a callable) is read only when the answer is not a 304 (an inline text result)."""
    etag = f'"{sha256}"'
    response: HttpResponseBase
    if request.headers.get("If-None-Match") == etag:
        response = HttpResponse(status=304)
    elif callable(content):
        # Streamed like a stored object (same headers): an inline text result.
        response = FileResponse(io.BytesIO(content()), content_type=media_type)
        response["Content-Disposition"] = f'attachment; filename="{filename}"'
    elif content is not None:
        response = HttpResponse(content, content_type=media_type)
        response["Content-Disposition"] = f'attachment; filename="{filename}"'
    else:
        try:
            url = storage.presigned_url(key, filename=filename, media_type=media_type)
            if url is not None:
                response = HttpResponseRedirect(url)
                response["Cache-Control"] = "private, no-store"
                response["ETag"] = etag
                return response
            body = storage.open_object(key)
        except FileNotFoundError as exc:
            raise NotFound() from exc
        except storage.StorageError as exc:
            raise StorageUnavailable() from exc
        response = FileResponse(body, content_type=media_type)
        if size is not None:
            response["Content-Length"] = str(size)
        response["Content-Disposition"] = f'attachment; filename="{filename}"'
    response["ETag"] = etag
    return response


class DownloadNegotiation(DefaultContentNegotiation):
    """A download's ``Accept`` is not negotiated: the bytes are sent with their own media type
    and a problem as JSON, whatever it names (RFC 9110 §12.5.1 lets a server disregard it).
    Swagger UI and schema-generated clients ask for the declared download types
    (docs/API_CONTRACT.md, "Generated clients"), which no renderer offers: DRF answered 406."""

    def select_renderer(
        self, request: Request, renderers: Iterable[BaseRenderer], format_suffix: str | None = None
    ) -> tuple[BaseRenderer, str]:
        renderer = next(iter(renderers))
        return renderer, renderer.media_type


def _download_schema(
    description: str, types: Iterable[str], *, errors: Iterable[int], summary: str, op: str
) -> Callable[[Any], Any]:
    """A download's OpenAPI operation: ``description`` and ``types`` of its bytes, its problems
    (``errors`` beside the authentication's and 404)."""
    return extend_schema(
        parameters=DOWNLOAD_HEADERS,
        responses={**download(description, *types), **problems(*AUTHENTICATED, 404, *errors)},
        summary=summary,
        operation_id=op,
    )


class _DownloadView(QuireView):
    """A download of a job's bytes (its result, a page): any media type is accepted."""

    required_scopes = {"GET": "jobs:read"}
    content_negotiation_class = DownloadNegotiation


class JobResultView(_DownloadView):
    @_download_schema(
        "The result's bytes, with its media type: text/plain; charset=utf-8 (output text),"
        " application/pdf (pdf), application/zip (png: the page PNGs)",
        RESULT_TYPES,
        errors=(409, 500),
        summary="Download the result",
        op="jobs_result",
    )
    def get(self, request: Request, job_id: uuid.UUID) -> HttpResponseBase:
        job = self.job(job_id)
        if job.state not in TERMINAL_STATES:
            raise NotReady(job_state=job.state)
        if not job.result_key or job.expired_at is not None:
            raise NoResult(job_state=job.state)
        if is_zip_result(job.result_key):
            return _zip_result_response(job, request=request)
        return _artifact_response(
            content=_inline_result(job) if is_inline_result(job.result_key) else None,
            key=job.result_key,
            sha256=job.result_sha256 or "",
            size=job.result_size,
            media_type=job.result_media_type or "application/octet-stream",
            filename=f"{job.id}.{RESULT_EXT[job.output]}",
            request=request,
        )


def _inline_result(job: ConversionJob) -> Callable[[], bytes]:
    """An inline text result has no object: it is the done pages' inline bytes joined in page
    order, checked against the recorded digest (rows expired meanwhile read as no result). No
    presigned redirect is offered for it."""

    def read() -> bytes:
        body = inline_result_read(
            job_id=job.id, result_key=job.result_key or "", sha256=job.result_sha256 or ""
        )
        if body is None:
            raise NoResult(job_state=job.state)
        return body

    return read


def _zip_result_response(job: ConversionJob, *, request: Request) -> HttpResponseBase:
    """A PNG result: the ZIP of the job's done pages, streamed from the page objects (never
    presigned: it is no object of its own). Same headers as a stored result."""
    etag = f'"{job.result_sha256}"'
    response: HttpResponseBase
    if request.headers.get("If-None-Match") == etag:
        response = HttpResponse(status=304)
    else:
        response = StreamingHttpResponse(
            zip_result_stream(job), content_type=job.result_media_type or "application/zip"
        )
        response["Content-Length"] = str(job.result_size)
        response["Content-Disposition"] = (
            f'attachment; filename="{job.id}.{RESULT_EXT[job.output]}"'
        )
    response["ETag"] = etag
    return response


class NoResult(QuireError, code="no_result", status=409):
    """The job finished without a result (failed, cancelled, or expired by retention)."""


class JobPagesView(QuireView):
    required_scopes = {"GET": "jobs:read"}

    @extend_schema(
        responses={200: PageListSerializer, **problems(*AUTHENTICATED, 404)},
        summary="List page checkpoints",
        operation_id="jobs_pages",
    )
    def get(self, request: Request, job_id: uuid.UUID) -> Response:
        job = self.job(job_id)
        pages = selectors.page_checkpoint_list(job_id=job.id, tenant=job.tenant).defer("content")
        return Response({"pages": [page_representation(job.id, p) for p in pages]})


class JobPageView(_DownloadView):
    @_download_schema(
        "The page's bytes, with its media type: text/plain; charset=utf-8 (output text),"
        " application/pdf (pdf), image/png (png)",
        PAGE_TYPES,
        errors=(409,),
        summary="Download one page artifact",
        op="jobs_page",
    )
    def get(self, request: Request, job_id: uuid.UUID, page: int) -> HttpResponseBase:
        job = self.job(job_id)
        if job.state not in TERMINAL_STATES:
            raise NotReady(job_state=job.state)
        # A job that published no result (failed, cancelled) serves its finished pages only if
        # its policy lets partial results survive (allow_partial, the default); otherwise it is
        # all-or-nothing and nothing is published.
        pages_survive = job.state in (State.SUCCEEDED, State.PARTIAL) or job.options.get(
            "allow_partial", True
        )
        checkpoint = (
            selectors.page_checkpoint_list(job_id=job.id, tenant=job.tenant)
            .filter(page_number=page)
            .first()
        )
        if (
            checkpoint is None
            or checkpoint.state != PageState.DONE
            or job.expired_at is not None
            or not pages_survive
        ):
            raise NotFound()
        ext = PAGE_EXT[job.output]
        return _artifact_response(
            key=checkpoint.artifact_key or "",
            content=None if checkpoint.content is None else bytes(checkpoint.content),
            sha256=checkpoint.artifact_sha256 or "",
            size=checkpoint.artifact_size,
            media_type=checkpoint.media_type or "application/octet-stream",
            filename=f"{job.id}-page-{page:05d}.{ext}",
            request=request,
        )


class EventStreamRenderer(JSONRenderer):
    """Lets ``Accept: text/event-stream`` through content negotiation (errors stay JSON
    problems); the stream itself is written by :func:`waitable`, not rendered."""

    media_type = "text/event-stream"
    format = "sse"


class AcceptHeaderNegotiation(DefaultContentNegotiation):
    """Negotiates on the ``Accept`` header only: no ``?format=`` override (a query parameter
    must not turn a read into a 300 s stream)."""

    settings = SimpleNamespace(URL_FORMAT_OVERRIDE=None)  # type: ignore[assignment]


class JobEventsView(QuireView):
    required_scopes = {"GET": "jobs:read"}
    renderer_classes = [JSONRenderer, EventStreamRenderer]
    content_negotiation_class = AcceptHeaderNegotiation

    @extend_schema(
        responses={
            (200, "application/json"): EventListSerializer,
            (200, "text/event-stream"): OpenApiTypes.STR,
            **problems(*AUTHENTICATED, 404),
        },
        parameters=[OpenApiParameter("format", exclude=True)],
        summary="Audit events (JSON), or live state and page progress (Server-Sent Events)",
        operation_id="jobs_events",
    )
    def get(self, request: Request, job_id: uuid.UUID) -> Response | HttpResponse:
        job = self.job(job_id)
        # Content negotiation chose it: the client sent Accept: text/event-stream.
        if request.accepted_renderer.format == EventStreamRenderer.format:
            return StreamEvents(
                job_id=job.id,
                tenant=self.principal.tenant,
                last_event_id=request.headers.get("Last-Event-ID"),
            )
        return Response(
            {
                "events": [
                    event_representation(e)
                    for e in selectors.audit_event_list(job_id=job.id, tenant=job.tenant)
                ]
            }
        )


class WaitThenAsk(HttpResponse):
    """A sync view's answer to its async wrapper: wait for the job to change, then call me
    again. Never leaves the process."""

    def __init__(
        self, *, job_id: uuid.UUID, tenant: str, known: frozenset[str], wait_s: float
    ) -> None:
        super().__init__(status=204)
        self.job_id, self.tenant, self.known = job_id, tenant, known
        self.deadline = time.monotonic() + wait_s


class StreamEvents(HttpResponse):
    """A sync view's answer to its async wrapper: the caller may watch this job; stream it."""

    def __init__(self, *, job_id: uuid.UUID, tenant: str, last_event_id: str | None) -> None:
        super().__init__(status=204)
        self.job_id, self.tenant = job_id, tenant
        self.last_event_id = (last_event_id or "")[:64] or None


def waitable(view_cls: type[APIView]) -> Callable[..., Any]:
    """``view_cls`` as an async view. The DRF view does everything that must be identical to
    a plain read (authentication, scopes, tenancy, validation, ETags, problems) on the sync
    thread; only the waiting - a long-poll's sleep, an event stream - happens here, on the
    event loop, so a waiting client holds no thread (ADR 0016)."""
    sync_view = view_cls.as_view()
    ask = sync_to_async(sync_view, thread_sensitive=True)

    async def view(request: HttpRequest, **kwargs: Any) -> HttpResponseBase:
        response = await ask(request, **kwargs)
        if isinstance(response, WaitThenAsk):
            await waiting.wait_for_change(
                job_id=response.job_id,
                tenant=response.tenant,
                known=response.known,
                deadline=response.deadline,
            )
            request.quire_waited = True  # type: ignore[attr-defined]
            response = await ask(request, **kwargs)
        elif isinstance(response, StreamEvents):
            stream = StreamingHttpResponse(
                waiting.event_stream(
                    job_id=response.job_id,
                    tenant=response.tenant,
                    last_event_id=response.last_event_id,
                ),
                content_type="text/event-stream",
            )
            stream["Cache-Control"] = "no-store"
            stream["X-Accel-Buffering"] = "no"  # a buffering proxy would hold the events back
            return stream
        return response

    # What drf-spectacular and the CSRF middleware look for on a DRF view.
    view.cls = sync_view.cls  # type: ignore[attr-defined]
    view.initkwargs = sync_view.initkwargs  # type: ignore[attr-defined]
    view.csrf_exempt = True  # type: ignore[attr-defined]
    return view


class CapabilitiesView(APIView):
    authentication_classes: list[Any] = []
    permission_classes: list[Any] = []

    @extend_schema(
        responses={200: OpenApiTypes.OBJECT, **problems(400)},
        summary="What this installation converts",
        operation_id="capabilities",
    )
    def get(self, request: Request) -> Response:
        engine = engine_settings_from_settings()
        office = engine.warm and converters.capabilities().keys() & converters.OFFICE_TYPES
        return Response(
            {
                "conversions": converters.capabilities(),
                "engines": {
                    "libreoffice": {
                        "warm": bool(office),
                        "max_conversions": engine.max_conversions,
                    }
                },
                "limits": {
                    "max_upload_bytes": settings.QUIRE["MAX_UPLOAD_BYTES"],
                    **converters.limits_description(limits_from_settings()),
                },
                "outputs": list(Output.values),
            }
        )
