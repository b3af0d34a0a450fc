"""URL map: the versioned API, its schema and docs, health, metrics and the admin."""

from django.contrib import admin
from django.contrib.staticfiles import views as staticfiles_views
from django.http import HttpRequest, JsonResponse
from django.urls import include, path, re_path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from conversion_jobs.api import health
from conversion_jobs.api.problems import error_from_django, json_problem
from conversion_jobs.exceptions import Forbidden, InvalidRequest, NotFound, QuireError

urlpatterns = [
    path("api/v1/", include("conversion_jobs.api.urls")),
    path("api/v1/schema", SpectacularAPIView.as_view(), name="schema"),
    path("api/v1/docs", SpectacularSwaggerView.as_view(url_name="schema"), name="docs"),
    path("health/live", health.live),
    path("health/ready", health.ready),
    path("metrics", health.metrics_view),
    path("admin/", admin.site.urls),
    # Package assets only (Swagger UI from drf-spectacular-sidecar, the admin's CSS): found by
    # the staticfiles finders in installed apps, never user content; no CDN, no collectstatic.
    re_path(r"^static/(?P<path>.+)$", staticfiles_views.serve, {"insecure": True}),
]


# Django's own error answers are problems too (every answer of the service is problem+json).
def handler400(request: HttpRequest, exception: Exception | None = None) -> JsonResponse:
    error = error_from_django(exception) if exception is not None else None
    return json_problem(request, error or InvalidRequest())


def handler403(request: HttpRequest, exception: Exception | None = None) -> JsonResponse:
    return json_problem(request, Forbidden())


def handler404(request: HttpRequest, exception: Exception | None = None) -> JsonResponse:
    return json_problem(request, NotFound())


def handler500(request: HttpRequest) -> JsonResponse:
    return json_problem(request, QuireError())
