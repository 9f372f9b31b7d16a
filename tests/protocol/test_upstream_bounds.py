"""What an upstream's stream may hold of the gateway, checked on the codecs alone: each
test is named for what it keeps from breaking."""

from __future__ import annotations

import orjson
import pytest

from nexus.errors import UpstreamProtocolError
from nexus.protocol.anthropic_events import EventDecoder
from nexus.protocol.openai_chunks import ChunkDecoder
from nexus.protocol.sse import EventTooLarge, SSEDecoder
from nexus.protocol.upstream import MAX_ERROR_TEXT, error_text, in_stream_error, status_error

LIMIT = 4096


def reads(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


@pytest.mark.parametrize("size", [1000, 3000])
def test_a_line_without_an_end_is_not_held_past_the_bound(size: int) -> None:
    """A line that never ended used to be held whole (a gigabyte took the gateway to 4 GB)."""
    decoder = SSEDecoder(LIMIT)
    decoder.decode(b"data: ")
    with pytest.raises(EventTooLarge):
        for chunk in reads(b"a" * (LIMIT * 3), size):
            decoder.decode(chunk)
    assert decoder.decode(b"\n\n") == []  # what it held is gone


def test_an_event_of_many_short_lines_is_bounded() -> None:
    decoder = SSEDecoder(LIMIT)
    with pytest.raises(EventTooLarge):
        for _ in range(LIMIT):
            decoder.decode(b"data: x\n")


@pytest.mark.parametrize("end", [b"\n", b"\r\n", b"\r"])
@pytest.mark.parametrize("size", [7, 100, 1000])
def test_events_split_across_reads_never_pass_the_bound(end: bytes, size: int) -> None:
    """The bound counts from each event's start, not over the stream."""
    event = b"data: " + b"x" * 900 + end + b"data: y" + end + end
    decoder = SSEDecoder(LIMIT)
    events = [e for chunk in reads(event * 200, size) for e in decoder.decode(chunk)]
    assert len(events) == 200


@pytest.mark.parametrize("end", [b"\n", b"\r\n", b"\r"])
def test_blank_lines_split_between_reads_end_each_events_count(end: bytes) -> None:
    """A server that writes each event's closing line end apart: every read but the first
    starts with the blank line that ends the event before. The count used to run on over
    the stream (68 events of 59 bytes made 4 KB)."""
    event = b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}' + end
    decoder = SSEDecoder(LIMIT)
    events = [e for _ in range(1000) for e in decoder.decode(end + event)]
    assert len(events) == 999


def test_an_event_just_under_the_bound_passes() -> None:
    data = b"data: " + b"a" * (LIMIT - 1100) + b"\n\n"
    decoder = SSEDecoder(LIMIT)
    events = [e for chunk in reads(data, 1000) for e in decoder.decode(chunk)]
    assert [len(e.data) for e in events] == [LIMIT - 1100]


def test_openai_chunks_past_the_bound_end_with_a_protocol_error() -> None:
    decoder = ChunkDecoder("up", LIMIT)
    assert decoder.decode(b'data: {"choices":[{"index":0,"delta":{"content":"') == []
    for chunk in reads(b"b" * (LIMIT * 2), 1024):
        decoder.decode(chunk)
        if decoder.error is not None:
            break
    assert isinstance(decoder.error, UpstreamProtocolError)
    assert "max_event_bytes" in str(decoder.error)


def test_anthropic_events_past_the_bound_end_with_a_protocol_error() -> None:
    decoder = EventDecoder("claude", LIMIT)
    decoder.decode(b"event: content_block_delta\ndata: ")
    for chunk in reads(b"c" * (LIMIT * 2), 1024):
        decoder.decode(chunk)
        if decoder.error is not None:
            break
    assert isinstance(decoder.error, UpstreamProtocolError)


BAD_COUNTS = [
    ("1e308", "prompt_tokens"),  # a float: cost_usd was inf, and the key's budget with it
    ("1" + "0" * 400, "prompt_tokens"),  # past any float: OverflowError, a 500
    ("1" + "0" * 30, "prompt_tokens"),  # past 64 bits: orjson refused it, a 500
    ("-5000000", "prompt_tokens"),  # passed on to the client and the access line
    ('"100"', "prompt_tokens"),  # a string: TypeError, a 500
    ("10.7", "prompt_tokens"),
    ("true", "prompt_tokens"),
    ("1000000001", "prompt_tokens"),
]


@pytest.mark.parametrize(("value", "field"), BAD_COUNTS)
def test_openai_usage_counts_must_be_token_counts(value: str, field: str) -> None:
    usage = f'{{"{field}":{value},"completion_tokens":1,"total_tokens":1}}'
    decoder = ChunkDecoder("up")
    assert decoder.decode(b'data: {"choices":[],"usage":' + usage.encode() + b"}\n\n") == []
    assert isinstance(decoder.error, UpstreamProtocolError)
    assert f"usage {field} that is not a count of tokens" in str(decoder.error)


@pytest.mark.parametrize(
    "usage",
    [
        b'{"prompt_tokens":100,"prompt_tokens_details":{"cached_tokens":"x"}}',
        b'{"prompt_tokens":1,"completion_tokens_details":{"reasoning_tokens":-1}}',
        b'{"prompt_tokens":1,"prompt_tokens_details":[1]}',
        b"[1, 2]",
    ],
)
def test_openai_usage_details_are_checked_too(usage: bytes) -> None:
    decoder = ChunkDecoder("up")
    decoder.decode(b'data: {"choices":[],"usage":' + usage + b"}\n\n")
    assert isinstance(decoder.error, UpstreamProtocolError)


def test_openai_counts_within_bounds_pass() -> None:
    usage = (
        b'{"prompt_tokens":1000000000,"completion_tokens":0,"total_tokens":1000000000,'
        b'"prompt_tokens_details":{"cached_tokens":null}}'
    )
    decoder = ChunkDecoder("up")
    [event] = decoder.decode(b'data: {"choices":[],"usage":' + usage + b"}\n\n")
    assert decoder.error is None
    assert (event.prompt_tokens, event.cached_tokens) == (10**9, None)  # type: ignore[union-attr]


def test_counts_written_as_whole_floats_are_counts() -> None:
    # Some compatible servers write counts as 10.0: the answer was whole, and its usage good.
    usage = b'{"prompt_tokens":10.0,"completion_tokens":3.0,"total_tokens":13.0}'
    decoder = ChunkDecoder("up")
    [event] = decoder.decode(b'data: {"choices":[],"usage":' + usage + b"}\n\n")
    assert decoder.error is None
    assert (event.prompt_tokens, event.completion_tokens) == (10, 3)  # type: ignore[union-attr]
    assert type(event.prompt_tokens) is int  # type: ignore[union-attr]


@pytest.mark.parametrize(("value", "field"), BAD_COUNTS)
@pytest.mark.parametrize("event", ["message_start", "message_delta"])
def test_anthropic_usage_counts_must_be_token_counts(value: str, field: str, event: str) -> None:
    name = "output_tokens" if event == "message_delta" else "input_tokens"
    usage = f'{{"{name}":{value}}}'.encode()
    data = (
        b'{"type":"message_start","message":{"usage":' + usage + b"}}"
        if event == "message_start"
        else b'{"type":"message_delta","delta":{},"usage":' + usage + b"}"
    )
    decoder = EventDecoder("claude")
    assert decoder.decode(b"event: " + event.encode() + b"\ndata: " + data + b"\n\n") == []
    assert isinstance(decoder.error, UpstreamProtocolError)
    if len(value) < 400:  # (orjson, which reads Anthropic's events, refuses the longest)
        assert f"usage {name} that is not a count of tokens" in str(decoder.error)


@pytest.mark.parametrize(
    "body",
    [
        orjson.dumps({"error": {"message": "bad: " + "Z" * 60000}}),  # was passed on whole
        orjson.dumps({"message": "Y" * 60000}),
        b"plain " * 20000,
    ],
)
def test_error_text_is_cut_whatever_its_shape(body: bytes) -> None:
    assert len(error_text(body)) == MAX_ERROR_TEXT


def test_an_error_inside_the_stream_is_cut() -> None:
    """A 5 MB in-stream error.message used to be forwarded whole."""
    error = in_stream_error("up", {"message": "E" * (5 << 20), "type": "server_error"})
    assert len(str(error)) < MAX_ERROR_TEXT + 50


@pytest.mark.parametrize(
    "text",
    [
        "boom\n2030-01-01 00:00:00,000 INFO nexus.access FORGED status=200",
        "boom\r\x1b[2Jcleared\u2028next\x85",
    ],
)
def test_error_text_cannot_break_a_log_line(text: str) -> None:
    """With text logs, an upstream's 5xx body could forge lines in the operator's log."""
    for out in (error_text(text.encode()), str(in_stream_error("up", {"message": text}))):
        assert not any(c in out for c in "\n\r\x1b\u2028\x85")
        assert "\\n" in out or "\\r" in out


@pytest.mark.parametrize(
    "secret", ["proj_abcDEF123operator", "proj_Xy12Ab34Cd56Ef78", "user-abcdefghijklmnopqrst"]
)
def test_openai_project_and_user_ids_are_redacted(secret: str) -> None:
    body = orjson.dumps({"error": {"message": f"Rate limit for {secret} reached"}})
    assert error_text(body) == "Rate limit for [redacted] reached"


@pytest.mark.parametrize(
    ("given", "kept"),
    [
        ({"Retry-After": "86400", "retry-after-ms": "86400000"}, (None, None)),
        ({"Retry-After": "60", "retry-after-ms": "60000"}, ("60", "60000")),
        ({"Retry-After": "3", "retry-after-ms": "2500"}, ("3", "2500")),
        ({"Retry-After": "Wed, 21 Oct 2037 07:28:00 GMT", "retry-after-ms": "nan"}, (None, None)),
        ({"Retry-After": "-1", "retry-after-ms": "-5"}, (None, None)),
        ({"retry-after-ms": "1e9"}, (None, None)),
    ],
)
def test_retry_after_passed_on_is_bounded(
    given: dict[str, str], kept: tuple[str | None, ...]
) -> None:
    """An upstream's Retry-After: 86400 used to be promised to clients as it came; a wait
    past the bound is named in the message, with a word not to retry, and passed on as no
    Retry-After (the error stays retryable for an alias's next target)."""
    error = status_error("up", 429, "slow down", given)
    assert (error.headers.get("Retry-After"), error.headers.get("retry-after-ms")) == kept
    assert error.retryable
    too_long = "x-should-retry" in error.headers
    assert too_long == ("longer than 60 s" in error.message)
