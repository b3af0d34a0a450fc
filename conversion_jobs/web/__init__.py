"""The web tier's HTTP server and ASGI application parts (ADR 0016, ADR 0024).

* :mod:`.worker` - ``QuireUvicornWorker``, the gunicorn worker class the Procfile names.
* :mod:`.protocol` - ``QuireHttpProtocol``: the server's own limits and problem+json answers.
* :mod:`.handler` - ``QuireASGIHandler``: Django on a fixed set of threads per process.
* :mod:`.access` - ``Liveness`` (``/health/live`` on the event loop) and ``AccessLog``.

Limits (environment; docs/OPERABILITY.md "Slow clients"):

=================================  =======  =============================================
``QUIRE_HTTP_HEADER_TIMEOUT_S``    10       first byte to end of the request head
``QUIRE_HTTP_BODY_IDLE_TIMEOUT_S`` 30       longest silence while a body is being received
``QUIRE_HTTP_MAX_URL_BYTES``       8192     request target (path + query)
``QUIRE_HTTP_MAX_HEAD_BYTES``      32768    request line + headers
``QUIRE_HTTP_MAX_BODY_BYTES``      upload   ``QUIRE_MAX_UPLOAD_BYTES`` + 1 MiB of multipart
=================================  =======  =============================================
"""
