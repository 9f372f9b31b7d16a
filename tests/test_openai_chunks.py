"""``read_events``: a read's payloads to events, its fast path for content deltas
checked against the general rules (``chunk_events``) on every shape of chunk."""

from __future__ import annotations

from typing import Any

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from nexus.errors import UpstreamError
from nexus.events import Delta
from nexus.providers.openai import chunk_events, read_events

_TEXT = st.one_of(st.none(), st.just(""), st.text(max_size=5))
_DELTA = st.dictionaries(
    st.sampled_from(["content", "role", "reasoning_content", "reasoning", "refusal"]),
    _TEXT,
    max_size=3,
)
_CHOICE = st.fixed_dictionaries(
    {"delta": _DELTA},
    optional={
        "index": st.sampled_from([0, 1, None]),
        "finish_reason": st.sampled_from([None, "stop", "length"]),
    },
)
_CHUNK = st.fixed_dictionaries(
    {"id": st.just("chatcmpl-1"), "choices": st.lists(_CHOICE, max_size=2)},
    optional={
        "usage": st.one_of(
            st.none(),
            st.just({"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}),
        )
    },
)


@settings(max_examples=500, database=None, deadline=None)
@given(chunks=st.lists(_CHUNK, max_size=6))
def test_fast_path_gives_what_the_general_rules_give(chunks: list[dict[str, Any]]) -> None:
    payloads = [orjson.dumps(chunk).decode() for chunk in chunks]
    events, end = read_events(payloads, "up")
    assert end is False
    assert events == [event for chunk in chunks for event in chunk_events(chunk)]


def test_done_ends_the_read_and_what_follows_is_not_read() -> None:
    content = '{"choices":[{"index":0,"delta":{"content":"hi"}}]}'
    events, end = read_events([content, "[DONE]", content], "up")
    assert events == [Delta("hi")] and end is True


def test_events_before_an_error_are_kept_and_the_error_returned() -> None:
    content = '{"choices":[{"index":0,"delta":{"content":"hi"}}]}'
    events, end = read_events([content, '{"error":{"message":"boom","type":"x"}}'], "up")
    assert events == [Delta("hi")]
    assert isinstance(end, UpstreamError) and "boom" in str(end)
    events, end = read_events([content, "not json"], "up")
    assert events == [Delta("hi")]
    assert isinstance(end, UpstreamError) and end.code == "upstream_protocol_error"
