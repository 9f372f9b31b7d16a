"""Anthropic's ``output_config`` in each upstream's terms, body by body: its format strict
where it can be; what has no counterpart on a target (an effort level too) refused there
naming the field, never dropped; OpenAI's effort off Anthropic targets."""

from __future__ import annotations

from typing import Any, get_args

import orjson
import pytest
from openai.types.shared import ReasoningEffort

from nexus.errors import InvalidRequest
from nexus.protocol import anthropic_events, openai_request
from nexus.protocol.anthropic_messages import parse_messages_request
from nexus.protocol.openai_responses import parse_responses_request
from nexus.request import ChatRequest

USER = {"role": "user", "content": "Hi"}
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "note": {"type": ["string", "null"]}},
    "required": ["city"],
}
STRICT = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "note": {"type": ["string", "null"]}},
    "required": ["city", "note"],
    "additionalProperties": False,
}
OPENAI_LEVELS = set(get_args(get_args(ReasoningEffort)[0]))


def chat(**fields: Any) -> ChatRequest:
    return ChatRequest.model_validate({"model": "up/m", "messages": [USER], **fields})


def messages(**fields: Any) -> ChatRequest:
    body = {"model": "up/m", "max_tokens": 50, "messages": [USER], **fields}
    return parse_messages_request(orjson.dumps(body))


def to_openai(request: ChatRequest, model: str = "m") -> dict[str, Any]:
    assert openai_request.refusal(request) is None
    return openai_request.upstream_body(request, model)


def to_anthropic(request: ChatRequest) -> dict[str, Any]:
    assert anthropic_events.refusal(request) is None
    return anthropic_events.messages_body(request, "m", 100)


@pytest.mark.parametrize("level", ["low", "medium", "high", "xhigh", "max"])
def test_a_messages_clients_effort_is_refused_by_an_openai_target(level: str) -> None:
    """Not every OpenAI model takes a reasoning effort (a non-reasoning one answers 400,
    which would end the request): refused here, an alias falls back to a target that can."""
    request = messages(output_config={"effort": level})
    refused(openai_request, request, "output_config.effort", "")
    assert to_anthropic(request)["output_config"] == {"effort": level}


@pytest.mark.parametrize("level", sorted(OPENAI_LEVELS))
def test_reasoning_effort_stays_off_an_anthropic_upstream(level: str) -> None:
    chat_body = to_anthropic(chat(reasoning_effort=level))
    responses = parse_responses_request(
        orjson.dumps({"model": "up/m", "input": "Hi", "reasoning": {"effort": level}})
    )
    assert "output_config" not in chat_body and "reasoning_effort" not in chat_body
    assert "output_config" not in to_anthropic(responses)
    assert anthropic_events.refusal(chat(reasoning_effort=level)) is None
    assert to_openai(chat(reasoning_effort=level))["reasoning_effort"] == level  # as it was


def refused(target: Any, request: ChatRequest, param: str, value: str) -> None:
    """``target``'s provider refuses ``request`` naming ``param`` and ``value``, and its
    body cannot be written."""
    error = target.refusal(request)
    assert error is not None
    assert (error.param, error.status, error.code) == (param, 400, "invalid_request")
    assert error.message.startswith(f"{param}: ")
    assert value in error.message
    with pytest.raises(InvalidRequest):
        if target is openai_request:
            openai_request.upstream_body(request, "m")
        else:
            anthropic_events.messages_body(request, "m", 100)


def test_a_chat_clients_output_config_reaches_openai_in_its_terms() -> None:
    fmt = {"type": "json_schema", "schema": SCHEMA}
    body = to_openai(chat(output_config={"format": fmt}))
    assert "output_config" not in body and "reasoning_effort" not in body
    assert body["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": STRICT, "strict": True},
    }
    # and an Anthropic upstream gets it as sent
    sent = {"effort": "medium", "format": fmt, "task_budget": {"total": 10}}
    assert to_anthropic(chat(output_config=sent))["output_config"] == sent


@pytest.mark.parametrize(
    ("config", "param", "value"),
    [
        ({"task_budget": {"total": 10}}, "output_config.task_budget", ""),
        ({"effort": "low"}, "output_config.effort", ""),
        ({"format": {"type": "text"}}, "output_config.format", "json_schema"),
        ({"format": {"type": "json_schema"}}, "output_config.format", "json_schema"),
        ("high", "output_config", "object"),
    ],
)
def test_output_config_with_no_chat_counterpart_is_refused(
    config: Any, param: str, value: str
) -> None:
    refused(openai_request, chat(output_config=config), param, value)


def test_a_format_asked_twice_is_refused_by_either_target() -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}
    both = chat(response_format=fmt, output_config={"format": {"type": "json_schema"}})
    for target in (openai_request, anthropic_events):
        refused(target, both, "output_config.format", "response_format")


def test_a_messages_clients_format_is_strict_for_openai_and_as_sent_for_anthropic() -> None:
    request = messages(output_config={"format": {"type": "json_schema", "schema": SCHEMA}})
    assert to_openai(request)["response_format"]["json_schema"] == {
        "name": "output",
        "schema": STRICT,
        "strict": True,
    }
    assert to_anthropic(request)["output_config"] == {
        "format": {"type": "json_schema", "schema": SCHEMA}
    }
    assert request.model_extra is not None
    assert request.model_extra["output_config"]["format"]["schema"] == SCHEMA  # untouched


def test_a_schema_strict_mode_cannot_hold_goes_as_before() -> None:
    """An optional property that may not be null: required, the model would have to make
    one up; strict mode refuses it left out. So the schema goes as sent, without strict,
    as before (OpenAI takes it as a hint)."""
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "error": {"type": "string"}},
        "required": ["city"],
    }
    request = messages(output_config={"format": {"type": "json_schema", "schema": schema}})
    assert to_openai(request)["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": schema},
    }


def test_a_fine_tuned_model_gets_strict_only_without_constraints() -> None:
    """A fine-tuned OpenAI model takes no pattern, format, minimum, minItems... under
    strict: a schema with one goes to it as before."""
    schema = {
        "type": "object",
        "properties": {"day": {"type": "string", "format": "date"}},
        "required": ["day"],
    }
    request = messages(output_config={"format": {"type": "json_schema", "schema": schema}})
    assert to_openai(request)["response_format"]["json_schema"]["strict"] is True
    tuned = to_openai(request, "ft:gpt-4o-mini:acme::abc123")["response_format"]
    assert tuned["json_schema"] == {"name": "output", "schema": schema}
