"""Stream events: each type's JSON form (the NDJSON line), the OpenAI wire pieces, immutability."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nexus import events
from nexus.events import (
    Audio,
    Citation,
    Delta,
    Done,
    Error,
    Heartbeat,
    Image,
    Reasoning,
    StreamEvent,
    ToolCall,
    Usage,
    content_delta,
)

FIRST = ToolCall(index=0, id="call_1", name="get_weather")
LATER = ToolCall(index=0, arguments='{"city":')


@pytest.mark.parametrize(
    ("event", "expected"),
    [
        pytest.param(
            Delta(content="Hello"),
            {"type": "delta", "delta": {"content": "Hello"}},
            id="delta-content",
        ),
        pytest.param(
            Delta(content=""),
            {"type": "delta", "delta": {"content": ""}},
            id="delta-empty-content-kept",
        ),
        pytest.param(
            Delta(finish_reason="stop"),
            {"type": "delta", "delta": {}, "finish_reason": "stop"},
            id="delta-finish",
        ),
        pytest.param(
            Delta(content="x", finish_reason="length"),
            {"type": "delta", "delta": {"content": "x"}, "finish_reason": "length"},
            id="delta-content-and-finish",
        ),
        pytest.param(Delta(), {"type": "delta", "delta": {}}, id="delta-empty"),
        pytest.param(
            Delta(tool_calls=()), {"type": "delta", "delta": {}}, id="delta-no-tool-calls-omitted"
        ),
        pytest.param(
            Delta(role="assistant", content="Hi", refusal="no", tool_calls=(FIRST, LATER)),
            {
                "type": "delta",
                "delta": {
                    "role": "assistant",
                    "content": "Hi",
                    "refusal": "no",
                    "tool_calls": [
                        {
                            "index": 0,
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": ""},
                        },
                        {"index": 0, "function": {"arguments": '{"city":'}},
                    ],
                },
            },
            id="delta-every-field",
        ),
        pytest.param(
            Reasoning("Let me think..."),
            {"type": "reasoning", "delta": {"reasoning": "Let me think..."}},
            id="reasoning",
        ),
        pytest.param(
            FIRST,
            {
                "type": "tool_call",
                "delta": {
                    "tool_calls": [
                        {
                            "index": 0,
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": ""},
                        }
                    ]
                },
            },
            id="tool-call-first",
        ),
        pytest.param(
            ToolCall(index=2, arguments='"Paris"}'),
            {
                "type": "tool_call",
                "delta": {"tool_calls": [{"index": 2, "function": {"arguments": '"Paris"}'}}]},
            },
            id="tool-call-later",
        ),
        pytest.param(
            Audio(data="UklGRg==", format="pcm16"),
            {"type": "audio", "audio": {"data": "UklGRg==", "format": "pcm16", "transcript": None}},
            id="audio-nulls-kept",
        ),
        pytest.param(
            Audio(transcript="hi"),
            {"type": "audio", "audio": {"data": None, "format": None, "transcript": "hi"}},
            id="audio-transcript-only",
        ),
        pytest.param(
            Image(data="iVBORw0K", mime_type="image/png"),
            {"type": "image", "image": {"data": "iVBORw0K", "url": None, "mime_type": "image/png"}},
            id="image-inline",
        ),
        pytest.param(
            Image(url="https://example.com/cat.png"),
            {
                "type": "image",
                "image": {"data": None, "url": "https://example.com/cat.png", "mime_type": None},
            },
            id="image-url",
        ),
        pytest.param(
            Citation(url="https://example.com", title="Example", quoted="a quote"),
            {
                "type": "citation",
                "citation": {"url": "https://example.com", "title": "Example", "quoted": "a quote"},
            },
            id="citation",
        ),
        pytest.param(
            Citation(url="https://example.com"),
            {
                "type": "citation",
                "citation": {"url": "https://example.com", "title": None, "quoted": None},
            },
            id="citation-nulls-kept",
        ),
        pytest.param(
            Usage(prompt_tokens=5, completion_tokens=3, total_tokens=8),
            {
                "type": "usage",
                "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
            },
            id="usage",
        ),
        pytest.param(
            Error(
                error_type="upstream_error",
                message="boom",
                code="upstream_timeout",
                retryable=True,
                param="model",
            ),
            {
                "type": "error",
                "error": {
                    "type": "upstream_error",
                    "message": "boom",
                    "code": "upstream_timeout",
                    "retryable": True,
                    "param": "model",
                },
            },
            id="error-param-names-the-field",
        ),
        pytest.param(
            Error(error_type="server_error", message="oops"),
            {
                "type": "error",
                "error": {
                    "type": "server_error",
                    "message": "oops",
                    "code": None,
                    "retryable": False,
                },
            },
            id="error-defaults",
        ),
        pytest.param(Heartbeat(), {"type": "heartbeat"}, id="heartbeat"),
        pytest.param(Done(), {"type": "done"}, id="done"),
        pytest.param(Done(aborted=True), {"type": "done", "aborted": True}, id="done-aborted"),
    ],
)
def test_to_dict(event: StreamEvent, expected: dict[str, Any]) -> None:
    assert event.to_dict() == expected
    assert event.to_dict()["type"] == type(event).type


def test_to_dict_returns_a_fresh_dict_each_time() -> None:
    event = Delta(content="Hello", tool_calls=(FIRST,))
    first = event.to_dict()
    first["delta"]["content"] = "changed"
    first["delta"]["tool_calls"][0]["function"]["arguments"] = "changed"
    assert event.to_dict() == {
        "type": "delta",
        "delta": {
            "content": "Hello",
            "tool_calls": [
                {
                    "index": 0,
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": ""},
                }
            ],
        },
    }


@pytest.mark.parametrize(
    ("call", "expected"),
    [
        pytest.param(
            ToolCall(index=0, id="call_1", name="f"),
            {
                "index": 0,
                "id": "call_1",
                "type": "function",
                "function": {"arguments": "", "name": "f"},
            },
            id="first-fragment",
        ),
        pytest.param(
            ToolCall(index=1, id="call_2", name="g", arguments="{}"),
            {
                "index": 1,
                "id": "call_2",
                "type": "function",
                "function": {"arguments": "{}", "name": "g"},
            },
            id="first-fragment-with-arguments",
        ),
        pytest.param(
            ToolCall(index=0, arguments='{"a": 1'),
            {"index": 0, "function": {"arguments": '{"a": 1'}},
            id="later-fragment",
        ),
        pytest.param(
            ToolCall(index=3),
            {"index": 3, "function": {"arguments": ""}},
            id="later-fragment-empty",
        ),
        pytest.param(
            ToolCall(index=0, id="call_1"),
            {"index": 0, "id": "call_1", "type": "function", "function": {"arguments": ""}},
            id="id-without-name",
        ),
    ],
)
def test_tool_call_wire(call: ToolCall, expected: dict[str, Any]) -> None:
    assert call.wire() == expected
    # The SDK's stream helper asserts every tool-call delta has a function object (§2).
    assert "function" in call.wire()


def test_tool_call_wire_key_order_is_index_id_type_function() -> None:
    assert list(FIRST.wire()) == ["index", "id", "type", "function"]
    assert list(LATER.wire()) == ["index", "function"]


@pytest.mark.parametrize(
    ("usage", "expected"),
    [
        pytest.param(
            Usage(prompt_tokens=9, completion_tokens=12, total_tokens=21),
            {"prompt_tokens": 9, "completion_tokens": 12, "total_tokens": 21},
            id="no-details",
        ),
        pytest.param(
            Usage(),
            {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
            id="zeros",
        ),
        pytest.param(
            Usage(9, 12, 21, cached_tokens=4, reasoning_tokens=7),
            {
                "prompt_tokens": 9,
                "completion_tokens": 12,
                "total_tokens": 21,
                "prompt_tokens_details": {"cached_tokens": 4},
                "completion_tokens_details": {"reasoning_tokens": 7},
            },
            id="both-details",
        ),
        pytest.param(
            Usage(9, 12, 21, cached_tokens=0),
            {
                "prompt_tokens": 9,
                "completion_tokens": 12,
                "total_tokens": 21,
                "prompt_tokens_details": {"cached_tokens": 0},
            },
            id="cached-zero-is-kept",
        ),
        pytest.param(
            Usage(9, 12, 21, reasoning_tokens=0),
            {
                "prompt_tokens": 9,
                "completion_tokens": 12,
                "total_tokens": 21,
                "completion_tokens_details": {"reasoning_tokens": 0},
            },
            id="reasoning-zero-is-kept",
        ),
    ],
)
def test_usage_wire(usage: Usage, expected: dict[str, Any]) -> None:
    assert usage.wire() == expected
    assert usage.to_dict() == {"type": "usage", "usage": expected}


def test_type_tags_are_class_variables_not_fields() -> None:
    tags = {
        cls: cls.type
        for cls in (
            Delta,
            Reasoning,
            ToolCall,
            Audio,
            Image,
            Citation,
            Usage,
            Error,
            Heartbeat,
            Done,
        )
    }
    assert tags == {
        Delta: "delta",
        Reasoning: "reasoning",
        ToolCall: "tool_call",
        Audio: "audio",
        Image: "image",
        Citation: "citation",
        Usage: "usage",
        Error: "error",
        Heartbeat: "heartbeat",
        Done: "done",
    }
    assert [f.name for f in dataclasses.fields(Error)] == [
        "error_type",
        "message",
        "code",
        "retryable",
        "param",
    ]
    assert [f.name for f in dataclasses.fields(Heartbeat)] == []


@pytest.mark.parametrize(
    ("event", "field", "value"),
    [
        (Delta(content="a"), "content", "b"),
        (Reasoning("a"), "text", "b"),
        (ToolCall(index=0), "arguments", "x"),
        (Audio(data="a"), "data", "b"),
        (Image(url="a"), "url", "b"),
        (Citation(url="a"), "url", "b"),
        (Usage(1, 2, 3), "total_tokens", 4),
        (Error(error_type="t", message="a"), "message", "b"),
        (Done(), "aborted", True),
    ],
)
def test_events_are_frozen(event: StreamEvent, field: str, value: object) -> None:
    before = getattr(event, field)
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(event, field, value)
    assert getattr(event, field) == before


@pytest.mark.parametrize("event", [Delta(content="a"), Heartbeat(), Done(), Usage()])
def test_events_are_slotted(event: StreamEvent) -> None:
    assert not hasattr(event, "__dict__")
    with pytest.raises((AttributeError, TypeError)):
        event.extra = 1  # type: ignore[union-attr]


def test_events_compare_and_hash_by_value() -> None:
    assert Delta(content="a", tool_calls=(FIRST,)) == Delta(content="a", tool_calls=(FIRST,))
    assert Delta(content="a") != Delta(content="b")
    assert len({Done(), Done(), Done(aborted=True)}) == 2
    assert hash(ToolCall(index=0, id="x")) == hash(ToolCall(index=0, id="x"))


@given(st.text())
def test_content_delta_is_the_delta_of_its_content(text: str) -> None:
    # The commonest event's fast constructor makes the very object Delta(content) does.
    fast, made = content_delta(text), Delta(text)
    assert type(fast) is Delta and fast == made and hash(fast) == hash(made)
    assert repr(fast) == repr(made) and dataclasses.astuple(fast) == dataclasses.astuple(made)
    assert dataclasses.replace(fast, role="assistant") == Delta(text, role="assistant")
    assert not hasattr(fast, "__dict__")
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.content = "x"  # type: ignore[misc]


def test_a_short_content_delta_is_shared_and_the_table_stays_bounded() -> None:
    # Logs hold every event: a token repeated across streams is one object, not one each.
    assert content_delta(" the") is content_delta(" the")
    long = "x" * (events.SHARED_LEN + 1)
    assert content_delta(long) is not content_delta(long)
    assert content_delta(long) == Delta(long)
    for i in range(events.SHARED_MAX * 2):
        content_delta(f" w{i}")
    assert len(events._SHARED) <= events.SHARED_MAX
    assert content_delta(" the") == Delta(" the")
