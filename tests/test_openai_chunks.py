"""``read_events``: a read's payloads to events, its fast path for content deltas
checked against the general rules (``chunk_events``) on every shape of chunk."""

from __future__ import annotations

import itertools
import time
from typing import Any

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from nexus.errors import UpstreamError
from nexus.events import Delta
from nexus.protocol.sse import SSEDecoder
from nexus.providers.openai import ChunkReader, chunk_events, read_events

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


def _general(body: bytes) -> list[Any]:
    """The events of a whole body by the rules alone: SSE, then chunk_events()."""
    events: list[Any] = []
    for sse in SSEDecoder().decode(body):
        if sse.data.startswith("[DONE]"):
            break
        events += chunk_events(orjson.loads(sse.data))
    return events


_CONTENT = st.text(
    alphabet=st.sampled_from(["a", " ", '"', "\\", "\t", "\u00e9", "\U0001f600", "\u2028", "/"]),
    max_size=6,
)
_OTHER = st.sampled_from(
    [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {"choices": [{"index": 0, "delta": {"reasoning_content": "hm"}}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
        {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}},
        {"id": "other-id", "choices": [{"index": 0, "delta": {"content": "x"}}]},
    ]
)


@st.composite
def bodies(draw: st.DrawFn) -> bytes:
    """A stream's body: mostly content chunks of one id, some others, odd separators."""
    frames = []
    for _ in range(draw(st.integers(min_value=0, max_value=40))):
        if draw(st.integers(min_value=0, max_value=9)):
            chunk: dict[str, Any] = {
                "id": "chatcmpl-1",
                "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": {"content": draw(_CONTENT)}}],
            }
        else:
            chunk = draw(_OTHER)
        line = b"data: " + orjson.dumps(chunk)
        end = draw(st.sampled_from([b"\n\n"] * 8 + [b"\r\n\r\n", b"\n: ping\n\n", b"\n\n\n"]))
        frames.append(line + end)
    return b"".join(frames) + b"data: [DONE]\n\n"


@settings(max_examples=400, database=None, deadline=None)
@given(data=st.data(), body=bodies())
def test_feed_gives_the_events_of_the_rules_however_the_body_is_cut(
    data: st.DataObject, body: bytes
) -> None:
    cuts = data.draw(st.lists(st.integers(min_value=0, max_value=len(body)), max_size=10))
    bounds = [0, *sorted(cuts), len(body)]
    reader = ChunkReader("up")
    events: list[Any] = []
    done = False
    for a, b in itertools.pairwise(bounds):
        more, end = reader.feed(body[a:b])
        events += more
        assert end is False or end is True
        if end:
            done = True
            break
    assert done
    assert events == _general(body)


def test_feed_learns_the_template_and_takes_its_path() -> None:
    def chunk(content: str) -> bytes:
        payload = {"id": "c", "choices": [{"index": 0, "delta": {"content": content}}]}
        return b"data: " + orjson.dumps(payload) + b"\n\n"

    reader = ChunkReader("up")
    reader.feed(chunk("learn"))
    assert reader._head is not None
    text = (chunk('say "hi"') + chunk("a\\b") + chunk("plain") + chunk("")).decode()
    events, used = reader._template_events(text)
    assert used == len(text)
    assert events == [Delta('say "hi"'), Delta("a\\b"), Delta("plain")]


def test_a_long_chunk_in_many_reads_costs_linear_time() -> None:
    # A big content string (an image in base64) arriving in 1 KB reads once the template
    # is known: the pending line is kept in pieces, not copied on every read. Eight times
    # the size takes about eight times as long; a copy per read would take 64.
    def chunk(content: str) -> bytes:
        payload = {"id": "c", "choices": [{"index": 0, "delta": {"content": content}}]}
        return b"data: " + orjson.dumps(payload) + b"\n\n"

    def feed_time(size: int) -> float:
        body = chunk("x" * size)
        best = float("inf")
        for _ in range(5):
            reader = ChunkReader("up")
            reader.feed(chunk("learn"))
            start = time.perf_counter()
            events: list[Any] = []
            for i in range(0, len(body), 1024):
                events += reader.feed(body[i : i + 1024])[0]
            best = min(best, time.perf_counter() - start)
            assert events == [Delta("x" * size)]
        return best

    short, long = feed_time(128 * 1024), feed_time(1024 * 1024)
    assert long < 24 * short + 0.005, f"{long * 1000:.1f} ms vs {short * 1000:.1f} ms"


def test_no_template_is_learnt_from_an_event_of_several_data_lines() -> None:
    # SSE joins the lines with LF: a template holding one would let a line that SSE
    # ignores (an unknown field) pass as an event of the template.
    reader = ChunkReader("up")
    body = b'data: {"choices":[{"index":0,"delta":\ndata: {"content":"hi"}}]}\n\n'
    events, end = reader.feed(body)
    assert events == [Delta("hi")] and end is False
    assert reader._head is None
    events, end = reader.feed(b'{"content":"evil"}}]}\n\n')
    assert events == [] and end is False
