"""A ``/v1/messages`` prompt is estimated once for each thing the model reads.

Its assistant turns and tool results ride beside their chat form as Anthropic blocks
(for an Anthropic target to get them back as sent): counted there too, a text sent as an
assistant block or a tool result was estimated twice, so a stream its client left was
charged twice its prompt and a budget refused an agent at half its limit; a tool's
``input_examples`` (carried beside the tool) were not counted at all, so ten requests of
400 KB of them each spent twenty times a key's budget.
"""

from __future__ import annotations

import base64
from typing import Any

import orjson

from nexus.estimates import CHARS_PER_TOKEN, IMAGE_DETAIL_TOKENS, prompt_estimate
from nexus.protocol.anthropic_messages import parse_messages_request

TEXT = "lorem ipsum " * 10_000  # 120 KB: 30,000 tokens
TOKENS = len(TEXT) // CHARS_PER_TOKEN
USE = {"type": "tool_use", "id": "toolu_1", "name": "ls", "input": {}}


def estimate(messages: list[dict[str, Any]], **body: Any) -> int:
    request = {"model": "m", "max_tokens": 1, "messages": messages, **body}
    return prompt_estimate(parse_messages_request(orjson.dumps(request)))


def result(*blocks: dict[str, Any]) -> dict[str, Any]:
    block = {"type": "tool_result", "tool_use_id": "toolu_1", "content": list(blocks)}
    return {"role": "user", "content": [block]}


def test_a_text_is_estimated_once_wherever_it_is_sent() -> None:
    plain = estimate([{"role": "user", "content": TEXT}])
    assistant = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [{"type": "text", "text": TEXT}]},
        {"role": "user", "content": "and?"},
    ]
    halves = [{"type": "text", "text": TEXT[: len(TEXT) // 2]}]
    halves.append({"type": "text", "text": TEXT[len(TEXT) // 2 :]})
    in_result = [{"role": "user", "content": "go"}, {"role": "assistant", "content": [USE]}]
    assert TOKENS <= plain < TOKENS * 1.01
    assert TOKENS <= estimate(assistant) < TOKENS * 1.01
    assert TOKENS <= estimate([*in_result, result(*halves)]) < TOKENS * 1.01


def test_thinking_sent_back_counts_and_an_image_in_a_tool_result_is_an_image() -> None:
    thinking = {"type": "thinking", "thinking": TEXT, "signature": "c2ln"}
    turns = [{"role": "user", "content": "go"}, {"role": "assistant", "content": [thinking, USE]}]
    assert estimate([*turns, result({"type": "text", "text": "ok"})]) >= TOKENS
    png = base64.b64encode(b"\x89PNG" + bytes(400_000)).decode()
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}}
    turns[1]["content"] = [USE]
    with_image = estimate([*turns, result(image)])
    assert IMAGE_DETAIL_TOKENS <= with_image < IMAGE_DETAIL_TOKENS + 100  # not 130,000


def test_what_rides_beside_a_tool_is_estimated() -> None:
    tool = {"name": "f", "input_schema": {"type": "object"}}
    bare = estimate([{"role": "user", "content": "hi"}], tools=[tool])
    examples = [{"input": {"q": TEXT}}]
    shown = estimate(
        [{"role": "user", "content": "hi"}], tools=[{**tool, "input_examples": examples}]
    )
    assert shown - bare >= TOKENS
