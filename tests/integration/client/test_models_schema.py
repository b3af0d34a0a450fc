"""The client's models (client/quire_client/models.py) stay in step with the served OpenAPI
document: every property of each mirrored component is a field of its dataclass and every field
(but the client's own) is a property, with the same nullability (issue 27 point 1)."""

from __future__ import annotations

import dataclasses
import types
import typing

import pytest
from django.test import Client
from quire_client import models


@pytest.fixture(scope="module")
def schema(django_db_blocker) -> dict:
    with django_db_blocker.unblock():
        response = Client().get("/api/v1/schema", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    assert response.status_code == 200
    return response.json()


def _nullable(annotation: object) -> bool:
    return isinstance(annotation, types.UnionType) and type(None) in typing.get_args(annotation)


@pytest.mark.parametrize("component", sorted(models.SCHEMA_COMPONENTS))
def test_client_models__match_the_schema_components(schema, component):
    cls = models.SCHEMA_COMPONENTS[component]
    declared = schema["components"]["schemas"][component]
    properties = declared["properties"]
    own = models.CLIENT_ONLY_FIELDS.get(cls, frozenset())
    hints = typing.get_type_hints(cls, vars(models))
    fields = {f.name for f in dataclasses.fields(cls)} - own
    assert fields == set(properties), f"{component}: client {sorted(fields)} vs schema"
    for name, prop in properties.items():
        nullable = prop.get("nullable", False) or name not in declared.get("required", [])
        assert _nullable(hints[name]) == nullable, f"{component}.{name}: nullability differs"


def test_client_models__every_response_component_of_a_job_is_mirrored(schema):
    """A new component referenced by the job representation needs a model too."""
    job = schema["components"]["schemas"]["Job"]["properties"]
    referenced = {
        ref.rsplit("/", 1)[1]
        for prop in job.values()
        for ref in [prop.get("$ref")] + [s.get("$ref") for s in prop.get("allOf", [])]
        if ref
    }
    objects = {r for r in referenced if "enum" not in schema["components"]["schemas"][r]}
    assert objects <= set(models.SCHEMA_COMPONENTS), objects - set(models.SCHEMA_COMPONENTS)


def test_client_models__outputs_and_terminal_states_are_the_schemas(schema):
    components = schema["components"]["schemas"]
    assert tuple(components["OutputEnum"]["enum"]) == models.OUTPUTS
    assert models.TERMINAL_STATES <= set(components["StateEnum"]["enum"])
