"""Property-based fuzzing: never a 500, never a hang, always a clear error.

The sans-I/O layers first, with many examples: request validation of the three endpoints
(arbitrary bytes, arbitrary JSON, and objects built from the endpoints' own keys with wrong
values), format negotiation (bounded time per call), the SSE decoder (any split decodes like
the whole; ``frame()`` round-trips) and the realtime envelopes. Then the running app, with
fewer examples: arbitrary bodies, formats and headers on every completion endpoint,
``GET /v1/streams/<anything>`` and arbitrary WebSocket frames, each request bounded in time.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import re
import time
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any
from urllib.parse import quote

import orjson
import pytest
from aiohttp import WSMsgType
from aiohttp.test_utils import TestClient
from hypothesis import HealthCheck, example, given, settings
from hypothesis import event as record_event
from hypothesis import strategies as st
from pydantic import BaseModel

import nexus.request
from nexus.encoders.registry import EncoderRegistry, default_registry
from nexus.errors import InvalidRequest, UnsupportedStreamFormat
from nexus.protocol import anthropic_messages, openai_responses, realtime
from nexus.protocol.anthropic_messages import MessagesRequest, parse_messages_request
from nexus.protocol.negotiation import select_format
from nexus.protocol.openai_chat import parse_chat_request
from nexus.protocol.openai_responses import ResponsesRequest, parse_responses_request
from nexus.protocol.realtime import AbortTurn, RealtimeSession, Send, StartTurn
from nexus.protocol.sse import ServerSentEvent, SSEDecoder, frame
from nexus.request import ChatRequest
from support import MakeClient

# NEXUS_FUZZ_SCALE=50 pytest tests/protocol/test_fuzz.py: fifty times the examples, for a long hunt.
SCALE = int(os.environ.get("NEXUS_FUZZ_SCALE", "1"))
SANS_IO = settings(max_examples=300 * SCALE, deadline=None)
HTTP = settings(
    max_examples=50 * SCALE,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
REQUEST_TIMEOUT_S = 10.0


# --- strategies --------------------------------------------------------------------------


def field_names(*modules: ModuleType) -> set[str]:
    """Every field name (by its wire alias) of the pydantic models in ``modules``."""
    names = set()
    for module in modules:
        for obj in vars(module).values():
            if isinstance(obj, type) and issubclass(obj, BaseModel):
                names |= {f.alias or name for name, f in obj.model_fields.items()}
    return names


# Every field name the request schemas (and their parts) know, so that generated objects
# reach past the first "unknown/missing field" into the nested validators.
KEYS = sorted(
    field_names(nexus.request, anthropic_messages, openai_responses, realtime)
    | {"previous_response_id", "conversation", "cache_control", "signature", "budget_tokens"}
)
WORDS = [
    *("mock/echo", "mock/other", "nope/echo", "user", "assistant", "system", "developer", "tool"),
    *("text", "image_url", "input_audio", "file", "refusal", "function", "auto", "none"),
    *("required", "any", "json_object", "json_schema", "image", "base64", "url", "tool_use"),
    *("tool_result", "thinking", "redacted_thinking", "message", "function_call", "input_text"),
    *("function_call_output", "output_text", "input_image", "input_file", "reasoning", "low"),
    *("high", "original", "image/png", "pcm16", "wav", "mp3", "AAAA", "QUJD", "", " "),
    *("http://example.com/a.png", "data:image/png;base64,AAAA", "{}", '{"a": 1}'),
]

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.sampled_from([0, 1, -1, 2, 5, 10**9, 2**64])
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from(WORDS)
    | st.text(max_size=12)
)
json_values = st.recursive(
    scalars,
    lambda kids: (
        st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4)
    ),
    max_leaves=20,
)
plausible = st.recursive(
    scalars,
    lambda kids: (
        st.lists(kids, max_size=4) | st.dictionaries(st.sampled_from(KEYS), kids, max_size=6)
    ),
    max_leaves=30,
)

MESSAGES = [{"role": "user", "content": "hello fuzz"}]
VALID = {
    "chat": {
        "model": "mock/echo",
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hello fuzz"}]},
        ],
        "stream": True,
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
        "tool_choice": "auto",
        "max_tokens": 20,
        "stop": ["zzz"],
        "stream_options": {"include_usage": True},
        "mock": {"content": "one two three"},
    },
    "messages": {
        "model": "mock/echo",
        "max_tokens": 20,
        "system": "be brief",
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hello"}]},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}],
            },
        ],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "auto"},
        "stop_sequences": ["zzz"],
        "stream": True,
        "mock": {"content": "one two three"},
    },
    "responses": {
        "model": "mock/echo",
        "instructions": "be brief",
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "hello"}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "ok"},
        ],
        "tools": [{"type": "function", "name": "f", "parameters": {}}],
        "tool_choice": "auto",
        "max_output_tokens": 20,
        "text": {"format": {"type": "text"}},
        "stream": True,
        "mock": {"content": "one two three"},
    },
}


def _containers(node: Any) -> list[Any]:
    """Every dict and list inside ``node`` (itself included), depth first."""
    found = [node] if isinstance(node, dict | list) else []
    children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
    for child in children:
        found.extend(_containers(child))
    return found


@st.composite
def mutated(
    draw: st.DrawFn,
    base: dict[str, Any],
    values: st.SearchStrategy[Any],
    keys: Sequence[str] = KEYS,
) -> Any:
    """A deep copy of ``base`` with one to four keys (from ``keys``) or items replaced,
    added or removed."""
    body = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, 4))):
        containers = _containers(body)
        target = containers[draw(st.integers(0, len(containers) - 1))]
        action = draw(st.sampled_from(["set", "set", "delete"]))
        if isinstance(target, dict):
            key = draw(st.sampled_from(sorted(target) or keys) | st.sampled_from(keys))
            if action == "delete":
                target.pop(key, None)
            else:
                target[key] = copy.deepcopy(draw(values))
        elif target:
            index = draw(st.integers(0, len(target) - 1))
            if action == "delete":
                del target[index]
            else:
                target[index] = copy.deepcopy(draw(values))
        else:
            target.append(copy.deepcopy(draw(values)))
    return body


def request_objects(kind: str, values: st.SearchStrategy[Any] = plausible) -> Any:
    """JSON values a client of endpoint ``kind`` might send, most of them wrong somewhere."""
    return (
        json_values
        | st.dictionaries(st.sampled_from(KEYS), values, max_size=8)
        | mutated(VALID[kind], values)
        | mutated(VALID[kind], values).map(lambda b: {**b, "stream": False})
    )


def dumps(value: Any) -> bytes:
    """JSON bytes; the stdlib takes the integers past 64 bits that orjson refuses."""
    return json.dumps(value).encode()


# --- request validation, sans-I/O ---------------------------------------------------------

PARSERS: dict[str, Callable[[bytes], ChatRequest]] = {
    "chat": parse_chat_request,
    "messages": parse_messages_request,
    "responses": parse_responses_request,
}
# The fields a ``param`` may name: the endpoint's own request fields (present or missing).
FIELDS = {
    "chat": set(ChatRequest.model_fields),
    "messages": set(MessagesRequest.model_fields),
    "responses": set(ResponsesRequest.model_fields) | {"previous_response_id", "conversation"},
}


def param_root(param: str) -> str:
    return re.split(r"[.\[]", param, maxsplit=1)[0]


def check_parse(kind: str, body: bytes) -> None:
    """The contract: a ChatRequest, or InvalidRequest (400, a message, param for a field)."""
    try:
        request = PARSERS[kind](body)
    except InvalidRequest as error:
        assert type(error) is InvalidRequest
        assert error.status == 400
        assert isinstance(error.message, str) and error.message.strip()
        assert str(error) == error.message
        try:
            data = orjson.loads(body)
        except orjson.JSONDecodeError:
            data = None
        if not isinstance(data, dict):
            assert error.code == "invalid_json"
            assert error.param is None
            return
        assert error.code == "invalid_request", error.message
        assert error.param, f"no param for a field error: {error.message!r} on {data!r}"
        assert error.message.startswith(error.param + ": "), (error.param, error.message)
        root = param_root(error.param)
        assert root in FIELDS[kind] or root in data, (error.param, data)
    else:
        assert isinstance(request, ChatRequest)
        assert request.messages
        assert request.model


@pytest.mark.parametrize("kind", sorted(PARSERS))
@SANS_IO
@given(body=st.binary(max_size=300))
@example(body=b"")
@example(body=b"\xef\xbb\xbf{}")
@example(body=b"[" * 5000)
@example(body=b'{"model": 1e999}')
@example(body=b'{"model": "m", "messages": [' + b"[" * 2000 + b"]" * 2000 + b"]}")
def test_parsers_take_arbitrary_bytes(kind: str, body: bytes) -> None:
    check_parse(kind, body)


@pytest.mark.parametrize("kind", sorted(PARSERS))
@SANS_IO
@given(data=json_values)
@example(data=2**200)
@example(data={"model": 2**200, "messages": MESSAGES})
@example(data={"model": "m", "messages": MESSAGES, "max_tokens": 2**70})
@example(data={"model": "m", "messages": MESSAGES, "temperature": float("nan")})
def test_parsers_take_arbitrary_json(kind: str, data: Any) -> None:
    check_parse(kind, dumps(data))


@pytest.mark.parametrize("kind", sorted(PARSERS))
@settings(max_examples=600 * SCALE, deadline=None)
@given(st.data())
def test_parsers_take_plausible_objects_with_wrong_values(kind: str, data: st.DataObject) -> None:
    check_parse(kind, dumps(data.draw(request_objects(kind))))


@pytest.mark.parametrize("kind", sorted(PARSERS))
def test_the_valid_bases_are_valid(kind: str) -> None:
    """The mutation bases above parse, so that mutations explore near valid requests."""
    assert isinstance(PARSERS[kind](dumps(VALID[kind])), ChatRequest)


@pytest.mark.parametrize(
    "tool_choice",
    [{"type": "function", "function": {"name": "missing"}}, "required"],
    ids=["names-no-tool", "required-without-tools"],
)
def test_tool_choice_errors_name_tool_choice(tool_choice: Any) -> None:
    body = {"model": "mock/echo", "messages": MESSAGES, "tool_choice": tool_choice}
    with pytest.raises(InvalidRequest) as info:
        parse_chat_request(orjson.dumps(body))
    assert info.value.param == "tool_choice"
    assert info.value.message.startswith("tool_choice: ")


def test_messages_empty_stop_sequence_names_stop_sequences() -> None:
    body = {"model": "mock/echo", "max_tokens": 5, "messages": MESSAGES, "stop_sequences": [""]}
    with pytest.raises(InvalidRequest) as info:
        parse_messages_request(orjson.dumps(body))
    assert info.value.param == "stop_sequences[0]" or info.value.param == "stop_sequences"


# --- negotiation --------------------------------------------------------------------------

REGISTRY: EncoderRegistry = default_registry.copy()
MEDIA_TYPES = list(REGISTRY.media_types())
NAMES = [*MEDIA_TYPES, *(a for m in MEDIA_TYPES for a in REGISTRY.aliases_of(m))]

SHORT_TEXT = st.text(max_size=6)
MEDIA_WORDS = ["text", "application", "*", "TEXT", "image", "event-stream", "x-ndjson", "json", ""]
Q_WORDS = ["0", "1", "0.5", "1.0", "-1", "2", "nan", "inf", "-inf", "1e400", "", "x"]


@st.composite
def accept_ranges(draw: st.DrawFn, text: st.SearchStrategy[str]) -> str:
    part = st.sampled_from(MEDIA_WORDS + [m.partition("/")[2] for m in MEDIA_TYPES]) | text
    media = draw(st.sampled_from(MEDIA_TYPES) | st.builds("{}/{}".format, part, part))
    q = st.floats().map(repr) | st.sampled_from(Q_WORDS) | text
    keys = st.sampled_from(["q", "Q", " q ", "level", "charset", ""])
    params = draw(st.lists(st.tuples(keys, q), max_size=3))
    separator = draw(st.sampled_from([";", " ; ", ";\t"]))
    return media + "".join(f"{separator}{key}={value}" for key, value in params)


@st.composite
def accept_headers(
    draw: st.DrawFn, text: st.SearchStrategy[str] = SHORT_TEXT, repeat: int = 1000
) -> str:
    """An Accept header: ranges with q-values and junk, repeated up to ``repeat`` times."""
    ranges = draw(st.lists(accept_ranges(text) | text, max_size=30))
    header = draw(st.sampled_from([",", ", ", " ,\t"])).join(ranges)
    return header * draw(st.sampled_from([1, 1, 2, 50, repeat]))


names = st.none() | st.sampled_from(NAMES) | st.sampled_from(NAMES).map(str.upper) | st.text()


@settings(
    max_examples=500 * SCALE, deadline=1000
)  # ms: linear, not quadratic; loose for a shared machine
@given(
    query=names,
    header=names,
    accept=st.none() | accept_headers() | st.text(),
    default=st.sampled_from(MEDIA_TYPES),
)
# 20,000 ranges, some 200 KB: 25 times what aiohttp accepts as a whole header section.
@example(query=None, header=None, accept="*/*;q=0.5," * 20_000, default=MEDIA_TYPES[0])
@example(
    query=None,
    header=None,
    accept=",".join(f"{m};q=0.{i % 10}" for i in range(10_000) for m in MEDIA_TYPES[:2]),
    default=MEDIA_TYPES[-1],
)
@example(query="\x00\u202e\ud800", header=" sse ", accept="\r\n", default=MEDIA_TYPES[0])
def test_negotiation_picks_a_registered_format_or_refuses_fast(
    query: str | None, header: str | None, accept: str | None, default: str
) -> None:
    explicit = query if query is not None else header
    try:
        chosen = select_format(query, header, accept, default, REGISTRY)
    except UnsupportedStreamFormat as error:
        assert explicit is not None and REGISTRY.resolve(explicit) is None
        assert error.status == 400 and error.code == "unsupported_stream_format"
        assert error.param == ("stream_format" if query is not None else "X-Nexus-Stream-Format")
        assert error.message.strip()
        return
    assert chosen in MEDIA_TYPES
    if explicit is not None:
        assert chosen == REGISTRY.resolve(explicit)
    elif not accept:
        assert chosen == default


# --- the SSE decoder ----------------------------------------------------------------------

SSE_PIECES = [
    *[b"data:", b"data: ", b"event:", b"event: ", b"id:", b"id: ", b"retry:", b"retry: "],
    *[b":", b": ping", b" ", b"\r", b"\n", b"\r\n", b"\n\n", b"\r\r", b"x", b"42", b"\x00"],
    *["é".encode(), "€".encode(), "😀".encode(), b"\xef\xbb\xbf", b"\xff", b"\xc3", b"\xf0\x9f"],
]
sse_bytes = st.lists(st.sampled_from(SSE_PIECES) | st.binary(max_size=6), max_size=60).map(
    b"".join
) | st.binary(max_size=200)


def decode(chunks: list[bytes]) -> tuple[list[ServerSentEvent], str]:
    decoder = SSEDecoder()
    events = []
    for chunk in chunks:
        events.extend(decoder.decode(chunk))
    events.extend(decoder.flush())
    return events, decoder.last_event_id


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(c, len(data)) for c in cuts})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]


@SANS_IO
@given(data=sse_bytes, cuts=st.lists(st.integers(0, 200), max_size=12))
@example(data=b"data: a\r\n\r\n", cuts=[8, 9, 10])
@example(data=b"data: \xc3\xa9\r\r", cuts=[7, 9])
@example(data=b"\xef\xbb\xbfdata: x\n\n", cuts=[1, 2])
def test_sse_decoder_gives_the_same_events_however_the_bytes_are_split(
    data: bytes, cuts: list[int]
) -> None:
    whole = decode([data])
    assert decode(split(data, cuts)) == whole
    assert decode([data[i : i + 1] for i in range(len(data))]) == whole
    for event in whole[0]:
        assert isinstance(event, ServerSentEvent) and event.event


def decode_time(data: bytes, chunk: int) -> float:
    """Seconds to decode ``data`` fed in ``chunk``-byte pieces (the best of five: noise on a
    shared machine only ever adds time)."""
    best = float("inf")
    for _ in range(5):
        decoder = SSEDecoder()
        start = time.perf_counter()
        for i in range(0, len(data), chunk):
            decoder.decode(data[i : i + chunk])
        best = min(best, time.perf_counter() - start)
    return best


def test_sse_decoder_is_linear_in_a_long_line_split_over_chunks() -> None:
    # A big tool call, an image in base64: one line in 1 KB reads. Eight times the line
    # is eight times the reads; a decoder that rescanned its pending line on each read
    # would take 64 times as long, a linear one about 8 (a ratio, not a time: the
    # machine's speed cancels out).
    def line(size: int) -> bytes:
        return b"data: " + b"x" * size + b"\n\n"

    short = decode_time(line(128 * 1024), 1024)
    long = decode_time(line(1024 * 1024), 1024)
    assert long < 24 * short + 0.005, f"{long * 1000:.1f} ms vs {short * 1000:.1f} ms"


field_text = st.text(max_size=20) | st.sampled_from(["", " ", " lead", "a\rb", "a\nb", "a\0b"])


@SANS_IO
@given(
    frames=st.lists(
        st.tuples(
            st.text(max_size=40) | st.sampled_from(["", "a\r\nb", "\n", "\r\r\n", " x", ":"]),
            st.none() | field_text,
            st.none() | field_text,
            st.none() | st.integers(-5, 10**12),
        ),
        min_size=1,
        max_size=5,
    ),
    cuts=st.lists(st.integers(0, 400), max_size=8),
)
def test_sse_frames_round_trip_through_the_decoder(
    frames: list[tuple[str, str | None, str | None, int | None]], cuts: list[int]
) -> None:
    wire = b""
    expected = []
    last_id = ""
    for data, event, event_id, retry in frames:
        illegal = (
            any(v is not None and ("\r" in v or "\n" in v) for v in (event, event_id))
            or (event_id is not None and "\0" in event_id)
            or (retry is not None and retry < 0)
        )
        try:
            out = frame(data, event=event, id=event_id, retry=retry)
        except ValueError:
            assert illegal
            continue
        assert not illegal
        last_id = event_id if event_id is not None else last_id
        wire += out
        expected.append(
            ServerSentEvent(
                data=re.sub(r"\r\n|\r", "\n", data),
                event=event or "message",
                id=last_id,
                retry=retry,
            )
        )
    assert decode(split(wire, cuts)) == (expected, last_id)


# --- realtime envelopes, sans-I/O ---------------------------------------------------------

MAX_PENDING = 64
ERROR_CODES = {
    "invalid_envelope",
    "invalid_request",
    "nothing_to_abort",
    "stream_in_progress",
    "input_too_large",
}
b64_values = st.sampled_from(["", "AAAA", "AA==", "A", "!!!!", "QUJD", "A" * 120]) | st.text(
    max_size=10
)
envelope_values: dict[str, st.SearchStrategy[Any]] = {
    "type": st.sampled_from(["start", "abort", "audio_chunk", "image", "", "START"]) | scalars,
    "request": mutated(VALID["chat"], plausible) | st.just(VALID["chat"]) | plausible,
    "format": st.sampled_from(["pcm16", "wav", "mp3", "ogg"]) | scalars,
    "b64": b64_values | scalars,
    "sample_rate": st.sampled_from([24000, 0, -1, 384_001, 8000]) | scalars,
    "mime_type": st.sampled_from(["image/png", "image/", "text/plain", "image/svg+xml"]) | scalars,
    "url": st.sampled_from(
        [
            "https://example.com/cat.png",
            "data:image/png;base64,AAAA",
            "data:image/png;base64,!!",
            "data:image/png,abc",
            "data:x",
            "ftp://x",
            "data:image/png;base64," + "A" * 200,
        ]
    )
    | scalars,
}
envelopes = st.sets(st.sampled_from(sorted(envelope_values)), max_size=4).flatmap(
    lambda keys: (
        st.fixed_dictionaries(
            {"type": envelope_values["type"]},
            optional={k: envelope_values[k] for k in sorted(keys) if k != "type"},
        )
        | st.fixed_dictionaries({k: envelope_values[k] for k in sorted(keys)})
    )
)
ENVELOPES: list[dict[str, Any]] = [
    {"type": "start", "request": VALID["chat"]},
    {"type": "start", "request": {"model": "mock/echo", "messages": MESSAGES}},
    {"type": "abort"},
    {"type": "audio_chunk", "format": "pcm16", "b64": "AAAA", "sample_rate": 24000},
    {"type": "image", "mime_type": "image/png", "b64": "AAAA"},
    {"type": "image", "mime_type": "image/png", "url": "data:image/png;base64,AAAA"},
]
near_envelopes = st.sampled_from(ENVELOPES) | st.sampled_from(ENVELOPES).flatmap(
    lambda e: mutated(e, st.sampled_from(list(envelope_values.values())).flatmap(lambda v: v))
)
frames_in = (
    near_envelopes.map(lambda e: json.dumps(e))
    | near_envelopes.map(lambda e: json.dumps(e))
    | envelopes.map(lambda e: json.dumps(e))
    | st.sampled_from(['{"type":"abort"}', "null", "[]", "{", '"x"', "", "\ud800"])
    | st.text(max_size=40)
)


def check_actions(session: RealtimeSession, was_streaming: bool, actions: list[Any]) -> None:
    assert isinstance(actions, list)
    for action in actions:
        assert isinstance(action, Send | StartTurn | AbortTurn), action
        if isinstance(action, Send):
            body = orjson.loads(action.frame)
            assert body["type"] == "error"
            error = body["error"]
            assert error["code"] in ERROR_CODES, error
            assert isinstance(error["message"], str) and error["message"].strip()
            if error["code"] == "invalid_request":
                assert str(error.get("param")).startswith("request"), error
        elif isinstance(action, StartTurn):
            assert not was_streaming and session.streaming
            assert action.request.stream
        else:
            assert was_streaming
    assert session.pending_bytes <= MAX_PENDING


@SANS_IO
@given(st.data())
def test_realtime_session_answers_every_frame(data: st.DataObject) -> None:
    session = RealtimeSession(max_pending_input_bytes=MAX_PENDING)
    for _ in range(data.draw(st.integers(1, 8))):
        was_streaming = session.streaming
        if data.draw(st.integers(0, 9)) == 0:
            payload = data.draw(st.binary(max_size=40))
            actions = session.receive_binary(payload)
            assert len(actions) == 1 and isinstance(actions[0], Send)
        else:
            text = data.draw(frames_in)
            actions = session.receive_text(text)
            record_event(", ".join(type(a).__name__ for a in actions) or "held")
            if not actions:  # held input
                assert orjson.loads(text)["type"] in ("audio_chunk", "image")
        check_actions(session, was_streaming, actions)
        if any(isinstance(a, StartTurn) for a in actions):
            # The route tells the session what the engine did, and later that the turn ended.
            if data.draw(st.booleans()):
                session.start_accepted()
                assert session.pending_bytes == 0
            else:
                session.start_refused()
        if session.streaming and data.draw(st.booleans()):
            session.turn_ended()


# --- over HTTP ----------------------------------------------------------------------------

ENDPOINTS = {
    "/v1/chat/completions": "chat",
    "/v1/messages": "messages",
    "/v1/responses": "responses",
}
# Header values must be valid: printable ASCII, no CR/LF.
header_values = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40)
# Under aiohttp's 8190-byte limit for a header line (past it the HTTP parser answers, not us).
accept_values = (
    st.none()
    | header_values
    | accept_headers(header_values.map(str.strip), repeat=2).filter(lambda h: len(h) < 6000)
)
format_names = st.none() | st.sampled_from(NAMES) | st.text(max_size=20)


def sometimes(values: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """``values`` one time in four, else None (so that most requests get past the headers)."""
    return st.sampled_from([None, None, None, "draw"]).flatmap(
        lambda pick: values if pick else st.none()
    )


def valid_body(kind: str, text: str, stream: bool, include_usage: bool) -> dict[str, Any]:
    """A request of endpoint ``kind`` that the mock echoes: ``text`` goes to every format."""
    if kind == "chat":
        return {
            "model": "mock/echo",
            "messages": [{"role": "user", "content": text}],
            "stream": stream,
            "stream_options": {"include_usage": include_usage},
        }
    if kind == "messages":
        return {
            "model": "mock/echo",
            "max_tokens": 50,
            "messages": [{"role": "user", "content": text}],
            "stream": stream,
        }
    return {"model": "mock/echo", "input": text, "stream": stream}


# No mock scripting that would slow a stream down or fail it on purpose (a 502 by design).
SAFE_KEYS = [k for k in KEYS if k not in ("delay_ms", "fail_after")]
http_values = st.recursive(
    scalars,
    lambda kids: (
        st.lists(kids, max_size=3) | st.dictionaries(st.sampled_from(SAFE_KEYS), kids, max_size=4)
    ),
    max_leaves=15,
)


def http_bodies(kind: str) -> st.SearchStrategy[bytes]:
    valid = st.builds(valid_body, st.just(kind), st.text(max_size=80), st.booleans(), st.booleans())
    return (
        valid.map(dumps)
        | valid.map(dumps)
        | st.binary(max_size=100)
        | json_values.map(dumps)
        | st.just(VALID[kind]).map(dumps)
        | st.dictionaries(st.sampled_from(SAFE_KEYS), http_values, max_size=6).map(dumps)
        | mutated(VALID[kind], http_values, SAFE_KEYS).map(dumps)
    )


def last_event_ids(ids: list[str]) -> st.SearchStrategy[str | None]:
    return (
        st.none()
        | header_values
        | st.sampled_from(["0", "3", " ", "chatcmpl-" + "0" * 32 + ".1", "x.y.z", "1" * 13])
        | st.sampled_from(ids or ["none"]).map(lambda i: f"{i}.2")
    )


def check_error_body(path: str, body: Any) -> None:
    assert isinstance(body, dict)
    if path == "/v1/messages":
        assert body["type"] == "error", body
        assert body["error"]["type"] and body["error"]["message"].strip(), body
    else:
        error = body["error"]
        assert error["code"] and error["type"] and error["message"].strip(), body


async def check_response(path: str, resp: Any) -> None:
    """< 500; a JSON error, or (valid input) a JSON answer, a 202, or a complete stream."""
    assert resp.status < 500, (resp.status, await resp.text())
    content_type = resp.headers.get("Content-Type", "")
    record_event(f"status {resp.status} {content_type.partition(';')[0]}")
    if resp.status >= 400:
        assert content_type.startswith("application/json"), content_type
        check_error_body(path, orjson.loads(await resp.read()))
        return
    if resp.status == 204:
        assert not await resp.read()
        return
    body = await resp.read()
    if content_type.startswith("application/json"):
        assert isinstance(orjson.loads(body), dict)
    else:  # a stream that ran to its end
        assert resp.status == 200 and body, (resp.status, body)
        media_type = resp.headers["X-Nexus-Stream-Format"]
        assert media_type in MEDIA_TYPES
        assert terminated(media_type, body), body[-300:]


def terminated(media_type: str, body: bytes) -> bool:
    """Whether ``body`` ends with its format's terminator (docs/http-api.md, the formats)."""
    if media_type == "application/x-ndjson":
        return bool(orjson.loads(body.splitlines()[-1]) == {"type": "done"})
    events, _ = decode([body])
    last = events[-1]
    return {
        "text/event-stream": last.data == "[DONE]",
        "application/vnd.nexus.events+sse": last.event == "done",
        "application/vnd.nexus.anthropic-messages+sse": last.event == "message_stop",
        "application/vnd.nexus.openai-responses+sse": last.event
        in ("response.completed", "response.incomplete"),
    }.get(media_type, True)


async def bounded(coro: Any) -> Any:
    """Never a hang: each request (and reading its body) has a deadline."""
    return await asyncio.wait_for(coro, REQUEST_TIMEOUT_S)


@pytest.fixture
async def gateway(make_client: MakeClient) -> TestClient[Any, Any]:
    """One app for all the examples of a test; a stream ends with its client."""
    return await make_client({"streams": {"detach_timeout_s": 0}})


@pytest.fixture
async def resumable(make_client: MakeClient) -> TestClient[Any, Any]:
    """One app for all the examples of a test; background streams run to their end."""
    return await make_client({"streams": {"detach_timeout_s": 5}})


@HTTP
@given(st.data())
async def test_http_completion_endpoints_never_answer_5xx(
    gateway: TestClient[Any, Any], data: st.DataObject
) -> None:
    path = data.draw(st.sampled_from(sorted(ENDPOINTS)))
    body = data.draw(http_bodies(ENDPOINTS[path]))
    params = {}
    stream_format = data.draw(sometimes(format_names), label="stream_format")
    if stream_format is not None:
        params["stream_format"] = stream_format
    headers = {}
    for name, values in (
        ("Accept", accept_values),
        ("X-Nexus-Stream-Format", sometimes(st.sampled_from(NAMES) | header_values)),
        ("Last-Event-ID", sometimes(last_event_ids([]))),
        ("Content-Type", st.none() | st.sampled_from(["application/json", "text/plain"])),
    ):
        value = data.draw(values, label=name)
        if value is not None:
            headers[name] = value

    async def call() -> None:
        async with gateway.post(path, data=body, params=params, headers=headers) as resp:
            await check_response(path, resp)

    await bounded(call())


@HTTP
@given(st.data())
async def test_get_streams_with_arbitrary_ids_never_answers_5xx(
    resumable: TestClient[Any, Any], data: st.DataObject
) -> None:
    gateway = resumable
    ids = [
        # (not streamed: a Responses request that streams in the background streams at once)
        (
            await (
                await gateway.post(p, json={**VALID[k], "background": True, "stream": False})
            ).json()
        )["id"]
        for p, k in ENDPOINTS.items()
    ]
    segment = data.draw(
        st.text(max_size=60)
        | st.sampled_from(ids)
        | st.sampled_from(["..", ".", "%", "chatcmpl-", "chatcmpl-" + "f" * 32, "a/b", "x" * 3000])
        | st.builds("{}{}".format, st.sampled_from(ids), st.text(max_size=3))
    )
    params = {}
    for name, values in (("stream_format", format_names), ("last_event_id", last_event_ids(ids))):
        value = data.draw(values, label=name)
        if value is not None:
            params[name] = value
    headers = {}
    for name, values in (("Accept", accept_values), ("Last-Event-ID", last_event_ids(ids))):
        value = data.draw(values, label=name)
        if value is not None:
            headers[name] = value
    method = data.draw(st.sampled_from(["GET", "GET", "GET", "DELETE"]))

    async def call() -> None:
        url = "/v1/streams/" + quote(segment, safe="")
        async with gateway.request(method, url, params=params, headers=headers) as resp:
            assert resp.status in (200, 204, 400, 404, 409, 414, 431), resp.status
            await check_response("/v1/streams", resp)

    await bounded(call())


WS_CODES = ERROR_CODES | {"model_not_found", "unsupported_input"}


def encodable(text: str) -> bool:
    """A text frame must be UTF-8: no lone surrogates."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


@HTTP
@given(
    frames=st.lists(
        # No mock script that fails the turn on purpose (close 1011 by design) or slows it.
        frames_in.filter(lambda f: encodable(f) and "fail_after" not in f and "delay_ms" not in f)
        | st.binary(max_size=20),
        max_size=8,
    )
)
async def test_realtime_socket_answers_arbitrary_frames_and_stays_open(
    gateway: TestClient[Any, Any], frames: list[str | bytes]
) -> None:
    """Every frame gets its answer on an open socket; a final abort is answered too."""

    async def session() -> None:
        async with gateway.ws_connect("/v1/realtime") as ws:
            for payload in frames:
                if isinstance(payload, bytes):
                    await ws.send_bytes(payload)
                else:
                    await ws.send_str(payload)
            await ws.send_str('{"type":"abort"}')
            while True:
                message = await ws.receive()
                assert message.type is WSMsgType.TEXT, message
                event = orjson.loads(message.data)
                assert isinstance(event, dict) and event.get("type"), event
                if event["type"] == "error":
                    assert event["error"]["code"] in WS_CODES, event
                    assert event["error"]["message"].strip()
                    if event["error"]["code"] == "nothing_to_abort":
                        break
                elif event == {"type": "done", "aborted": True}:
                    break

    await bounded(session())


async def test_get_of_a_stream_detached_before_its_first_event_is_not_a_5xx(
    make_client: MakeClient,
) -> None:
    client = await make_client({"streams": {"detach_timeout_s": 0}})
    resp = await client.post("/v1/chat/completions", json={**VALID["chat"], "background": True})
    assert resp.status == 202
    stream_id = (await resp.json())["id"]
    resp = await client.get(f"/v1/streams/{stream_id}")
    assert resp.status < 500, (resp.status, await resp.text())
