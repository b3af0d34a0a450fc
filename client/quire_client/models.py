"""Typed models of the API's representations (the server's docs/API_CONTRACT.md §3, §4).

Each dataclass mirrors one component of ``/api/v1/schema`` (``SCHEMA_COMPONENTS`` names it); a
test keeps their fields in step. Unknown members of an answer are ignored, so a newer server
does not break an older client.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

#: The job states (docs/API_CONTRACT.md §2.4); terminal ones end a wait.
TERMINAL_STATES = frozenset({"succeeded", "partial", "failed", "cancelled"})
#: The outputs a job can ask for.
OUTPUTS = ("text", "png", "pdf")


def _dt(value: str | None) -> datetime | None:
    return datetime.fromisoformat(value.replace("Z", "+00:00")) if value else None


def _known(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in data.items() if k in names}


@dataclass(frozen=True)
class Source:
    """What was submitted: the sniffed media type, size, sha256 and (once prepared) page count."""

    media_type: str
    size: int
    sha256: str
    page_count: int | None


@dataclass(frozen=True)
class PagesSummary:
    """Page counters: ``total`` is None until the first attempt has prepared the document."""

    total: int | None
    done: int
    failed: int


@dataclass(frozen=True)
class JobErrorInfo:
    """A job's error: its stable ``code`` (API_CONTRACT §5), whether it is retryable, a detail."""

    code: str
    retryable: bool
    detail: str


@dataclass(frozen=True)
class ResultSummary:
    """The result's digest (also its download ETag), size and media type."""

    sha256: str
    size: int
    media_type: str


@dataclass(frozen=True)
class Links:
    """The job's related URLs (paths on the same server)."""

    self: str
    result: str
    cancel: str
    pages: str
    events: str


@dataclass(frozen=True)
class Job:
    """The job representation (``GET /api/v1/jobs/{id}``). ``etag`` is the response's ETag
    (opaque: it changes with every change of the body), kept for conditional reads; it is not
    part of the body."""

    id: str
    state: str
    generation: int
    state_version: int
    output: str
    options: dict[str, Any]
    source: Source
    attempts: int
    max_attempts: int
    pages: PagesSummary
    error: JobErrorInfo | None
    next_attempt_at: datetime | None
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None
    result: ResultSummary | None
    links: Links
    #: The client's own ``metadata`` object given at submit (≤ 2 KB), echoed; None without one.
    metadata: dict[str, Any] | None = None
    etag: str | None = field(default=None, compare=False)

    @property
    def terminal(self) -> bool:
        """True once the job is ``succeeded``, ``partial``, ``failed`` or ``cancelled``."""
        return self.state in TERMINAL_STATES

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, etag: str | None = None) -> Job:
        """Build a Job from its JSON representation."""
        return cls(
            id=data["id"],
            state=data["state"],
            generation=data["generation"],
            state_version=data["state_version"],
            output=data["output"],
            options=dict(data.get("options") or {}),
            source=Source(**_known(Source, data["source"])),
            attempts=data["attempts"],
            max_attempts=data["max_attempts"],
            pages=PagesSummary(**_known(PagesSummary, data["pages"])),
            error=JobErrorInfo(**_known(JobErrorInfo, data["error"]))
            if data.get("error")
            else None,
            next_attempt_at=_dt(data.get("next_attempt_at")),
            created_at=_dt(data["created_at"]),  # type: ignore[arg-type]
            updated_at=_dt(data["updated_at"]),  # type: ignore[arg-type]
            finished_at=_dt(data.get("finished_at")),
            result=ResultSummary(**_known(ResultSummary, data["result"]))
            if data.get("result")
            else None,
            links=Links(**_known(Links, data["links"])),
            metadata=data.get("metadata"),
            etag=etag,
        )

    def to_dict(self) -> dict[str, Any]:
        """The JSON-able representation (datetimes as ISO 8601 strings), without ``etag``."""
        out = dataclasses.asdict(self)
        out.pop("etag")
        for key, value in out.items():
            if isinstance(value, datetime):
                out[key] = value.isoformat().replace("+00:00", "Z")
        return out


@dataclass(frozen=True)
class JobList:
    """One page of ``GET /api/v1/jobs``: the jobs, newest first, and the cursor of the next."""

    jobs: list[Job]
    next_cursor: str | None


@dataclass(frozen=True)
class PageLinks:
    """The page artifact's URL."""

    self: str


@dataclass(frozen=True)
class Page:
    """A page checkpoint (``GET /api/v1/jobs/{id}/pages``)."""

    page: int
    state: str
    attempts: int
    media_type: str | None
    sha256: str | None
    size: int | None
    error_code: str | None
    links: PageLinks

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Page:
        """Build a Page from its JSON representation."""
        values = _known(cls, data)
        values["links"] = PageLinks(**_known(PageLinks, data["links"]))
        return cls(**values)


@dataclass(frozen=True)
class Problem:
    """An RFC 9457 problem (docs/API_CONTRACT.md §4); ``extras`` holds the other members
    (``job_state``, ``limit``, …)."""

    type: str
    title: str
    status: int
    code: str
    detail: str | None = None
    retry_after: int | None = None
    extras: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, status: int) -> Problem:
        """Build a Problem from a problem+json body (missing members get neutral values)."""
        known = {"type", "title", "status", "code", "detail", "retry_after"}
        return cls(
            type=str(data.get("type", "about:blank")),
            title=str(data.get("title", "")),
            status=int(data.get("status", status)),
            code=str(data.get("code") or f"http_{status}"),
            detail=data.get("detail"),
            retry_after=data.get("retry_after"),
            extras={k: v for k, v in data.items() if k not in known},
        )


@dataclass(frozen=True)
class Progress:
    """One snapshot from the event stream (or a long-poll): state and page counters."""

    id: str
    state: str
    state_version: int
    pages: PagesSummary

    @property
    def terminal(self) -> bool:
        """True once the state is terminal."""
        return self.state in TERMINAL_STATES

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Progress:
        """Build a snapshot from an SSE ``data`` object."""
        return cls(
            id=data["id"],
            state=data["state"],
            state_version=data["state_version"],
            pages=PagesSummary(**_known(PagesSummary, data["pages"])),
        )

    @classmethod
    def of(cls, job: Job) -> Progress:
        """The snapshot a job representation carries."""
        return cls(id=job.id, state=job.state, state_version=job.state_version, pages=job.pages)


#: Which schema component (``components.schemas`` of ``/api/v1/schema``) each model mirrors.
SCHEMA_COMPONENTS: dict[str, type] = {
    "Job": Job,
    "Source": Source,
    "PagesSummary": PagesSummary,
    "Error": JobErrorInfo,
    "ResultSummary": ResultSummary,
    "Links": Links,
    "JobPage": JobList,
    "Page": Page,
    "PageLinks": PageLinks,
    "Problem": Problem,
}
#: Dataclass fields that are the client's own, not members of the component.
CLIENT_ONLY_FIELDS: dict[type, frozenset[str]] = {
    Job: frozenset({"etag"}),
    Problem: frozenset({"extras"}),
}
