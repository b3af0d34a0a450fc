"""The gunicorn worker class the Procfile names: uvicorn-worker's ``UvicornWorker``, configured
the way uvicorn-worker documents (``CONFIG_KWARGS``): uvloop,
:class:`conversion_jobs.web.protocol.QuireHttpProtocol`, no lifespan, no ``Server`` header, and
uvicorn's access log off (:class:`conversion_jobs.web.access.AccessLog` writes one without
query values). gunicorn owns the processes: it restarts a dead worker, reloads and stops them
gracefully, and ``--timeout`` restarts one whose event loop is blocked. The workers accept on
gunicorn's shared socket with uvloop's own accept (ADR 0016, ADR 0024)."""

from __future__ import annotations

from typing import Any, ClassVar

from uvicorn_worker import UvicornWorker

from conversion_jobs import secret_policy

# gunicorn's master imports this module before it binds or forks: the production profile's
# secrets are checked here, as every other process checks them first (docs/THREAT_MODEL.md).
secret_policy.enforce()


class QuireUvicornWorker(UvicornWorker):
    CONFIG_KWARGS: ClassVar[dict[str, Any]] = {
        "loop": "uvloop",
        "http": "conversion_jobs.web.protocol:QuireHttpProtocol",
        "lifespan": "off",
        "server_header": False,
        "access_log": False,
    }
