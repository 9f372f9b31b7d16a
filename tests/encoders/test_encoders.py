"""The three built-in encoders, frame by frame, and their output read back by real decoders."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from openai._streaming import SSEDecoder as OpenAISSEDecoder

from nexus.encoders import Encoder, NativeSSEEncoder, NDJSONEncoder, OpenAISSEEncoder
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
)
from nexus.protocol.sse import SSEDecoder
from nexus.types import StreamMeta


def make_meta(include_usage: bool = False, retry_ms: int | None = None) -> StreamMeta:
    return StreamMeta(
        id="chatcmpl-1",
        model="mock/echo",
        created=1700000000,
        include_usage=include_usage,
        retry_ms=retry_ms,
    )


METAS = [
    pytest.param(make_meta(False, None), id="plain"),
    pytest.param(make_meta(True, None), id="usage"),
    pytest.param(make_meta(False, 3000), id="retry"),
    pytest.param(make_meta(True, 3000), id="usage-retry"),
]

HEAD = (
    b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1700000000,'
    b'"model":"mock/echo","choices":'
)


def chunk(delta: bytes, finish: bytes = b"null") -> bytes:
    return HEAD + b'[{"index":0,"delta":' + delta + b',"finish_reason":' + finish + b"}]}\n\n"


USAGE = Usage(prompt_tokens=5, completion_tokens=3, total_tokens=8)
USAGE_DETAILED = Usage(5, 3, 8, cached_tokens=2, reasoning_tokens=1)
ERROR = Error(error_type="upstream_error", message="boom", code="upstream_timeout", retryable=True)
FIRST = ToolCall(index=0, id="call_1", name="get_weather")
LATER = ToolCall(index=0, arguments='{"city":')

TC_FIRST = (
    b'{"tool_calls":[{"index":0,"id":"call_1","type":"function",'
    b'"function":{"arguments":"","name":"get_weather"}}]}'
)
WHOLE = ToolCall(index=0, id="call_1", name="now", arguments="{}")
TC_WHOLE = (
    b'{"tool_calls":[{"index":0,"id":"call_1","type":"function",'
    b'"function":{"arguments":"{}","name":"now"}}]}'
)
TC_LATER = b'{"tool_calls":[{"index":0,"function":{"arguments":"{\\"city\\":"}}]}'
CITE = b'{"annotations":[{"index":0,"type":"url_citation","url_citation":{"url":"https://x.test","title":'
IMG = b'{"images":[{"index":0,"type":"image_url","image_url":{"url":"'

# (event, delta JSON, finish_reason JSON): the choice of the chunk, whatever the meta.
OPENAI_CHOICES = [
    (Delta(content="Hello"), b'{"content":"Hello"}', b"null"),
    (Delta(content=""), b'{"content":""}', b"null"),
    (Delta(content='a\nb"\u00e9\u20ac'), '{"content":"a\\nb\\"\u00e9\u20ac"}'.encode(), b"null"),
    (Delta(finish_reason="stop"), b"{}", b'"stop"'),
    (Delta(content="x", finish_reason="length"), b'{"content":"x"}', b'"length"'),
    (Delta(role="assistant"), b"{}", b"null"),
    (Delta(role="assistant", content="Hi"), b'{"content":"Hi"}', b"null"),
    (Delta(refusal="I can't"), b'{"refusal":"I can\'t"}', b"null"),
    (Delta(tool_calls=(WHOLE,), finish_reason="tool_calls"), TC_WHOLE, b'"tool_calls"'),
    (Reasoning("hmm"), b'{"reasoning_content":"hmm"}', b"null"),
    (LATER, TC_LATER, b"null"),
    (
        ToolCall(index=1, id="call_2", name="f", arguments="{}"),
        b'{"tool_calls":[{"index":1,"id":"call_2","type":"function",'
        b'"function":{"arguments":"{}","name":"f"}}]}',
        b"null",
    ),
    (
        Audio(data="UklG", format="pcm16", transcript="hi"),
        b'{"audio":{"data":"UklG","format":"pcm16","transcript":"hi"}}',
        b"null",
    ),
    # As OpenAI streams them: only the fields a piece carries.
    (
        Audio(transcript="hi", id="audio_1"),
        b'{"audio":{"id":"audio_1","transcript":"hi"}}',
        b"null",
    ),
    (Audio(data="AAA="), b'{"audio":{"data":"AAA="}}', b"null"),
    (Audio(expires_at=1730768595), b'{"audio":{"expires_at":1730768595}}', b"null"),
    (
        Image(data="iVBO", mime_type="image/jpeg"),
        IMG + b'data:image/jpeg;base64,iVBO"}}]}',
        b"null",
    ),
    (Image(data="iVBO"), IMG + b'data:image/png;base64,iVBO"}}]}', b"null"),
    (Image(url="https://x.test/a.png", data="iVBO"), IMG + b'https://x.test/a.png"}}]}', b"null"),
    (
        Citation(url="https://x.test", title="X", quoted="q"),
        CITE + b'"X","quoted":"q"}}]}',
        b"null",
    ),
    (Citation(url="https://x.test"), CITE + b"null}}]}", b"null"),
]


@pytest.mark.parametrize("meta", METAS)
@pytest.mark.parametrize(("event", "delta", "finish"), OPENAI_CHOICES)
def test_openai_encode(meta: StreamMeta, event: StreamEvent, delta: bytes, finish: bytes) -> None:
    assert OpenAISSEEncoder(meta).encode(event) == chunk(delta, finish)


TC_FIRST_WITH_LATER = (
    b'{"tool_calls":[{"index":0,"id":"call_1","type":"function",'
    b'"function":{"arguments":"{\\"city\\":","name":"get_weather"}}]}'
)


@pytest.mark.parametrize("meta", METAS)
def test_openai_a_calls_first_fragment_goes_with_its_arguments(meta: StreamMeta) -> None:
    """A call's first fragment without arguments is held until they come (then one chunk);
    a call no argument fragment filled gets "{}" when a later call's arguments come, or
    before the finish, as nexus.accumulate gives it: the SDK's stream helper ends a call
    at the next index and parses what it holds, and "" is not JSON."""
    encoder = OpenAISSEEncoder(meta)
    assert encoder.encode(FIRST) == b""
    assert encoder.encode(LATER) == chunk(TC_FIRST_WITH_LATER, b"null")
    second = ToolCall(index=1, id="call_2", name="now")
    finishing = Delta(tool_calls=(second,), finish_reason="tool_calls")
    filled = b'{"tool_calls":[{"index":1,"id":"call_2","type":"function",'
    filled += b'"function":{"arguments":"{}","name":"now"}}]}'
    assert encoder.encode(finishing) == chunk(filled, b"null") + chunk(b"{}", b'"tool_calls"')
    bare = OpenAISSEEncoder(meta)
    assert bare.encode(FIRST) == b""
    out = bare.encode(ToolCall(index=1, id="call_2", name="f", arguments='{"a":1}'))
    assert out == chunk(
        b'{"tool_calls":[{"index":0,"id":"call_1","type":"function",'
        b'"function":{"arguments":"{}","name":"get_weather"}},'
        b'{"index":1,"id":"call_2","type":"function","function":{"arguments":"{\\"a\\":1}","name":"f"}}]}',
        b"null",
    )
    ended = OpenAISSEEncoder(meta)  # a stream that ends without a finish reason
    ended.encode(FIRST)
    filled = TC_FIRST.replace(b'"arguments":""', b'"arguments":"{}"')
    assert ended.end() == chunk(filled, b"null") + b"data: [DONE]\n\n"


ROLE_CHUNK = chunk(b'{"role":"assistant","content":""}')


@pytest.mark.parametrize(
    ("meta", "expected"),
    [
        (make_meta(False, None), ROLE_CHUNK),
        (make_meta(True, None), ROLE_CHUNK),
        (make_meta(False, 3000), b"retry: 3000\n" + ROLE_CHUNK),
        (make_meta(True, 0), b"retry: 0\n" + ROLE_CHUNK),
    ],
)
def test_openai_start(meta: StreamMeta, expected: bytes) -> None:
    assert OpenAISSEEncoder(meta).start() == expected


@pytest.mark.parametrize(
    ("include_usage", "usage", "expected"),
    [
        (
            True,
            USAGE,
            HEAD + b'[],"usage":{"prompt_tokens":5,"completion_tokens":3,"total_tokens":8}}\n\n',
        ),
        (
            True,
            USAGE_DETAILED,
            HEAD + b'[],"usage":{"prompt_tokens":5,"completion_tokens":3,"total_tokens":8,'
            b'"prompt_tokens_details":{"cached_tokens":2},'
            b'"completion_tokens_details":{"reasoning_tokens":1}}}\n\n',
        ),
        (False, USAGE, b""),
        (False, USAGE_DETAILED, b""),
    ],
)
@pytest.mark.parametrize("retry_ms", [None, 3000])
def test_openai_usage(
    include_usage: bool, usage: Usage, expected: bytes, retry_ms: int | None
) -> None:
    assert OpenAISSEEncoder(make_meta(include_usage, retry_ms)).encode(usage) == expected


@pytest.mark.parametrize("meta", METAS)
@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (
            ERROR,
            b'event: error\ndata: {"error":{"message":"boom","type":"upstream_error",'
            b'"param":null,"code":"upstream_timeout","retryable":true}}\n\n',
        ),
        (
            Error(error_type="invalid_request_error", message="bad", param="model"),
            b'event: error\ndata: {"error":{"message":"bad","type":"invalid_request_error",'
            b'"param":"model","code":null,"retryable":false}}\n\n',
        ),
    ],
)
def test_openai_error_heartbeat_end(meta: StreamMeta, error: Error, expected: bytes) -> None:
    encoder = OpenAISSEEncoder(meta)
    assert encoder.error(error) == expected
    assert encoder.heartbeat() == b": ping\n"
    assert encoder.end() == b"data: [DONE]\n\n"


def test_openai_error_carries_the_request_id() -> None:
    encoder = OpenAISSEEncoder(make_meta())
    encoder.request_id = "req-client-7"
    assert encoder.error(ERROR) == (
        b'event: error\ndata: {"error":{"message":"boom","type":"upstream_error",'
        b'"param":null,"code":"upstream_timeout","retryable":true,'
        b'"request_id":"req-client-7"}}\n\n'
    )


PARTIAL = Usage(
    prompt_tokens=41, total_tokens=41, cached_tokens=0, cache_write_tokens=0, partial=True
)


@pytest.mark.parametrize("meta", METAS)
def test_openai_skips_an_early_partial_usage(meta: StreamMeta) -> None:
    """The usage chunk is written once, with the totals: never for the early count."""
    assert OpenAISSEEncoder(meta).encode(PARTIAL) == b""


PARTIAL_JSON = (
    b'{"type":"usage","usage":{"prompt_tokens":41,"completion_tokens":0,"total_tokens":41,'
    b'"prompt_tokens_details":{"cached_tokens":0}},"partial":true}'
)
ERROR_WITH_ID_JSON = (
    b'{"type":"error","error":{"type":"upstream_error","message":"boom",'
    b'"code":"upstream_timeout","retryable":true,"request_id":"req-client-7"}}'
)


@pytest.mark.parametrize("meta", METAS)
def test_native_formats_mark_an_early_usage_partial(meta: StreamMeta) -> None:
    """One line per log entry (NDJSON resumes by count), marked so that it is not read
    as the totals."""
    assert NDJSONEncoder(meta).encode(PARTIAL) == PARTIAL_JSON + b"\n"
    assert (
        NativeSSEEncoder(meta).encode(PARTIAL) == b"event: usage\ndata: " + PARTIAL_JSON + b"\n\n"
    )


def test_native_formats_error_carries_the_request_id() -> None:
    ndjson, native = NDJSONEncoder(make_meta()), NativeSSEEncoder(make_meta())
    ndjson.request_id = native.request_id = "req-client-7"
    assert ndjson.error(ERROR) == ERROR_WITH_ID_JSON + b"\n"
    assert native.error(ERROR) == b"event: error\ndata: " + ERROR_WITH_ID_JSON + b"\n\n"


def test_openai_head_escapes_meta_strings() -> None:
    meta = StreamMeta(id='c"1', model="m\u00e9/\n", created=1)
    frame = OpenAISSEEncoder(meta).encode(Delta(content="x"))
    expected = (
        'data: {"id":"c\\"1","object":"chat.completion.chunk","created":1,"model":"m\u00e9/\\n",'
        '"choices":[{"index":0,"delta":{"content":"x"},"finish_reason":null}]}\n\n'
    )
    assert frame == expected.encode()


# (event, SSE event name, JSON form): native SSE frames it as `event: NAME\ndata: JSON\n\n`,
# NDJSON as `JSON\n`.
JSON_FORMS = [
    (Delta(content="Hello"), b"delta", b'{"type":"delta","delta":{"content":"Hello"}}'),
    (Delta(content="a\nb"), b"delta", b'{"type":"delta","delta":{"content":"a\\nb"}}'),
    (Delta(finish_reason="stop"), b"delta", b'{"type":"delta","delta":{},"finish_reason":"stop"}'),
    (
        Delta(role="assistant", content="Hi"),
        b"delta",
        b'{"type":"delta","delta":{"role":"assistant","content":"Hi"}}',
    ),
    (Reasoning("hmm"), b"reasoning", b'{"type":"reasoning","delta":{"reasoning":"hmm"}}'),
    (
        FIRST,
        b"tool_call",
        b'{"type":"tool_call","delta":{"tool_calls":[{"index":0,"id":"call_1","type":"function",'
        b'"function":{"arguments":"","name":"get_weather"}}]}}',
    ),
    (
        LATER,
        b"tool_call",
        b'{"type":"tool_call","delta":{"tool_calls":[{"index":0,'
        b'"function":{"arguments":"{\\"city\\":"}}]}}',
    ),
    (
        USAGE_DETAILED,
        b"usage",
        b'{"type":"usage","usage":{"prompt_tokens":5,"completion_tokens":3,"total_tokens":8,'
        b'"prompt_tokens_details":{"cached_tokens":2},'
        b'"completion_tokens_details":{"reasoning_tokens":1}}}',
    ),
    (
        Audio(data="UklG", format="pcm16"),
        b"audio",
        b'{"type":"audio","audio":{"data":"UklG","format":"pcm16","transcript":null}}',
    ),
    (
        Image(data="iVBO", mime_type="image/png"),
        b"image",
        b'{"type":"image","image":{"data":"iVBO","url":null,"mime_type":"image/png"}}',
    ),
    (
        Citation(url="https://x.test", title="X"),
        b"citation",
        b'{"type":"citation","citation":{"url":"https://x.test","title":"X","quoted":null}}',
    ),
    (Done(aborted=True), b"done", b'{"type":"done","aborted":true}'),
]
ERROR_JSON = (
    b'{"type":"error","error":{"type":"upstream_error","message":"boom",'
    b'"code":"upstream_timeout","retryable":true}}'
)


@pytest.mark.parametrize("meta", METAS)
@pytest.mark.parametrize(("event", "name", "json"), JSON_FORMS)
def test_native_encode(meta: StreamMeta, event: StreamEvent, name: bytes, json: bytes) -> None:
    assert NativeSSEEncoder(meta).encode(event) == b"event: " + name + b"\ndata: " + json + b"\n\n"


@pytest.mark.parametrize("meta", METAS)
@pytest.mark.parametrize(("event", "name", "json"), JSON_FORMS)
def test_ndjson_encode(meta: StreamMeta, event: StreamEvent, name: bytes, json: bytes) -> None:
    assert NDJSONEncoder(meta).encode(event) == json + b"\n"


@pytest.mark.parametrize(
    ("meta", "start"),
    [
        (make_meta(False, None), b""),
        (make_meta(True, None), b""),
        (make_meta(False, 3000), b"retry: 3000\n\n"),
        (make_meta(True, 3000), b"retry: 3000\n\n"),
    ],
)
def test_native_start_error_heartbeat_end(meta: StreamMeta, start: bytes) -> None:
    encoder = NativeSSEEncoder(meta)
    assert encoder.start() == start
    assert encoder.error(ERROR) == b"event: error\ndata: " + ERROR_JSON + b"\n\n"
    assert encoder.heartbeat() == b": ping\n"
    assert encoder.end() == b'event: done\ndata: {"type":"done"}\n\n'


@pytest.mark.parametrize("meta", METAS)
def test_ndjson_start_error_heartbeat_end(meta: StreamMeta) -> None:
    encoder = NDJSONEncoder(meta)
    assert encoder.start() == b""
    assert encoder.error(ERROR) == ERROR_JSON + b"\n"
    assert encoder.heartbeat() == b'{"type":"heartbeat"}\n'
    assert encoder.end() == b'{"type":"done"}\n'


def test_class_attributes() -> None:
    assert [(c.media_type, c.content_type, c.aliases) for c in ENCODERS] == [
        ("text/event-stream", "text/event-stream; charset=utf-8", ("sse", "openai")),
        (
            "application/vnd.nexus.events+sse",
            "text/event-stream; charset=utf-8",
            ("nexus", "nexus-sse"),
        ),
        ("application/x-ndjson", None, ("ndjson", "jsonl")),
    ]


# --- round trips ---------------------------------------------------------------------------

STREAM: list[StreamEvent] = [
    Reasoning("thinking \u00e9"),
    Delta(content="Hello"),
    Delta(content=" w\u00f6rld \U0001f600\nnext line"),
    FIRST,
    LATER,
    ToolCall(index=0, arguments='"Paris"}'),
    Audio(transcript="hi"),
    Image(url="https://x.test/a.png"),
    Citation(url="https://x.test", title="X"),
    Delta(finish_reason="tool_calls"),
    USAGE_DETAILED,
]


def encode_stream(encoder: Encoder, failed: bool) -> list[bytes]:
    frames = [encoder.start()]
    for i, event in enumerate(STREAM):
        frames.append(encoder.encode(event))
        if i == 2:
            frames.append(encoder.heartbeat())
    if failed:
        frames.append(encoder.error(ERROR))
    frames.append(encoder.end())
    return frames


ENCODERS = (OpenAISSEEncoder, NativeSSEEncoder, NDJSONEncoder)


def byte_chunks(data: bytes) -> Iterator[bytes]:
    for i in range(len(data)):
        yield data[i : i + 1]


CITED = {"url": "https://x.test", "title": "X"}
IMAGE_URL = "https://x.test/a.png"
ERROR_TAIL = {"param": None, "code": "upstream_timeout", "retryable": True}


def openai_payloads(meta: StreamMeta, failed: bool) -> list[Any]:
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1700000000}
    head["model"] = "mock/echo"

    def choice(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

    out: list[Any] = [
        choice({"role": "assistant", "content": ""}),
        choice({"reasoning_content": "thinking \u00e9"}),
        choice({"content": "Hello"}),
        choice({"content": " w\u00f6rld \U0001f600\nnext line"}),
        # (the call's first fragment, held, goes with its first arguments)
        choice(
            {
                "tool_calls": [
                    {
                        **FIRST.wire(),
                        "function": {**FIRST.wire()["function"], "arguments": '{"city":'},
                    }
                ]
            }
        ),
        choice({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}),
        choice({"audio": {"transcript": "hi"}}),
        choice({"images": [{"index": 0, "type": "image_url", "image_url": {"url": IMAGE_URL}}]}),
        choice({"annotations": [{"index": 0, "type": "url_citation", "url_citation": CITED}]}),
        choice({}, "tool_calls"),
    ]
    if meta.include_usage:
        out.append({**head, "choices": [], "usage": USAGE_DETAILED.wire()})
    if failed:
        out.append({"error": {"message": "boom", "type": "upstream_error", **ERROR_TAIL}})
    return out


@pytest.mark.parametrize("failed", [False, True], ids=["ended", "failed"])
@pytest.mark.parametrize("meta", METAS)
def test_openai_round_trip(meta: StreamMeta, failed: bool) -> None:
    data = b"".join(encode_stream(OpenAISSEEncoder(meta), failed))
    expected = openai_payloads(meta, failed)
    names = ["message"] * (len(expected) - failed) + ["error"] * failed + ["message"]

    for chunks in ([data], list(byte_chunks(data))):
        decoder = SSEDecoder()
        events = [e for c in chunks for e in decoder.decode(c)] + decoder.flush()
        assert [e.data for e in events][-1] == "[DONE]"
        assert [orjson.loads(e.data) for e in events[:-1]] == expected
        assert [e.event for e in events] == names
        assert events[0].retry == meta.retry_ms
        assert [e.retry for e in events[1:]] == [None] * (len(events) - 1)

    for chunks in ([data], list(byte_chunks(data))):
        sdk_events = list(OpenAISSEDecoder().iter_bytes(iter(chunks)))
        # No empty-data events: every one would be json.loads("") in the SDK (§1).
        assert [e.data for e in sdk_events if not e.data] == []
        assert sdk_events[-1].data == "[DONE]"
        assert [e.json() for e in sdk_events[:-1]] == expected
        assert [e.event for e in sdk_events] == [None if n == "message" else n for n in names]
        assert sdk_events[0].retry == meta.retry_ms


@pytest.mark.parametrize("failed", [False, True], ids=["ended", "failed"])
@pytest.mark.parametrize("meta", METAS)
def test_native_round_trip(meta: StreamMeta, failed: bool) -> None:
    data = b"".join(encode_stream(NativeSSEEncoder(meta), failed))
    sent: list[StreamEvent] = [*STREAM, *([ERROR] if failed else []), Done()]
    for chunks in ([data], list(byte_chunks(data))):
        decoder = SSEDecoder()
        events = [e for c in chunks for e in decoder.decode(c)] + decoder.flush()
        assert [e.event for e in events] == [type(e).type for e in sent]
        assert [orjson.loads(e.data) for e in events] == [e.to_dict() for e in sent]
        assert events[0].retry == meta.retry_ms


@pytest.mark.parametrize("failed", [False, True], ids=["ended", "failed"])
@pytest.mark.parametrize("meta", METAS)
def test_ndjson_round_trip(meta: StreamMeta, failed: bool) -> None:
    data = b"".join(encode_stream(NDJSONEncoder(meta), failed))
    assert data.endswith(b'\n{"type":"done"}\n')
    lines = data.split(b"\n")
    assert lines[-1] == b""
    sent = [*STREAM[:3], Heartbeat(), *STREAM[3:], *([ERROR] if failed else []), Done()]
    assert [orjson.loads(line) for line in lines[:-1]] == [e.to_dict() for e in sent]


@pytest.mark.parametrize("meta", METAS)
def test_openai_a_call_cut_off_before_its_arguments_goes_as_it_came(meta: StreamMeta) -> None:
    """A stream that fails after a call's first fragment: the fragment goes as it came,
    then the error; never with "{}" after it, a whole call whose arguments never came."""
    encoder = OpenAISSEEncoder(meta)
    assert encoder.encode(FIRST) == b""
    out = encoder.error(ERROR) + encoder.end()
    assert out.startswith(chunk(TC_FIRST, b"null") + b"event: error\n")
    assert out.endswith(b"\n\ndata: [DONE]\n\n") and b'"arguments":"{}"' not in out
