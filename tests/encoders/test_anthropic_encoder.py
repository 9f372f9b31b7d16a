"""The Anthropic Messages SSE encoder, byte for byte, and its output read back by the anthropic SDK.

docs/protocols.md §3: every frame has an ``event:`` line whose name is the payload's
``type``; ``message_start`` comes first; content blocks are indexed 0, 1, 2… in
order; the SDK's ``accumulate_event`` must rebuild the whole message.
"""

from __future__ import annotations

import re
from typing import Any

import orjson
import pytest
from anthropic._models import construct_type
from anthropic._streaming import SSEDecoder
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message, RawMessageStreamEvent

from nexus.encoders.anthropic_sse import AnthropicSSEEncoder
from nexus.events import Citation, Delta, Error, Reasoning, StreamEvent, ToolCall, Usage
from nexus.protocol.anthropic_output import message_body
from nexus.stream import merge_events
from nexus.types import StreamMeta

META = StreamMeta(id="chatcmpl-abc123", model="mock/echo", created=1700000000, retry_ms=None)


def frame(name: str, id: int, data: dict[str, Any]) -> bytes:
    # ``id`` numbers frames for the reader; the pump, not the encoder, writes id lines.
    return b"event: %s\ndata: %s\n\n" % (name.encode(), orjson.dumps(data))


def block_start(id: int, index: int, block: dict[str, Any]) -> bytes:
    body = {"type": "content_block_start", "index": index, "content_block": block}
    return frame("content_block_start", id, body)


def block_delta(id: int, index: int, delta: dict[str, Any]) -> bytes:
    body = {"type": "content_block_delta", "index": index, "delta": delta}
    return frame("content_block_delta", id, body)


def block_stop(id: int, index: int) -> bytes:
    return frame("content_block_stop", id, {"type": "content_block_stop", "index": index})


def text(s: str) -> dict[str, Any]:
    return {"type": "text_delta", "text": s}


def thinking(s: str) -> dict[str, Any]:
    return {"type": "thinking_delta", "thinking": s}


def partial(s: str) -> dict[str, Any]:
    return {"type": "input_json_delta", "partial_json": s}


def tool_block(id: str, name: str) -> dict[str, Any]:
    return {"type": "tool_use", "id": id, "name": name, "input": {}}


TEXT_BLOCK = {"type": "text", "text": ""}
THINKING_BLOCK = {"type": "thinking", "thinking": "", "signature": ""}


def usage_of(
    input_tokens: int, output_tokens: int, read: int = 0, write: int = 0, hour: int = 0
) -> dict[str, Any]:
    """A usage object as Anthropic writes it: every count, zeros included, in its order."""
    return {
        "input_tokens": input_tokens,
        "cache_creation_input_tokens": write,
        "cache_read_input_tokens": read,
        "cache_creation": {
            "ephemeral_5m_input_tokens": write - hour,
            "ephemeral_1h_input_tokens": hour,
        },
        "output_tokens": output_tokens,
    }


ZERO_USAGE = usage_of(0, 0)


def ending(id: int, stop_reason: str, usage: dict[str, Any], sequence: str | None = None) -> bytes:
    """``message_delta`` (at ``id``) then ``message_stop``."""
    body = {
        "type": "message_delta",
        "delta": {"stop_reason": stop_reason, "stop_sequence": sequence},
        "usage": usage,
    }
    stop = frame("message_stop", id + 1, {"type": "message_stop"})
    return frame("message_delta", id, body) + stop


MESSAGE_START = frame(
    "message_start",
    1,
    {
        "type": "message_start",
        "message": {
            "id": "msg_abc123",
            "type": "message",
            "role": "assistant",
            "model": "mock/echo",
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": ZERO_USAGE,
        },
    },
)


def run(*steps: StreamEvent | str, meta: StreamMeta = META) -> bytes:
    """The whole stream as the pump writes it; ``"ping"`` stands for an idle heartbeat."""
    enc = AnthropicSSEEncoder(meta)
    out = enc.start()
    for step in steps:
        out += enc.heartbeat() if step == "ping" else enc.encode(step)  # type: ignore[arg-type]
    return out + enc.end()


def test_message_start_leads_the_first_event_with_zero_usage() -> None:
    """Without an early count (an OpenAI upstream reports usage only at the end)."""
    enc = AnthropicSSEEncoder(META)
    assert enc.start() == b""
    assert enc.encode(Delta(role="assistant")) == MESSAGE_START


def test_retry_line_precedes_the_first_frame() -> None:
    meta = StreamMeta(id="chatcmpl-abc123", model="mock/echo", created=1700000000, retry_ms=3000)
    enc = AnthropicSSEEncoder(meta)
    assert enc.start() == b""
    assert enc.encode(Delta(role="assistant")) == b"retry: 3000\n" + MESSAGE_START
    idle = AnthropicSSEEncoder(meta)
    assert idle.heartbeat() == b"retry: 3000\n" + frame("ping", 1, {"type": "ping"})
    assert idle.encode(Delta(role="assistant")) == MESSAGE_START


@pytest.mark.parametrize(
    ("finish", "stop_reason"),
    [
        ("stop", "end_turn"),
        ("length", "max_tokens"),
        ("tool_calls", "tool_use"),
        ("content_filter", "refusal"),
    ],
)
def test_text_stream_frame_by_frame(finish: str, stop_reason: str) -> None:
    enc = AnthropicSSEEncoder(META)
    assert enc.start() == b""
    assert enc.encode(Delta(role="assistant")) == MESSAGE_START
    assert enc.encode(Delta(content="Hel")) == block_start(2, 0, TEXT_BLOCK) + block_delta(
        3, 0, text("Hel")
    )
    assert enc.encode(Delta(content='lo "wörld"\n')) == block_delta(4, 0, text('lo "wörld"\n'))
    assert enc.encode(Delta(finish_reason=finish)) == b""
    assert enc.encode(Usage(10, 5, 15, cached_tokens=4)) == b""
    usage = usage_of(6, 5, read=4)
    assert enc.end() == block_stop(5, 0) + ending(6, stop_reason, usage)


def test_end_without_finish_or_usage_defaults_to_end_turn_and_zero_usage() -> None:
    assert run(Delta(content="x")) == (
        MESSAGE_START
        + block_start(2, 0, TEXT_BLOCK)
        + block_delta(3, 0, text("x"))
        + block_stop(4, 0)
        + ending(5, "end_turn", ZERO_USAGE)
    )


@pytest.mark.parametrize(
    ("finish", "stop_reason", "sequence"),
    [("stop", "stop_sequence", "END"), ("length", "max_tokens", None)],
)
def test_a_named_stop_sequence_is_reported(
    finish: str, stop_reason: str, sequence: str | None
) -> None:
    got = run(Delta(content="x"), Delta(finish_reason=finish, stop_sequence="END"))
    assert got == (
        MESSAGE_START
        + block_start(2, 0, TEXT_BLOCK)
        + block_delta(3, 0, text("x"))
        + block_stop(4, 0)
        + ending(5, stop_reason, ZERO_USAGE, sequence)
    )


def test_empty_stream_is_start_then_ending() -> None:
    assert run() == MESSAGE_START + ending(2, "end_turn", ZERO_USAGE)


def test_reasoning_then_text_closes_the_thinking_block() -> None:
    got = run(Reasoning("Let me"), Reasoning(" think."), Delta(content="Hi"), Usage(3, 2, 5))
    usage = usage_of(3, 2)
    assert got == (
        MESSAGE_START
        + block_start(2, 0, THINKING_BLOCK)
        + block_delta(3, 0, thinking("Let me"))
        + block_delta(4, 0, thinking(" think."))
        + block_stop(5, 0)
        + block_start(6, 1, TEXT_BLOCK)
        + block_delta(7, 1, text("Hi"))
        + block_stop(8, 1)
        + ending(9, "end_turn", usage)
    )


def test_two_tool_calls_open_one_tool_use_block_each() -> None:
    got = run(
        Delta(tool_calls=(ToolCall(0, id="toolu_a", name="get_weather"),)),
        ToolCall(0, arguments='{"city": '),
        Delta(tool_calls=(ToolCall(0, arguments='"Paris"}'),)),
        ToolCall(1, id="toolu_b", name="get_time", arguments='{"tz":'),
        ToolCall(1, arguments=' "CET"}'),
        Delta(finish_reason="tool_calls"),
    )
    # A call's arguments go out whole, as its block closes (see the next test).
    assert got == (
        MESSAGE_START
        + block_start(2, 0, tool_block("toolu_a", "get_weather"))
        + block_delta(3, 0, partial('{"city": "Paris"}'))
        + block_stop(4, 0)
        + block_start(5, 1, tool_block("toolu_b", "get_time"))
        + block_delta(6, 1, partial('{"tz": "CET"}'))
        + block_stop(7, 1)
        + ending(8, "tool_use", ZERO_USAGE)
    )


@pytest.mark.parametrize(
    ("arguments", "partial_json"),
    [
        (["not json {"], '{"_raw":"not json {"}'),
        (['{"a": ', "1"], '{"_raw":"{\\"a\\": 1"}'),  # cut short
        (["[1, 2]"], '{"_raw":"[1, 2]"}'),  # not an object
        (['{"a": ', "1}"], '{"a": 1}'),
    ],
)
def test_tool_arguments_are_what_the_json_body_gives(
    arguments: list[str], partial_json: str
) -> None:
    """The SDK parses each input_json_delta as it comes and raises on broken JSON; the
    non-streaming body gives {"_raw": ...}: the stream gives that too."""
    calls = [ToolCall(0, id="toolu_a", name="f", arguments=arguments[0])]
    calls += [ToolCall(0, arguments=more) for more in arguments[1:]]
    got = run(*calls, Delta(finish_reason="tool_calls"))
    assert block_delta(3, 0, partial(partial_json)) in got
    message = sdk_final_message(got)
    body = message_body(merge_events([*calls, Delta(finish_reason="tool_calls")], META))
    assert message.content[0].input == body["content"][0]["input"]


def test_a_tool_call_without_an_id_gets_the_json_bodys_fallback_id() -> None:
    """One id in both forms, unlike another stream's (a client sends it back next turn)."""
    events = [ToolCall(1, name="f", arguments="{}"), Delta(finish_reason="tool_calls")]
    message = sdk_final_message(run(*events))
    body = message_body(merge_events(events, META))
    assert message.content[0].id == body["content"][0]["id"] == "call_tcmpl-abc123_1"
    other = StreamMeta(id="chatcmpl-def456", model="m", created=1)
    assert sdk_final_message(run(*events, meta=other)).content[0].id == "call_tcmpl-def456_1"


def test_text_then_tool_call_gets_the_next_block_index() -> None:
    got = run(Delta(content="Checking."), ToolCall(0, id="toolu_a", name="f", arguments="{}"))
    assert got == (
        MESSAGE_START
        + block_start(2, 0, TEXT_BLOCK)
        + block_delta(3, 0, text("Checking."))
        + block_stop(4, 0)
        + block_start(5, 1, tool_block("toolu_a", "f"))
        + block_delta(6, 1, partial("{}"))
        + block_stop(7, 1)
        + ending(8, "tool_use", ZERO_USAGE)  # a turn that holds a call
    )


def test_citations_are_citations_deltas_on_the_text_block() -> None:
    got = run(
        Delta(content="Paris is the capital."),
        Citation(url="https://example.com/fr", title="France", quoted="Paris is the capital"),
        Citation(url="https://example.com/x"),
    )

    def cite(url: str, title: str | None, cited: str) -> dict[str, Any]:
        citation = {
            "type": "web_search_result_location",
            "url": url,
            "title": title,
            "cited_text": cited,
            "encrypted_index": "",
        }
        return {"type": "citations_delta", "citation": citation}

    assert got == (
        MESSAGE_START
        + block_start(2, 0, TEXT_BLOCK)
        + block_delta(3, 0, text("Paris is the capital."))
        + block_delta(4, 0, cite("https://example.com/fr", "France", "Paris is the capital"))
        + block_delta(5, 0, cite("https://example.com/x", None, ""))
        + block_stop(6, 0)
        + ending(7, "end_turn", ZERO_USAGE)
    )


def test_heartbeat_is_a_ping_frame_in_the_id_sequence() -> None:
    enc = AnthropicSSEEncoder(META)
    assert enc.start() == b""
    assert enc.heartbeat() == frame("ping", 2, {"type": "ping"})
    assert enc.encode(Delta(content="a")) == MESSAGE_START + block_start(
        3, 0, TEXT_BLOCK
    ) + block_delta(4, 0, text("a"))
    assert enc.heartbeat() == frame("ping", 5, {"type": "ping"})


FULL = (
    "ping",
    Reasoning("Let me think."),
    Delta(role="assistant", content="Hello "),
    "ping",
    Delta(content="world"),
    Citation(url="https://example.com", title="Example", quoted="Hello"),
    ToolCall(0, id="toolu_1", name="get_weather", arguments='{"city": '),
    "ping",
    ToolCall(0, arguments='"Paris", "days": [1, 2]}'),
    Delta(tool_calls=(ToolCall(1, id="toolu_2", name="get_time", arguments="{}"),)),
    Delta(finish_reason="tool_calls"),
    Usage(20, 9, 29, cached_tokens=5),
)


def test_every_frame_is_named_after_its_type() -> None:
    data = run(*FULL, meta=StreamMeta("chatcmpl-abc123", "mock/echo", 1700000000, retry_ms=3000))
    # A heartbeat before the first event comes before message_start (the SDK skips pings).
    assert data.startswith(b"retry: 3000\nevent: ping\n")
    frames = data.removeprefix(b"retry: 3000\n").removesuffix(b"\n\n").split(b"\n\n")
    names = []
    for raw in frames:
        match = re.fullmatch(rb"event: (\w+)\ndata: (\{.*\})", raw)
        assert match is not None, raw
        assert orjson.loads(match[2])["type"] == match[1].decode()
        names.append(match[1].decode())
    assert names.count("ping") == 3
    assert names[:2] == ["ping", "message_start"]
    assert names[-2:] == ["message_delta", "message_stop"]


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (Error("upstream_error", "upstream broke", code="upstream_error"), "api_error"),
        (
            Error("invalid_request_error", "bad input", code="upstream_invalid_request"),
            "invalid_request_error",
        ),
        (Error("upstream_error", "too slow", code="upstream_timeout"), "timeout_error"),
        (Error("server_error", "slow down", code="upstream_rate_limited"), "rate_limit_error"),
        # An Anthropic upstream's in-stream rate_limit_error (protocol/upstream.py in_stream_error):
        (Error("rate_limit_error", "rate limited", code="upstream_error"), "rate_limit_error"),
    ],
)
def test_error_frame_ends_the_stream(error: Error, kind: str) -> None:
    enc = AnthropicSSEEncoder(META)
    assert enc.start() == b""
    assert enc.encode(Delta(content="partial")) == MESSAGE_START + block_start(
        2, 0, TEXT_BLOCK
    ) + block_delta(3, 0, text("partial"))
    details = {"error_code": error.code}
    body = {"type": "error", "error": {"type": kind, "message": error.message, "details": details}}
    assert enc.error(error) == frame("error", 4, body)
    assert enc.end() == b""


def test_error_frame_carries_the_code_and_the_request_id() -> None:
    """Anthropic's shape: the code in ``error.details.error_code`` (what the SDK reads into
    ``error_code``), the request id at the top level (the SDK's ``ErrorResponse``)."""
    enc = AnthropicSSEEncoder(META)
    enc.request_id = "req-client-7"
    error = Error("upstream_error", "too slow", code="upstream_timeout", retryable=True)
    assert enc.error(error) == (
        b'event: error\ndata: {"type":"error","error":{"type":"timeout_error",'
        b'"message":"too slow","details":{"error_code":"upstream_timeout"}},'
        b'"request_id":"req-client-7"}\n\n'
    )
    bare = AnthropicSSEEncoder(META)
    assert bare.error(Error("server_error", "x")) == (
        b'event: error\ndata: {"type":"error","error":{"type":"api_error","message":"x"}}\n\n'
    )


EARLY = Usage(
    prompt_tokens=41 + 7 + 3, total_tokens=51, cached_tokens=7, cache_write_tokens=3, partial=True
)


def test_early_usage_fills_message_start() -> None:
    """Anthropic's own order: the input counts in message_start, before any content; the
    totals in message_delta."""
    enc = AnthropicSSEEncoder(META)
    assert enc.start() == b""
    early_usage = usage_of(41, 0, read=7, write=3)
    message_start = orjson.loads(MESSAGE_START.split(b"data: ", 1)[1])
    message_start["message"]["usage"] = early_usage
    assert enc.encode(EARLY) == frame("message_start", 1, message_start)
    assert enc.encode(Delta(content="Hi")) == block_start(2, 0, TEXT_BLOCK) + block_delta(
        3, 0, text("Hi")
    )
    assert enc.encode(Delta(finish_reason="stop")) == b""
    assert enc.encode(Usage(51, 2, 53, cached_tokens=7, cache_write_tokens=3)) == b""
    final = {**early_usage, "output_tokens": 2}
    assert enc.end() == block_stop(4, 0) + ending(5, "end_turn", final)


def sdk_final_message(data: bytes) -> Message:
    """As ``MessageStream`` does: the SDK's SSE decoder, event filter and ``accumulate_event``."""
    chunks = [data[i : i + 7] for i in range(0, len(data), 7)]
    snapshot: Any = None
    json_bufs: dict[int, bytes] = {}
    for sse in SSEDecoder().iter_bytes(iter(chunks)):
        # Stream.__stream__ silently drops unnamed and empty events: here they are failures.
        assert sse.event is not None and sse.data, sse
        assert sse.event != "error", sse.data
        if sse.event == "ping":
            continue
        event = construct_type(type_=RawMessageStreamEvent, value=sse.json())
        snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs=json_bufs)
    assert snapshot is not None
    return snapshot


def test_round_trip_through_the_sdk_accumulator() -> None:
    message = sdk_final_message(run(*FULL))
    assert message.id == "msg_abc123"
    assert (message.role, message.model) == ("assistant", "mock/echo")
    assert [block.type for block in message.content] == ["thinking", "text", "tool_use", "tool_use"]
    think, answer, weather, clock = message.content
    assert think.type == "thinking" and think.thinking == "Let me think."
    assert answer.type == "text" and answer.text == "Hello world"
    assert answer.citations is not None and len(answer.citations) == 1
    citation = answer.citations[0]
    assert citation.type == "web_search_result_location"
    assert (citation.url, citation.title, citation.cited_text) == (
        "https://example.com",
        "Example",
        "Hello",
    )
    assert weather.type == "tool_use" and clock.type == "tool_use"
    assert (weather.id, weather.name, weather.input) == (
        "toolu_1",
        "get_weather",
        {"city": "Paris", "days": [1, 2]},
    )
    assert (clock.id, clock.name, clock.input) == ("toolu_2", "get_time", {})
    assert message.stop_reason == "tool_use"
    assert message.stop_sequence is None
    usage = message.usage
    assert (usage.input_tokens, usage.output_tokens, usage.cache_read_input_tokens) == (15, 9, 5)
