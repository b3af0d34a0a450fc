"""WSGI entry point for gunicorn (``project.wsgi:application``)."""

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")

application = get_wsgi_application()

from conversion_jobs.observability import tracing  # noqa: E402  (needs configured Django)
from conversion_jobs.services import publisher  # noqa: E402

tracing.instrument_web()
publisher.enable()  # the fast-path publish off the request thread (ADR 0017 addendum)
