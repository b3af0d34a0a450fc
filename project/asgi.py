"""ASGI entry point (``project.asgi:application``), served by
``conversion_jobs.web.worker.QuireUvicornWorker`` under gunicorn (Procfile ``web``; ADR 0016,
ADR 0024).

Django's ASGI handler, with the sync parts of requests on a fixed set of threads
(:class:`conversion_jobs.web.handler.QuireASGIHandler`), behind
:class:`conversion_jobs.web.access.Liveness` (``/health/live`` on the event loop) and
:class:`conversion_jobs.web.access.AccessLog` (one content-free line per request).
Everything loaded by then is frozen out of the garbage collector's generations.
"""

import gc
import os

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
django.setup(set_prefix=False)

from conversion_jobs.api import waiting  # noqa: E402  (needs configured Django)
from conversion_jobs.observability import tracing  # noqa: E402
from conversion_jobs.services import publisher  # noqa: E402
from conversion_jobs.web.access import AccessLog, Liveness  # noqa: E402
from conversion_jobs.web.handler import QuireASGIHandler  # noqa: E402

publisher.enable()  # the fast-path publish off the request thread (ADR 0017 addendum)
django_application = QuireASGIHandler()

tracing.instrument_web()
# A server's event loop lives as long as the process: waiting clients may share one LISTEN
# connection on it (conversion_jobs/api/waiting.py).
waiting.listener.serving = True

application = AccessLog(Liveness(django_application))

# What the process loaded to serve (modules, settings, URL patterns, middleware: ~100,000
# objects) lives as long as the process: out of the collector's reach, a full collection no
# longer walks it - ~90 ms to ~25 ms for the rare full collection that stops a worker's event
# loop and threads mid-request, half the collector's time per request (ADR 0017, session 7).
gc.collect()
gc.freeze()
