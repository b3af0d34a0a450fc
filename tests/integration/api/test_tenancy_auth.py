"""Tenancy and authentication on every endpoint (docs/API_CONTRACT.md §1,
docs/THREAT_MODEL.md §3)."""

from __future__ import annotations

import base64
import json
import uuid

import jwt
import pytest
from django.conf import settings
from rest_framework.test import APIClient

from conversion_jobs.api.auth import SCOPES
from conversion_jobs.models import CancellationRequest, ConversionJob, PageCheckpoint
from tests.conftest import token
from tests.integration.api.conftest import problem

# (method, path template, scope it needs)
JOB_ENDPOINTS = [
    ("get", "/api/v1/jobs/{id}", "jobs:read"),
    ("get", "/api/v1/jobs/{id}?wait=1", "jobs:read"),
    ("get", "/api/v1/jobs/{id}/events", "jobs:read"),
    ("get", "/api/v1/jobs/{id}/pages", "jobs:read"),
    ("get", "/api/v1/jobs/{id}/pages/1", "jobs:read"),
    ("get", "/api/v1/jobs/{id}/result", "jobs:read"),
    ("post", "/api/v1/jobs/{id}/cancel", "jobs:cancel"),
    ("post", "/api/v1/jobs/{id}/retry", "jobs:admin"),
]
ALL_ENDPOINTS = [
    *JOB_ENDPOINTS,
    ("get", "/api/v1/jobs", "jobs:read"),
    ("post", "/api/v1/jobs", "jobs:submit"),
]
#: Headers whose presence or value could tell one 404 from another.
COMPARED_HEADERS = (
    "Content-Type",
    "Content-Length",
    "ETag",
    "Allow",
    "Vary",
    "WWW-Authenticate",
    "Location",
)


def _client(tenant: str = "tenant-a", scopes: tuple[str, ...] = SCOPES) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token(tenant=tenant, scopes=scopes)}")
    return client


def _call(
    client: APIClient, method: str, path: str, job_id: object
) -> tuple[int, dict[str, str | None], bytes]:
    response = getattr(client, method)(path.format(id=job_id))
    headers = {name: response.get(name) for name in COMPARED_HEADERS}
    return (
        response.status_code,
        headers,
        b"".join(response) if response.streaming else response.content,
    )


@pytest.fixture
def foreign_jobs(make_job):
    """tenant-b's jobs in the states that would answer differently if tenancy leaked."""
    done = make_job(state="succeeded", tenant="tenant-b", source_page_count=1, pages_done=1)
    PageCheckpoint.objects.create(
        job=done,
        page_number=1,
        state="done",
        artifact_key="pages/x/00001.txt",
        artifact_sha256="0" * 64,
        artifact_size=1,
        media_type="text/plain",
        generation=1,
    )
    return {
        "succeeded": done,
        "queued": make_job(state="queued", tenant="tenant-b"),
        "running": make_job(state="running", tenant="tenant-b"),
        "failed": make_job(state="failed", tenant="tenant-b"),
    }


@pytest.mark.django_db
@pytest.mark.parametrize(("method", "path", "scope"), JOB_ENDPOINTS, ids=lambda v: str(v))
def test_endpoint__other_tenants_job_is_byte_identical_to_missing(
    foreign_jobs, method, path, scope
):
    client = _client("tenant-a")
    missing = _call(client, method, path, uuid.uuid4())
    assert missing[0] == 404
    assert json.loads(missing[2])["code"] == "not_found"
    for job in foreign_jobs.values():
        assert _call(client, method, path, job.id) == missing, job.state
    # Nothing changed on tenant-b's jobs and no cancellation was recorded.
    assert CancellationRequest.objects.count() == 0
    assert {
        j.id: (j.state, j.generation, j.state_version) for j in ConversionJob.objects.all()
    } == {j.id: (j.state, j.generation, j.state_version) for j in foreign_jobs.values()}


@pytest.mark.django_db
def test_endpoint__own_job_is_found(foreign_jobs):
    """The control for the test above: the owner sees the same ids."""
    owner = _client("tenant-b")
    assert owner.get(f"/api/v1/jobs/{foreign_jobs['queued'].id}").status_code == 200
    assert (
        owner.get(f"/api/v1/jobs/{foreign_jobs['succeeded'].id}/pages").json()["pages"][0]["page"]
        == 1
    )
    assert owner.get(f"/api/v1/jobs/{foreign_jobs['running'].id}/events").status_code == 200


@pytest.mark.django_db
def test_list__shows_only_own_jobs(foreign_jobs, make_job):
    mine = make_job(tenant="tenant-a")
    jobs = _client("tenant-a").get("/api/v1/jobs").json()["jobs"]
    assert [j["id"] for j in jobs] == [str(mine.id)]


@pytest.mark.django_db
@pytest.mark.parametrize(("method", "path", "scope"), ALL_ENDPOINTS, ids=lambda v: str(v))
def test_endpoint__missing_token_is_401(make_job, method, path, scope):
    job = make_job()
    response = getattr(APIClient(), method)(path.format(id=job.id))
    problem(response, 401, "not_authenticated")
    assert response["WWW-Authenticate"].startswith("Bearer")


@pytest.mark.django_db
@pytest.mark.parametrize(("method", "path", "scope"), ALL_ENDPOINTS, ids=lambda v: str(v))
def test_endpoint__wrong_scope_is_403(make_job, method, path, scope):
    job = make_job()
    client = _client(scopes=tuple(s for s in SCOPES if s != scope))
    problem(getattr(client, method)(path.format(id=job.id)), 403, "insufficient_scope")


@pytest.mark.django_db
def test_endpoint__403_does_not_reveal_whether_the_job_exists(make_job):
    """A 403 never reveals whether a job exists: scope is checked before the lookup."""
    client = _client(scopes=("jobs:read",))
    other = make_job(tenant="tenant-b")
    a = client.post(f"/api/v1/jobs/{other.id}/cancel")
    b = client.post(f"/api/v1/jobs/{uuid.uuid4()}/cancel")
    assert (a.status_code, a.content) == (b.status_code, b.content) == (403, a.content)


def _tampered(token_value: str) -> str:
    header, payload, signature = token_value.split(".")
    claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    claims["tenant"] = "tenant-b"
    forged = base64.urlsafe_b64encode(json.dumps(claims).encode()).decode().rstrip("=")
    return f"{header}.{forged}.{signature}"


BAD_TOKENS = {
    "expired": lambda: token(ttl=-5),
    "tampered": lambda: _tampered(token()),
    "wrong_key": lambda: jwt.encode(
        {"sub": "x", "tenant": "tenant-a", "scope": " ".join(SCOPES), "exp": 2**31},
        "not-the-configured-key-0123456789abcdef",
        algorithm="HS256",
    ),
    "alg_none": lambda: jwt.encode(
        {"sub": "x", "tenant": "tenant-a", "scope": " ".join(SCOPES), "exp": 2**31},
        None,
        algorithm="none",
    ),
    "missing_tenant": lambda: jwt.encode(
        {"sub": "x", "scope": " ".join(SCOPES), "exp": 2**31},
        settings.QUIRE["JWT_KEY"],
        algorithm="HS256",
    ),
    "garbage": lambda: "not-a-token",
    # RFC 7519 NumericDate: PyJWT alone would take the string
    "string_exp": lambda: jwt.encode(
        {"sub": "x", "tenant": "tenant-a", "scope": " ".join(SCOPES), "exp": str(2**31)},
        settings.QUIRE["JWT_KEY"],
        algorithm="HS256",
    ),
}


@pytest.mark.django_db
@pytest.mark.parametrize("kind", sorted(BAD_TOKENS))
@pytest.mark.parametrize(
    ("method", "path", "scope"), ALL_ENDPOINTS[:1] + ALL_ENDPOINTS[-2:], ids=lambda v: str(v)
)
def test_endpoint__invalid_token_is_401(make_job, kind, method, path, scope):
    job = make_job()
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {BAD_TOKENS[kind]()}")
    response = getattr(client, method)(path.format(id=job.id))
    problem(response, 401, "invalid_token")
    assert response["WWW-Authenticate"] == 'Bearer realm="quire", error="invalid_token"'


@pytest.mark.django_db
def test_endpoint__malformed_authorization_header_is_401(make_job):
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token()} extra")
    problem(client.get("/api/v1/jobs"), 401, "invalid_token")


@pytest.mark.django_db
def test_endpoint__unknown_route_and_bad_uuid_are_problem_404():
    client = _client()
    problem(client.get("/api/v1/nope"), 404, "not_found")
    problem(client.get("/api/v1/jobs/not-a-uuid"), 404, "not_found")


@pytest.mark.django_db
def test_endpoint__method_not_allowed_is_a_problem():
    problem(_client().delete("/api/v1/jobs"), 405, "method_not_allowed")


PREFIX = "p" * 64


@pytest.mark.django_db
def test_tenant__over_long_claim_is_401_and_never_truncated(make_job):
    """Two tenants sharing a 64-character prefix never share data: the longer one is refused,
    and the one whose name is exactly the prefix sees only its own job."""
    owned = make_job(tenant=PREFIX)
    for longer in (PREFIX + "a", PREFIX + "b"):
        client = APIClient()
        client.credentials(HTTP_AUTHORIZATION=f"Bearer {token(tenant=longer)}")
        for response in (
            client.get("/api/v1/jobs"),
            client.get(f"/api/v1/jobs/{owned.id}"),
            client.post(f"/api/v1/jobs/{owned.id}/cancel"),
        ):
            body = problem(response, 401, "invalid_token")
            assert "tenant" in body["detail"]
            assert longer not in response.content.decode()
    assert ConversionJob.objects.get(id=owned.id).state == "queued"
    owner = _client(PREFIX)
    assert [j["id"] for j in owner.get("/api/v1/jobs").json()["jobs"]] == [str(owned.id)]


@pytest.mark.django_db
def test_tenant__over_long_claim_cannot_submit(pdf_file, no_broker_publish):
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token(tenant=PREFIX + 'x')}")
    with open(pdf_file(), "rb") as fh:
        response = client.post("/api/v1/jobs", {"file": fh, "output": "text"}, format="multipart")
    problem(response, 401, "invalid_token")
    assert ConversionJob.objects.count() == 0
