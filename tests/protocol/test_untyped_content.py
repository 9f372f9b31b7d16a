"""A field that is not of the API's type (a text that is a number, a list of parts or an
object; a finish reason that is an object): a compatible server's extension, or a bug.
It used to be passed on as it came, reaching OpenAI clients as an object or making a 500
further on; it now ends the stream with ``upstream_protocol_error``, naming the field."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from nexus.errors import UpstreamProtocolError
from nexus.events import Delta, Reasoning
from nexus.protocol.anthropic_events import EventDecoder
from nexus.protocol.openai_chunks import ChunkDecoder

ODD = [1.5, 7, ["x y"], {"type": "text", "text": "hi"}, True]


def openai(decoder: ChunkDecoder, chunk: Any) -> list[Any]:
    return decoder.decode(b"data: " + orjson.dumps(chunk) + b"\n\n")


def anthropic(decoder: EventDecoder, event: dict[str, Any]) -> list[Any]:
    name = event["type"].encode()
    return decoder.decode(b"event: " + name + b"\ndata: " + orjson.dumps(event) + b"\n\n")


def protocol_error(decoder: ChunkDecoder | EventDecoder, field: str) -> None:
    assert isinstance(decoder.error, UpstreamProtocolError)
    assert f"{field} that is not" in str(decoder.error)


@pytest.mark.parametrize("content", [c for c in ODD if type(c) is not list])
def test_openai_content_that_is_no_string(content: object) -> None:
    decoder = ChunkDecoder("p")
    assert openai(decoder, {"choices": [{"index": 0, "delta": {"content": content}}]}) == []
    protocol_error(decoder, "content")


def test_openai_content_sent_as_parts_is_its_text_and_reasoning() -> None:
    # Mistral's reasoning models send a content delta as a list of typed parts.
    parts = [
        {"type": "thinking", "thinking": [{"type": "text", "text": "Let me see"}]},
        {"type": "text", "text": "Hi"},
        {"type": "reference", "reference_ids": [1]},  # no text to pass on
        {"type": "text", "text": " there"},
    ]
    decoder = ChunkDecoder("p")
    events = openai(decoder, {"choices": [{"index": 0, "delta": {"content": parts}}]})
    assert events == [Reasoning("Let me see"), Delta("Hi there")]
    assert decoder.error is None


@pytest.mark.parametrize(
    ("parts", "field"),
    [
        (["x y"], "content part"),
        ([{"type": "text", "text": 5}], "content part's text"),
        ([{"type": "thinking", "thinking": {"text": "t"}}], "thinking"),
        (
            [{"type": "thinking", "thinking": [{"type": "text", "text": []}]}],
            "thinking part's text",
        ),
    ],
)
def test_openai_content_parts_of_another_type(parts: Any, field: str) -> None:
    decoder = ChunkDecoder("p")
    assert openai(decoder, {"choices": [{"index": 0, "delta": {"content": parts}}]}) == []
    protocol_error(decoder, field)


@pytest.mark.parametrize(
    ("delta", "finish", "field"),
    [
        ({"refusal": {"a": 1}}, None, "refusal"),
        ({"reasoning_content": 5}, None, "reasoning_content"),
        ({"reasoning": ["r"]}, None, "reasoning"),
        ({}, {"x": 1}, "finish_reason"),
        ({"tool_calls": [{"index": 0, "function": {"name": 1}}]}, None, "tool call name"),
        ({"tool_calls": [{"index": 0, "function": {"arguments": {}}}]}, None, "arguments"),
        ({"tool_calls": [{"index": 0, "id": 9, "function": {}}]}, None, "tool call id"),
        ({"tool_calls": [{"index": "0", "function": {}}]}, None, "tool call index"),
        ({"tool_calls": [{"index": -1, "function": {}}]}, None, "tool call index"),
        ({"tool_calls": ["f"]}, None, "tool call"),
        ({"tool_calls": {"index": 0}}, None, "tool_calls"),
    ],
)
def test_openai_fields_of_another_type(delta: Any, finish: Any, field: str) -> None:
    decoder = ChunkDecoder("p")
    chunk = {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    assert openai(decoder, chunk) == []
    protocol_error(decoder, field)


def test_events_before_a_malformed_chunk_still_go_out() -> None:
    good = {"choices": [{"index": 0, "delta": {"content": "Hi"}}]}
    bad = {"choices": [{"index": 0, "delta": {}, "finish_reason": 3}]}
    decoder = ChunkDecoder("p")
    body = b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in (good, bad))
    assert decoder.decode(body) == [Delta("Hi")]
    protocol_error(decoder, "finish_reason")


@pytest.mark.parametrize("text", ODD)
def test_anthropic_text_that_is_no_string(text: object) -> None:
    decoder = EventDecoder("claude")
    delta = {
        "type": "content_block_delta",
        "index": 0,
        "delta": {"type": "text_delta", "text": text},
    }
    assert anthropic(decoder, delta) == []
    protocol_error(decoder, "text")


@pytest.mark.parametrize(
    ("event", "field"),
    [
        ({"type": "content_block_delta", "delta": "text"}, "delta"),
        (
            {"type": "content_block_delta", "delta": {"type": "thinking_delta", "thinking": 1}},
            "thinking",
        ),
        (
            {"type": "content_block_delta", "delta": {"type": "signature_delta", "signature": {}}},
            "signature",
        ),
        (
            {
                "type": "content_block_delta",
                "delta": {"type": "citations_delta", "citation": {"url": ["u"]}},
            },
            "citation url",
        ),
        (
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "tool_use", "name": 7},
            },
            "tool_use name",
        ),
        ({"type": "content_block_start", "content_block": {"type": "text", "text": 5}}, "text"),
        ({"type": "message_delta", "delta": {"stop_reason": {"x": 1}}}, "stop_reason"),
        ({"type": "message_start", "message": "m"}, "message"),
    ],
)
def test_anthropic_fields_of_another_type(event: dict[str, Any], field: str) -> None:
    decoder = EventDecoder("claude")
    assert anthropic(decoder, event) == []
    protocol_error(decoder, field)
