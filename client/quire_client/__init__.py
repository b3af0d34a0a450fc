"""Quire's Python client: :class:`Client` (sync) and :class:`AsyncClient` (async) on httpx, typed
models, typed errors; the ``quire`` command line lives in :mod:`quire_client.cli`."""

from quire_client._core import RetryPolicy, parse_retry_after
from quire_client.aio import AsyncClient
from quire_client.client import Client
from quire_client.errors import APIError, ClientError, QuireError, ServerError
from quire_client.models import Job, JobList, Page, Problem, Progress

__all__ = [
    "APIError",
    "AsyncClient",
    "Client",
    "ClientError",
    "Job",
    "JobList",
    "Page",
    "Problem",
    "Progress",
    "QuireError",
    "RetryPolicy",
    "ServerError",
    "parse_retry_after",
]
__version__ = "0.1.0"
