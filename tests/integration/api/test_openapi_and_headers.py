"""The served OpenAPI document (file declared binary, problems declared as problem+json), Swagger
UI served from the package, and the security headers of the admin (issue 10 §4)."""

from __future__ import annotations

import re

import pytest
from django.test import Client

from tests.integration.api.conftest import problem

PROBLEM = "application/problem+json"


@pytest.fixture(scope="module")
def schema(django_db_blocker) -> dict:
    with django_db_blocker.unblock():
        response = Client().get("/api/v1/schema", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    assert response.status_code == 200
    return response.json()


def _operations(schema: dict):
    for path, item in schema["paths"].items():
        for method, operation in item.items():
            yield path, method, operation


def test_schema__file_part_is_binary(schema):
    body = schema["paths"]["/api/v1/jobs"]["post"]["requestBody"]["content"]
    assert list(body) == ["multipart/form-data"]
    ref = body["multipart/form-data"]["schema"]["$ref"].rsplit("/", 1)[1]
    submit = schema["components"]["schemas"][ref]
    assert submit["properties"]["file"] == {
        "type": "string",
        "format": "binary",
        "description": "The document. Its type is sniffed from the bytes.",
    }
    assert submit["properties"]["options"]["type"] == "string"
    assert set(submit["required"]) == {"file", "output"}


def test_schema__every_error_answer_is_declared_as_problem_json(schema):
    seen = 0
    for path, method, operation in _operations(schema):
        for status, response in operation["responses"].items():
            if int(status) >= 400:
                assert list(response["content"]) == [PROBLEM], (path, method, status)
                seen += 1
        if path != "/api/v1/capabilities":
            assert {"400", "401", "403", "503"} <= set(operation["responses"]), (path, method)
    assert seen > 30


def test_schema__operation_ids_are_unique_and_bearer_is_documented(schema):
    ids = [operation["operationId"] for _, _, operation in _operations(schema)]
    assert len(ids) == len(set(ids))
    assert schema["components"]["securitySchemes"]["bearerJWT"] == {
        "type": "http",
        "scheme": "bearer",
        "bearerFormat": "JWT",
    }


def test_schema__operation_ids_are_the_published_names(schema):
    # They are the function names of generated clients (docs/API_CONTRACT.md, "Generated
    # clients"): renaming one breaks every generated client's callers.
    ids = {
        (path, method): operation["operationId"] for path, method, operation in _operations(schema)
    }
    assert ids == {
        ("/api/v1/capabilities", "get"): "capabilities",
        ("/api/v1/erasures", "post"): "erasures_create",
        ("/api/v1/jobs", "get"): "jobs_list",
        ("/api/v1/jobs", "post"): "jobs_submit",
        ("/api/v1/jobs/{job_id}", "get"): "jobs_get",
        ("/api/v1/jobs/{job_id}/cancel", "post"): "jobs_cancel",
        ("/api/v1/jobs/{job_id}/retry", "post"): "jobs_retry",
        ("/api/v1/jobs/{job_id}/result", "get"): "jobs_result",
        ("/api/v1/jobs/{job_id}/pages", "get"): "jobs_pages",
        ("/api/v1/jobs/{job_id}/pages/{page}", "get"): "jobs_page",
        ("/api/v1/jobs/{job_id}/events", "get"): "jobs_events",
        ("/api/v1/webhooks", "get"): "webhooks_list",
        ("/api/v1/webhooks", "post"): "webhooks_create",
        ("/api/v1/webhooks/{endpoint_id}", "get"): "webhooks_get",
        ("/api/v1/webhooks/{endpoint_id}", "patch"): "webhooks_update",
        ("/api/v1/webhooks/{endpoint_id}", "delete"): "webhooks_delete",
        ("/api/v1/webhooks/{endpoint_id}/messages", "get"): "webhooks_messages",
        (
            "/api/v1/webhooks/{endpoint_id}/messages/{message_id}/attempts",
            "get",
        ): "webhooks_message_attempts",
        (
            "/api/v1/webhooks/{endpoint_id}/messages/{message_id}/replay",
            "post",
        ): "webhooks_message_replay",
        ("/api/v1/webhooks/{endpoint_id}/recover", "post"): "webhooks_recover",
        ("/api/v1/webhooks/{endpoint_id}/rotate-secret", "post"): "webhooks_rotate_secret",
    }


@pytest.mark.parametrize(
    ("path", "served"),
    [
        ("/api/v1/jobs/{job_id}/result", ["text/plain", "application/pdf", "application/zip"]),
        ("/api/v1/jobs/{job_id}/pages/{page}", ["text/plain", "application/pdf", "image/png"]),
    ],
)
def test_schema__downloads_are_binary_with_octet_stream_first(schema, path, served):
    # A generator reads the body by the first media type it knows: text/plain first made
    # openapi-python-client decode the bytes as text (issue 27).
    responses = schema["paths"][path]["get"]["responses"]
    content = responses["200"]["content"]
    assert list(content) == ["application/octet-stream", *served]
    for media_type in content.values():
        assert media_type["schema"] == {"type": "string", "format": "binary"}
    assert "ETag" in responses["200"]["headers"]
    assert set(responses["302"]["headers"]) == {"ETag", "Location"}
    assert "content" not in responses["302"] and "content" not in responses["304"]


def test_schema__idempotency_key_wait_and_the_cursor_page_are_declared(schema):
    submit = schema["paths"]["/api/v1/jobs"]["post"]
    (key,) = submit["parameters"]
    assert (key["name"], key["in"], key["schema"]["type"]) == (
        "Idempotency-Key",
        "header",
        "string",
    )
    assert re.fullmatch(key["schema"]["pattern"], "k" * 255)
    assert not re.fullmatch(key["schema"]["pattern"], "k" * 256)
    read = schema["paths"]["/api/v1/jobs/{job_id}"]["get"]
    assert {(p["name"], p["in"], p["schema"]["type"]) for p in read["parameters"]} == {
        ("job_id", "path", "string"),
        ("wait", "query", "number"),
    }
    listing = schema["paths"]["/api/v1/jobs"]["get"]
    assert {p["name"]: p["schema"] for p in listing["parameters"]}["limit"] == {
        "type": "integer",
        "minimum": 1,
        "maximum": 100,
    }
    ref = listing["responses"]["200"]["content"]["application/json"]["schema"]["$ref"]
    page = schema["components"]["schemas"][ref.rsplit("/", 1)[1]]
    assert set(page["required"]) == {"jobs", "next_cursor"}
    assert page["properties"]["jobs"]["items"] == {"$ref": "#/components/schemas/Job"}
    assert page["properties"]["next_cursor"] == {"type": "string", "nullable": True}


@pytest.mark.django_db
def test_docs__swagger_ui_is_served_from_the_package_and_names_no_external_host():
    client = Client()
    response = client.get("/api/v1/docs")
    assert response.status_code == 200
    html = response.content.decode()
    assert not re.search(r"(?i)(https?:)?//[a-z0-9.-]+\.[a-z]{2,}", html), "an external host"
    assets = re.findall(r'(?:src|href)="([^"]+)"', html)
    assert any(a.endswith("swagger-ui-bundle.js") for a in assets)
    for asset in assets:
        assert asset.startswith("/static/drf_spectacular_sidecar/"), asset
        served = client.get(asset)
        assert served.status_code == 200, asset
        assert b"".join(served.streaming_content)


@pytest.mark.django_db
@pytest.mark.parametrize("path", ["/static/../../etc/passwd", "/static/%2e%2e/settings.py"])
def test_static__serves_package_assets_only(path):
    response = Client().get(path)
    assert response.status_code in (400, 404)
    assert response["Content-Type"] == PROBLEM


@pytest.mark.django_db
@pytest.mark.parametrize("path", ["/admin/login/", "/api/v1/docs"])
def test_security_headers__admin_and_docs_cannot_be_framed(path):
    response = Client().get(path)
    assert response.status_code == 200
    assert response["X-Frame-Options"] == "DENY"
    assert response["X-Content-Type-Options"] == "nosniff"
    assert response["Referrer-Policy"] == "same-origin"
    assert "Cross-Origin-Opener-Policy" in response


@pytest.mark.django_db
def test_security_headers__problems_carry_them_too():
    response = Client().get("/nope")
    problem(response, 404, "not_found")
    assert response["X-Content-Type-Options"] == "nosniff"
    assert response["X-Frame-Options"] == "DENY"
