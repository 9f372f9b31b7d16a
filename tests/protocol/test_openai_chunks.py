"""``ChunkDecoder``: an OpenAI-compatible stream's body to events, by the rules of
``chunk_events``, however the body is cut into reads."""

from __future__ import annotations

import itertools
import time
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nexus.errors import UpstreamError, UpstreamProtocolError, UpstreamServerError
from nexus.events import Delta, Reasoning, ToolCall, Usage
from nexus.protocol.openai_chunks import ChunkDecoder, ToolCallPieces, chunk_events
from nexus.protocol.openai_request import upstream_body
from nexus.protocol.sse import SSEDecoder
from nexus.protocol.upstream import Malformed, in_stream_error, malformed
from nexus.request import ChatRequest

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


def read_events(payloads: list[str]) -> tuple[list[Any], bool | UpstreamError]:
    """The events of one read of ``payloads``, and its end: ``[DONE]``, an error or False."""
    decoder = ChunkDecoder("up")
    events = decoder.decode(b"".join(b"data: " + p.encode() + b"\n\n" for p in payloads))
    return events, decoder.error or decoder.done


def rules(chunks: list[dict[str, Any]]) -> list[Any]:
    """The events of a whole stream: each chunk's, but a usage beside choices held to the
    end, where the last one goes (one on a chunk of its own goes at once, and ends it)."""
    events: list[Any] = []
    held = None
    for chunk in chunks:
        chunk_events(chunk, events)
        if chunk.get("usage"):
            usage = events.pop()
            if chunk.get("choices"):
                held = usage
            else:
                events.append(usage)
                held = None
    return events if held is None else [*events, held]


@settings(max_examples=500, database=None, deadline=None)
@given(chunks=st.lists(_CHUNK, max_size=6))
def test_a_read_gives_the_events_of_each_chunk_in_order(chunks: list[dict[str, Any]]) -> None:
    payloads = [orjson.dumps(chunk).decode() for chunk in chunks]
    events, end = read_events([*payloads, "[DONE]"])
    assert end is True
    assert events == rules(chunks)


def test_one_usage_reaches_the_client_however_many_the_upstream_sends() -> None:
    """vLLM's continuous_usage_stats puts a running count on every chunk, then the final
    one on its own; others put the final one on the finish chunk. Each went out: six usage
    chunks to a client that adds them up. The last is the one."""
    running = [
        {"choices": [{"index": 0, "delta": {"content": w}}], "usage": usage(1, n)}
        for n, w in enumerate(["a", "b"], 1)
    ]
    finish = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}], "usage": usage(1, 2)}
    alone = {"choices": [], "usage": usage(1, 3)}
    events, _ = read_events([orjson.dumps(c).decode() for c in [*running, finish, alone]])
    assert [e for e in events if type(e) is Usage] == [Usage(1, 3, 4)]
    events, end = read_events([orjson.dumps(c).decode() for c in [*running, finish]] + ["[DONE]"])
    assert end is True and events[-2:] == [Delta(finish_reason="stop"), Usage(1, 2, 3)]
    assert [e for e in events if type(e) is Usage] == [Usage(1, 2, 3)]


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def test_chunk_events_order_within_a_chunk() -> None:
    chunk = {
        "choices": [
            {
                "index": 0,
                "delta": {
                    "reasoning": "think",
                    "content": "text",
                    "tool_calls": [{"index": 1, "id": "c", "function": {"name": "f"}}],
                },
                "finish_reason": "tool_calls",
            },
            {"index": 1, "delta": {"content": "another choice"}},
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3},
    }
    assert rules([chunk]) == [
        Reasoning("think"),
        Delta("text"),
        ToolCall(index=1, id="c", name="f", arguments=""),
        Delta(finish_reason="tool_calls"),
        Usage(1, 2, 3),
    ]
    refusal = {"choices": [{"delta": {"content": "", "refusal": "no"}}]}
    assert rules([refusal]) == [Delta(refusal="no")]


def test_done_ends_the_read_and_what_follows_is_not_read() -> None:
    content = '{"choices":[{"index":0,"delta":{"content":"hi"}}]}'
    events, end = read_events([content, "[DONE]", content])
    assert events == [Delta("hi")] and end is True


def test_events_before_an_error_are_kept_and_the_error_returned() -> None:
    content = '{"choices":[{"index":0,"delta":{"content":"hi"}}]}'
    events, end = read_events([content, '{"error":{"message":"boom","type":"x"}}', content])
    assert events == [Delta("hi")]
    assert isinstance(end, UpstreamServerError) and "boom" in str(end)
    events, end = read_events([content, "not json", content])
    assert events == [Delta("hi")]
    assert isinstance(end, UpstreamProtocolError) and end.code == "upstream_protocol_error"


def test_realistic_chunks_with_obfuscation_and_service_fields() -> None:
    """What OpenAI sends by default: ``obfuscation`` padding (1-16 random characters)
    and ``service_tier`` / ``system_fingerprint`` on every chunk."""
    body = b""
    for pad, text in (("aZ", "Hel"), ("q8Kd0LmPn2Xc4Vb9", "lo"), ("x", ' "w"')):
        chunk = {
            "id": "chatcmpl-1",
            "object": "chat.completion.chunk",
            "created": 1764000000,
            "model": "gpt-4.1",
            "service_tier": "default",
            "system_fingerprint": "fp_b3f1157249",
            "choices": [
                {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None}
            ],
            "usage": None,
            "obfuscation": pad,
        }
        body += b"data: " + orjson.dumps(chunk) + b"\n\n"
    decoder = ChunkDecoder("up")
    assert decoder.decode(body + b"data: [DONE]\n\n") == [Delta("Hel"), Delta("lo"), Delta(' "w"')]
    assert decoder.done and decoder.error is None


def _general(body: bytes) -> list[Any]:
    """The events of a whole body by the rules alone: SSE, then chunk_events()."""
    events: list[Any] = []
    tools = ToolCallPieces()
    for sse in SSEDecoder().decode(body):
        if sse.data.startswith("[DONE]"):
            break
        chunk_events(orjson.loads(sse.data), events, tools)
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
def test_decode_gives_the_events_of_the_rules_however_the_body_is_cut(
    data: st.DataObject, body: bytes
) -> None:
    cuts = data.draw(st.lists(st.integers(min_value=0, max_value=len(body)), max_size=10))
    bounds = [0, *sorted(cuts), len(body)]
    decoder = ChunkDecoder("up")
    events: list[Any] = []
    for a, b in itertools.pairwise(bounds):
        events += decoder.decode(body[a:b])
        assert decoder.error is None
        if decoder.done:
            break
    assert decoder.done
    assert events == _general(body)


def test_content_strings_with_escapes() -> None:
    def chunk(content: str) -> bytes:
        payload = {"id": "c", "choices": [{"index": 0, "delta": {"content": content}}]}
        return b"data: " + orjson.dumps(payload) + b"\n\n"

    body = chunk('say "hi"') + chunk("a\\b") + chunk("plain") + chunk("") + chunk("\u2028\t")
    events = ChunkDecoder("up").decode(body)
    assert events == [Delta('say "hi"'), Delta("a\\b"), Delta("plain"), Delta("\u2028\t")]


def test_a_long_chunk_in_many_reads_costs_linear_time() -> None:
    # A big content string (an image in base64) arriving in 1 KB reads: the pending line
    # is kept in pieces, not copied on every read. Eight times the size takes about eight
    # times as long; a copy per read would take 64.
    def chunk(content: str) -> bytes:
        payload = {"id": "c", "choices": [{"index": 0, "delta": {"content": content}}]}
        return b"data: " + orjson.dumps(payload) + b"\n\n"

    def feed_time(size: int) -> float:
        body = chunk("x" * size)
        best = float("inf")
        for _ in range(5):
            decoder = ChunkDecoder("up")
            decoder.decode(chunk("first"))
            start = time.perf_counter()
            events: list[Any] = []
            for i in range(0, len(body), 1024):
                events += decoder.decode(body[i : i + 1024])
            best = min(best, time.perf_counter() - start)
            assert events == [Delta("x" * size)]
        return best

    short, long = feed_time(128 * 1024), feed_time(1024 * 1024)
    assert long < 24 * short + 0.005, f"{long * 1000:.1f} ms vs {short * 1000:.1f} ms"


def test_an_event_of_several_data_lines_is_one_payload() -> None:
    # SSE joins the lines with LF; a line SSE ignores (an unknown field) is no event.
    decoder = ChunkDecoder("up")
    body = b'data: {"choices":[{"index":0,"delta":\ndata: {"content":"hi"}}]}\n\n'
    assert decoder.decode(body) == [Delta("hi")]
    assert decoder.decode(b'{"content":"evil"}}]}\n\n') == []
    assert decoder.error is None and not decoder.done


@pytest.mark.parametrize("obfuscation", [True, False])
def test_the_clients_stream_options_stay_home(obfuscation: bool) -> None:
    """``include_obfuscation`` shapes the client's stream; upstream, the provider's default
    padding stays (and a compatible server that refuses the field never sees it)."""
    request = ChatRequest.model_validate(
        {
            "model": "up/m",
            "messages": [{"role": "user", "content": "Hi"}],
            "stream": True,
            "stream_options": {"include_obfuscation": obfuscation, "include_cost": True},
        }
    )
    assert upstream_body(request, "m")["stream_options"] == {"include_usage": True}


# Any JSON value, to put where a chunk's field has another type.
_JUNK = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(2**63), max_value=2**63 - 1),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(max_size=3),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=2), st.dictionaries(st.text(max_size=2), inner, max_size=2)
    ),
    max_leaves=4,
)


def _either(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly a field's own type, sometimes any JSON."""
    return st.integers(min_value=0, max_value=7).flatmap(lambda n: strategy if n else _JUNK)


_ANY_CALL = _either(
    st.fixed_dictionaries(
        {"index": _either(st.integers(min_value=0, max_value=2))},
        optional={
            "id": _either(st.text(max_size=3)),
            "function": _either(
                st.fixed_dictionaries({}, optional={"name": _TEXT, "arguments": _either(_TEXT)})
            ),
        },
    )
)
_ANY_DELTA = _either(
    st.fixed_dictionaries(
        {"content": _either(st.text(max_size=3))},
        optional={
            **{
                key: _either(_TEXT) for key in ("role", "reasoning_content", "reasoning", "refusal")
            },
            "tool_calls": _either(st.one_of(st.none(), st.lists(_ANY_CALL, max_size=2))),
            "audio": _either(
                st.fixed_dictionaries(
                    {},
                    optional={
                        **{key: _either(_TEXT) for key in ("id", "data", "transcript")},
                        "expires_at": _either(st.integers(0, 2**40)),
                    },
                )
            ),
        },
    )
)
_ANY_CHOICE = _either(
    st.fixed_dictionaries(
        {"index": _either(st.sampled_from([0, 0, 1])), "delta": _ANY_DELTA},
        optional={
            "finish_reason": _either(st.sampled_from([None, "", "stop"])),
            "logprobs": _JUNK,
        },
    )
)
_ANY_CHUNK = _either(
    st.fixed_dictionaries(
        {
            "id": st.just("chatcmpl-1"),
            "choices": _either(st.one_of(st.none(), st.lists(_ANY_CHOICE, max_size=2))),
        },
        optional={
            "usage": _either(
                st.fixed_dictionaries(
                    {"total_tokens": st.integers(0, 9)},
                    optional={
                        "prompt_tokens": _either(st.integers(0, 9)),
                        "prompt_tokens_details": _either(
                            st.fixed_dictionaries(
                                {"cached_tokens": _either(st.integers(0, 9))},
                                optional={
                                    "audio_tokens": _either(st.integers(0, 9)),
                                    "text_tokens": _JUNK,
                                },
                            )
                        ),
                        "completion_tokens_details": _either(
                            st.fixed_dictionaries(
                                {},
                                optional={
                                    "audio_tokens": _JUNK,
                                    "accepted_prediction_tokens": _either(st.integers(0, 9)),
                                    "rejected_prediction_tokens": _JUNK,
                                },
                            )
                        ),
                    },
                )
            ),
            "error": _either(st.just({"message": "m", "type": "overloaded_error"})),
            "obfuscation": st.text(max_size=3),
        },
    )
)


def _by_the_rules(payload: bytes) -> tuple[Any, UpstreamError | None]:
    """What a payload gives by orjson and chunk_events() alone: the events (or the
    exception's type), and the in-stream error."""
    value = orjson.loads(payload)
    if type(value) is not dict:
        return [], None
    if value.get("error"):
        return [], in_stream_error("up", value["error"])
    events: list[Any] = []
    try:
        chunk_events(value, events, ToolCallPieces())
    except Malformed as exc:  # a field of another type: the stream ends there
        return events, malformed("up", exc)
    except Exception as exc:
        return type(exc), None
    return events, None


@settings(max_examples=1500, database=None, deadline=None)
@given(chunk=_ANY_CHUNK)
def test_typed_chunks_give_what_the_rules_give(chunk: Any) -> None:
    # The typed decoding (msgspec) is a fast path: any chunk, with any field of any type,
    # gives the events (or the exception) of orjson and chunk_events().
    payload = orjson.dumps(chunk)
    expected, error = _by_the_rules(payload)
    decoder = ChunkDecoder("up")
    try:  # (a usage beside choices waits for the end: one usage a stream)
        events: Any = decoder.decode(b"data: " + payload + b"\n\ndata: [DONE]\n\n")
    except Exception as exc:
        events = type(exc)
    assert events == expected
    assert type(decoder.error) is type(error) and str(decoder.error) == str(error)
    assert decoder.done is (error is None and isinstance(events, list))


def test_the_response_model_is_the_first_chunks() -> None:
    """What the upstream says answered (a dated snapshot of the model asked for), read
    once a stream; a stream that names none (or not as a string) has none."""
    decoder = ChunkDecoder("up")
    first = {"model": "gpt-4o-2024-08-06", "choices": [{"index": 0, "delta": {"content": "a"}}]}
    decoder.decode(b"data: " + orjson.dumps(first) + b"\n\n")
    assert decoder.response_model == "gpt-4o-2024-08-06"
    later = first | {"model": "another"}
    decoder.decode(b"data: " + orjson.dumps(later) + b"\n\n")
    assert decoder.response_model == "gpt-4o-2024-08-06"
    for named in ({}, {"model": 7}, {"model": ""}):
        decoder = ChunkDecoder("up")
        decoder.decode(b"data: " + orjson.dumps({**named, "choices": []}) + b"\n\n")
        assert decoder.response_model is None, named


def test_tool_call_pieces_come_out_as_openai_sends_them() -> None:
    """A call's first piece carries its id and name, the next ones only arguments, each
    call an index of its own: whatever shape the upstream gave them."""
    pieces = ToolCallPieces()
    given = [
        ToolCall(0, "call_A", "fa", ""),
        ToolCall(0, "", None, '{"x":'),  # an empty id: the same call
        ToolCall(0, "call_A", "fa", "1}"),  # its id and name again: the same call
        ToolCall(0, "call_B", "fb", '{"y":2}'),  # another id at index 0: another call
        ToolCall(1, "call_C", "fc", "{}"),  # the upstream's 1, taken: the next free
        ToolCall(0, None, None, ""),  # more of index 0's latest call
    ]
    assert [pieces(piece) for piece in given] == [
        ToolCall(0, "call_A", "fa", ""),
        ToolCall(0, None, None, '{"x":'),
        ToolCall(0, None, None, "1}"),
        ToolCall(1, "call_B", "fb", '{"y":2}'),
        ToolCall(2, "call_C", "fc", "{}"),
        ToolCall(1, None, None, ""),
    ]
    late = ToolCallPieces()  # an id sent after the first piece is the call's, once
    assert [late(p) for p in (ToolCall(0, None, "f", ""), ToolCall(0, "c", "f", "{}"))] == [
        ToolCall(0, None, "f", ""),
        ToolCall(0, "c", None, "{}"),
    ]


def test_compatible_servers_usage_is_read_in_openai_terms() -> None:
    """DeepSeek reports cache hits as prompt_cache_hit_tokens (a cache hit was charged at
    the full input price: 68% over); xAI leaves reasoning out of completion_tokens (its
    total counts it beside them: reasoning was never charged)."""
    deepseek = {
        "choices": [],
        "usage": {
            **usage(1000, 100),
            "completion_tokens_details": {"reasoning_tokens": 50},
            "prompt_cache_hit_tokens": 900,
            "prompt_cache_miss_tokens": 100,
        },
    }
    xai = {
        "choices": [],
        "usage": {
            "prompt_tokens": 1000,
            "completion_tokens": 100,
            "total_tokens": 1500,
            "completion_tokens_details": {"reasoning_tokens": 400},
        },
    }
    (ds,), _ = read_events([orjson.dumps(deepseek).decode()])
    assert (ds.cached_tokens, ds.completion_tokens, ds.reasoning_tokens) == (900, 100, 50)
    (x,), _ = read_events([orjson.dumps(xai).decode()])
    assert (x.completion_tokens, x.reasoning_tokens, x.total_tokens) == (500, 400, 1500)
    # OpenAI's own: completion already holds the reasoning (total = prompt + completion).
    openai = {"choices": [], "usage": {**usage(1000, 500), "completion_tokens_details": {}}}
    openai["usage"]["completion_tokens_details"] = {"reasoning_tokens": 400}
    (o,), _ = read_events([orjson.dumps(openai).decode()])
    assert (o.completion_tokens, o.reasoning_tokens) == (500, 400)


@pytest.mark.parametrize(
    ("error", "status", "code"),
    [
        (
            {"type": "BadRequestError", "message": "too long", "code": 400},
            400,
            "upstream_invalid_request",
        ),
        ({"message": "slow down", "code": 429}, 429, "upstream_rate_limited"),
        (
            {"type": "exceed_context_size_error", "code": 400, "message": "x"},
            400,
            "upstream_invalid_request",
        ),
        ({"message": "boom", "code": 503}, 502, "upstream_error"),
    ],
)
def test_an_error_chunk_s_numeric_code_is_its_status(
    error: dict[str, Any], status: int, code: str
) -> None:
    """vLLM, OpenRouter and llama.cpp put the HTTP status in error.code: a context-length
    400 became a retryable 502, which SDKs retried and aliases fell back on."""
    decoder = ChunkDecoder("up")
    decoder.decode(b"data: " + orjson.dumps({"error": error}) + b"\n\n")
    assert decoder.error is not None
    assert (decoder.error.status, decoder.error.code) == (status, code)


def test_perplexity_s_sources_are_citations_once_each() -> None:
    """Perplexity sends its sources beside the answer, the whole list on every chunk (as
    ``citations``, URLs, or ``search_results``): they were dropped, and the answer's [1]
    pointed nowhere."""
    from nexus.events import Citation

    def chunk(text: str, **sources: Any) -> str:
        body = {"choices": [{"index": 0, "delta": {"content": text}}], **sources}
        return orjson.dumps(body).decode()

    events, _ = read_events(
        [
            chunk("A [1]", citations=["https://a.example"]),
            chunk(" B [2]", citations=["https://a.example", "https://b.example"]),
        ]
    )
    assert [e for e in events if type(e) is Citation] == [
        Citation("https://a.example"),
        Citation("https://b.example"),
    ]
    found = [{"title": "A", "url": "https://a.example", "date": None}]
    events, _ = read_events(
        [chunk("A [1]", search_results=found), chunk(".", search_results=found)]
    )
    assert [e for e in events if type(e) is Citation] == [Citation("https://a.example", "A")]
