"""``/v1/responses`` fields that change the answer: carried across to Chat Completions, or
refused with a 400 naming them, never dropped in silence."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from nexus.errors import InvalidRequest
from nexus.protocol.openai_request import upstream_body
from nexus.protocol.openai_responses import parse_responses_request


def parse(**body: Any) -> dict[str, Any]:
    """What an OpenAI upstream receives for the Responses body."""
    request = parse_responses_request(orjson.dumps({"model": "up/m", "input": "hi", **body}))
    return upstream_body(request, "m")


def test_fields_with_a_chat_completions_twin_go_upstream() -> None:
    sent = parse(
        text={"verbosity": "low"},
        service_tier="flex",
        prompt_cache_key="k1",
        safety_identifier="u1",
        metadata={"a": "b"},
        store=True,
        reasoning={"effort": "low", "summary": "auto"},
        truncation="disabled",
        include=[],
    )
    assert sent["verbosity"] == "low"
    assert sent["service_tier"] == "flex"
    assert (sent["prompt_cache_key"], sent["safety_identifier"]) == ("k1", "u1")
    assert "metadata" not in sent  # the response's: OpenAI refuses it without store: true
    assert sent["reasoning_effort"] == "low"
    # store stays home: Nexus keeps nothing, and upstream it would keep the exchange.
    for ours in ("text", "reasoning", "truncation", "include", "summary", "store"):
        assert ours not in sent


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": {"id": "pmpt_1", "variables": {"a": "b"}}}, "prompt"),
        ({"max_tool_calls": 1}, "max_tool_calls"),
        ({"truncation": "auto"}, "truncation"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"reasoning": {"summary": "detailed"}}, "reasoning.summary"),
        ({"reasoning": {"summary": "concise"}}, "reasoning.summary"),
        ({"top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 5}, "top_logprobs"),
        ({"text": {"verbosity": "loud"}}, "text.verbosity"),
        # Fields Nexus does not know were accepted and went nowhere (docs: refused).
        ({"moderation": {"output": "block"}}, "moderation"),
        ({"context_management": [{"type": "compaction"}]}, "context_management"),
        ({"seed": 7}, "seed"),
    ],
)
def test_fields_nexus_cannot_honour_are_refused(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse(**body)
    assert info.value.param == param
    assert info.value.code == "invalid_request"
    assert info.value.message.startswith(f"{param}: ")


@pytest.mark.parametrize("field", ["defer_loading", "output_schema", "allowed_callers"])
def test_a_function_tools_fields_beside_the_function_are_refused_by_name(field: str) -> None:
    """They went upstream as a tool of name, description and parameters alone: a tool kept
    from direct calls (``allowed_callers``) could be called directly."""
    tool = {"type": "function", "name": "f", "parameters": {"type": "object"}, field: ["x"]}
    with pytest.raises(InvalidRequest) as refused:
        parse(tools=[tool])
    assert refused.value.param == f"tools[0].{field}"
    plain = {key: value for key, value in tool.items() if key != field} | {"strict": True}
    (sent,) = parse(tools=[plain])["tools"]
    assert sent == {"type": "function", "function": {k: v for k, v in plain.items() if k != "type"}}


def test_a_text_parts_cache_breakpoint_goes_upstream() -> None:
    """A text part's ``prompt_cache_breakpoint`` (chat's text part has one too) was dropped."""
    part = {"type": "input_text", "text": "long", "prompt_cache_breakpoint": {"ttl": "1h"}}
    sent = parse(input=[{"role": "user", "content": [part]}])
    assert sent["messages"][0]["content"] == [
        {"type": "text", "text": "long", "prompt_cache_breakpoint": {"ttl": "1h"}}
    ]
