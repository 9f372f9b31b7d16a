"""The strict form of Anthropic's structured-output schemas for an OpenAI upstream: closed
objects and every property required, only where each answer to it is one to the schema as
sent; no form (so no strict) for a schema strict mode would refuse or could only narrow to
answers the client did not ask for."""

from __future__ import annotations

import copy
from typing import Any, Literal

import anthropic
import pytest
from pydantic import BaseModel, Field

from nexus.protocol.strict_schema import MAX_OBJECT_DEPTH, strict_form


class Address(BaseModel):
    city: str
    zip: str | None = None


class Person(BaseModel):
    name: str = Field(description="full name")
    age: int = Field(ge=0)
    role: Literal["admin", "user"]
    born: str = Field(json_schema_extra={"format": "date"})
    home: Address | None = None
    work: Address
    nick: str | None = None


def objects(schema: Any) -> list[dict[str, Any]]:
    """Every object schema within ``schema``."""
    found: list[dict[str, Any]] = []
    if isinstance(schema, dict):
        if schema.get("type") == "object":
            found.append(schema)
        for value in schema.values():
            found += objects(value)
    elif isinstance(schema, list):
        for value in schema:
            found += objects(value)
    return found


def test_an_sdk_schema_is_closed_and_every_property_required() -> None:
    """What the anthropic SDK's ``messages.parse`` sends for a model with optional
    (nullable) fields and nested models by reference."""
    schema = anthropic.transform_schema(Person)
    sent = copy.deepcopy(schema)
    strict = strict_form(schema)
    assert schema == sent  # the client's schema is not changed
    assert strict is not None
    assert len(objects(strict)) == 2  # Person and Address (in $defs)
    for node in objects(strict):
        assert node["additionalProperties"] is False
        assert node["required"] == list(node["properties"])
    assert schema["required"] == ["name", "age", "role", "born", "work"]  # as sent
    assert strict["properties"] == schema["properties"]  # the values' schemas as sent
    assert strict["$defs"]["Address"]["required"] == ["city", "zip"]


def test_an_object_left_open_by_omission_is_closed() -> None:
    schema = {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "object", "properties": {}}}},
        "required": ["tags"],
    }
    assert strict_form(schema) == {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {},
                    "required": [],
                    "additionalProperties": False,
                },
            }
        },
        "required": ["tags"],
        "additionalProperties": False,
    }


def wrap(value: dict[str, Any], required: bool = True) -> dict[str, Any]:
    """A root object with one property of schema ``value``."""
    return {
        "type": "object",
        "properties": {"v": value},
        "required": ["v"] if required else [],
        "additionalProperties": False,
    }


def nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = wrap(schema)
    return schema


@pytest.mark.parametrize(
    "schema",
    [
        # optional properties: only a nullable one may be made required
        wrap({"type": "string"}, required=False),
        wrap({"type": ["string", "null"], "enum": ["a", "b"]}, required=False),
        wrap({"$ref": "#/$defs/X"}, required=False),
        # open objects: their answers are more than a closed one's
        {**wrap({"type": "string"}), "additionalProperties": True},
        {**wrap({"type": "string"}), "additionalProperties": {"type": "string"}},
        wrap({"type": "object"}),  # no properties listed
        # keywords strict mode refuses
        wrap({"type": "string", "minLength": 1}),
        wrap({"type": "string", "default": "x"}),
        wrap({"type": "array", "items": {"type": "string"}, "uniqueItems": True}),
        wrap({"type": "array"}),  # no items: "array schema missing items" under strict
        wrap({"type": ["array", "null"]}),
        wrap({"allOf": [{"type": "string"}]}),
        wrap({"not": {"type": "string"}}),
        wrap({"type": "string", "format": "uri"}),
        wrap({"$ref": "#/$defs/X", "description": "d"}),
        wrap({"type": "text"}),
        wrap({}),
        {**wrap({"type": "string"}), "$schema": "https://json-schema.org/draft/2020-12/schema"},
        # the root: an object, not a union nor another type
        {"anyOf": [wrap({"type": "string"}), wrap({"type": "integer"})]},
        {"type": "array", "items": wrap({"type": "string"})},
        # past strict mode's sizes
        nested(MAX_OBJECT_DEPTH + 1),
        {
            "type": "object",
            "properties": {f"p{i}": {"type": "integer"} for i in range(5001)},
            "required": [f"p{i}" for i in range(5001)],
        },
        wrap({"enum": list(range(1001))}),
    ],
)
def test_a_schema_strict_mode_cannot_take_as_it_means_has_no_strict_form(
    schema: dict[str, Any],
) -> None:
    assert strict_form(schema) is None


@pytest.mark.parametrize(
    "value",
    [
        {"type": ["string", "null"]},
        {"anyOf": [{"$ref": "#/$defs/X"}, {"type": "null"}]},
        {"enum": ["a", None]},
        {"const": None},
    ],
)
def test_an_optional_property_that_may_be_null_is_required(value: dict[str, Any]) -> None:
    strict = strict_form(wrap(value, required=False))
    assert strict is not None
    assert strict["required"] == ["v"]


def test_the_limits_themselves_are_within_strict_mode() -> None:
    assert strict_form(nested(MAX_OBJECT_DEPTH)) is not None
    assert strict_form(wrap({"enum": list(range(1000))})) is not None


@pytest.mark.parametrize(
    "value",
    [
        {"type": "string", "pattern": "^[a-z]+$"},
        {"type": "string", "format": "date-time"},
        {"type": "integer", "minimum": 0, "maximum": 9},
        {"type": "number", "exclusiveMinimum": 0, "multipleOf": 0.5},
        {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 3},
    ],
)
def test_a_types_constraints_are_kept_unless_the_model_takes_none(value: dict[str, Any]) -> None:
    assert strict_form(wrap(value)) == wrap(value)
    assert strict_form(wrap(value), constraints=False) is None
