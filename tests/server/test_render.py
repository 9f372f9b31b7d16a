"""Event ids and resume points: parse_cursor, the Renderer's ids, and resume from any id.

The central property: for every event a client saw (the ``id`` its decoder
reports, which is what a browser sends back as ``Last-Event-ID``), a renderer
resumed after it writes exactly the bytes that followed that event in the
first rendering, for every registered format and however the log is batched.
"""

from __future__ import annotations

import json
import math
import random
import re
from collections.abc import Iterator, Sequence
from itertools import pairwise
from typing import Any, ClassVar

import pytest
from anthropic._streaming import SSEDecoder as AnthropicSDKDecoder
from hypothesis import given, settings
from hypothesis import strategies as st
from openai._streaming import SSEDecoder as OpenAISDKDecoder

from nexus.encoders import Encoder
from nexus.encoders.anthropic_sse import AnthropicSSEEncoder
from nexus.encoders.native_sse import NativeSSEEncoder
from nexus.encoders.ndjson import NDJSONEncoder
from nexus.encoders.openai_sse import OpenAISSEEncoder
from nexus.encoders.registry import default_registry
from nexus.encoders.responses_sse import ResponsesSSEEncoder
from nexus.errors import InvalidLastEventId, InvalidRequest
from nexus.events import (
    Audio,
    Citation,
    Delta,
    Done,
    Error,
    Image,
    Reasoning,
    StreamEvent,
    ToolCall,
    Usage,
)
from nexus.protocol.sse import ServerSentEvent, SSEDecoder
from nexus.server.render import Cursor, Renderer, parse_cursor, uses_event_ids
from nexus.types import StreamMeta

STREAM_ID = "chatcmpl-0123456789abcdef0123456789abcdef"

# --- parse_cursor -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(f"{STREAM_ID}.7", Cursor(STREAM_ID, 7), id="id-step"),
        pytest.param(f"{STREAM_ID}.0", Cursor(STREAM_ID, 0), id="id-step-0"),
        pytest.param(f"{STREAM_ID}.7.0", Cursor(STREAM_ID, 7, 0), id="id-step-frame"),
        pytest.param(f"{STREAM_ID}.12.3", Cursor(STREAM_ID, 12, 3), id="id-step-frame-3"),
        pytest.param("7", Cursor(None, 7), id="bare-step"),
        pytest.param("0", Cursor(None, 0), id="bare-zero"),
        pytest.param("7.2", Cursor(None, 7, 2), id="bare-step-frame"),
        pytest.param("007", Cursor(None, 7), id="leading-zeros"),
        pytest.param("999999999999", Cursor(None, 999999999999), id="12-digit-step"),
        pytest.param("abcdefgh.1.999999", Cursor("abcdefgh", 1, 999999), id="6-digit-frame"),
        pytest.param("abcdefgh.1", Cursor("abcdefgh", 1), id="8-char-id"),
        pytest.param("a" * 128 + ".5", Cursor("a" * 128, 5), id="128-char-id"),
        pytest.param("resp_AB-cd_09.3", Cursor("resp_AB-cd_09", 3), id="id-charset"),
        pytest.param(f"  {STREAM_ID}.7  ", Cursor(STREAM_ID, 7), id="spaces"),
        pytest.param("\t42\r\n", Cursor(None, 42), id="tab-crlf"),
    ],
)
def test_parse_cursor_accepts(text: str, expected: Cursor) -> None:
    assert parse_cursor(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("", id="empty"),
        pytest.param("   ", id="blank"),
        pytest.param(".", id="dot"),
        pytest.param("..", id="dots"),
        pytest.param(f"{STREAM_ID}.", id="no-step"),
        pytest.param(f".{STREAM_ID}.1", id="leading-dot"),
        pytest.param(STREAM_ID, id="id-only"),
        pytest.param("-1", id="negative"),
        pytest.param(f"{STREAM_ID}.-1", id="negative-step"),
        pytest.param(f"{STREAM_ID}.1.-1", id="negative-frame"),
        pytest.param("+1", id="plus-sign"),
        pytest.param("1.5e3", id="float"),
        pytest.param("one", id="letters"),
        pytest.param("1a", id="digit-letter"),
        pytest.param(f"{STREAM_ID}.x", id="letter-step"),
        pytest.param("1234567890123", id="13-digit-step"),
        pytest.param("abcdefgh.1.1234567", id="7-digit-frame"),
        pytest.param("abcdefg.1", id="7-char-id"),
        pytest.param("a" * 129 + ".1", id="129-char-id"),
        pytest.param("a.b.c.d", id="a.b.c.d"),
        pytest.param(f"{STREAM_ID}.1.2.3", id="four-parts"),
        pytest.param("stream.with.dots.1", id="id-with-dots"),
        pytest.param("chatcmpl-abc.def-ghi.1", id="id-with-dot-inside"),
        pytest.param("chat cmpl-1234.1", id="id-with-space"),
        pytest.param(f"{STREAM_ID} .1", id="space-before-dot"),
        pytest.param("1 2", id="inner-space"),
        pytest.param("chatcmpl/123456.1", id="slash"),
        pytest.param("chatcmpl\u00e9123456.1", id="non-ascii-id"),
        pytest.param("1\x00", id="nul"),
    ],
)
def test_parse_cursor_rejects(text: str) -> None:
    with pytest.raises(InvalidLastEventId) as info:
        parse_cursor(text)
    error = info.value
    assert isinstance(error, InvalidRequest)
    assert error.status == 400
    assert error.code == "invalid_last_event_id"
    assert error.error_type == "invalid_request_error"
    assert error.param == "last_event_id"


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("\u0661\u0662\u0663", id="arabic-indic-digits"),
        pytest.param("\uff17", id="fullwidth-7"),
        pytest.param(f"{STREAM_ID}.\u0967", id="devanagari-step"),
    ],
)
def test_parse_cursor_rejects_non_ascii_digits(text: str) -> None:
    with pytest.raises(InvalidLastEventId):
        parse_cursor(text)


@pytest.mark.parametrize(
    ("cursor", "text"),
    [
        (Cursor(STREAM_ID, 7), f"{STREAM_ID}.7"),
        (Cursor(STREAM_ID, 7, 0), f"{STREAM_ID}.7.0"),
        (Cursor(None, 7), "7"),
        (Cursor(None, 0), "0"),
        (Cursor(None, 3, 1), "3.1"),
    ],
)
def test_cursor_str(cursor: Cursor, text: str) -> None:
    assert str(cursor) == text
    assert parse_cursor(text) == cursor


_IDS = st.from_regex(r"[A-Za-z0-9_-]{8,128}", fullmatch=True)


@settings(max_examples=100, deadline=None, database=None)
@given(
    stream_id=st.none() | _IDS,
    step=st.integers(0, 10**12 - 1),
    frame=st.none() | st.integers(0, 10**6 - 1),
)
def test_cursor_str_round_trips(stream_id: str | None, step: int, frame: int | None) -> None:
    # The forms the gateway hands out: '<id>.<step>[.<frame>]' on SSE, a bare count on
    # NDJSON. (A bare '<step>.<frame>' is never handed out, and with 8+ digits it reads
    # as '<id>.<step>'.)
    if stream_id is None:
        frame = None
    cursor = Cursor(stream_id, step, frame)
    assert parse_cursor(str(cursor)) == cursor
    assert str(parse_cursor(str(cursor))) == str(cursor)


# --- uses_event_ids ---------------------------------------------------------------------


class _Plain(Encoder):
    media_type = "application/x-plain"

    def encode(self, event: StreamEvent) -> bytes:
        return b""

    def heartbeat(self) -> bytes:
        return b""


class _UpperSSE(_Plain):
    media_type = "application/x-upper"
    content_type = " Text/Event-Stream ; charset=utf-8"


class _SSEWithoutIds(_Plain):
    media_type = "text/event-stream"
    event_ids: ClassVar[bool | None] = False


class _TextWithIds(_Plain):
    media_type = "text/plain"
    event_ids: ClassVar[bool | None] = True


@pytest.mark.parametrize(
    ("encoder", "expected"),
    [
        (OpenAISSEEncoder, True),
        (NativeSSEEncoder, True),
        (NDJSONEncoder, False),
        (AnthropicSSEEncoder, True),
        (ResponsesSSEEncoder, True),
        (_Plain, False),
        (_UpperSSE, True),
        (_SSEWithoutIds, False),
        (_TextWithIds, True),
    ],
)
def test_uses_event_ids(encoder: type[Encoder], expected: bool) -> None:
    assert uses_event_ids(encoder) is expected


def test_every_registered_encoder_is_covered() -> None:
    assert set(default_registry.media_types()) == {enc.media_type for enc in ENCODER_CLASSES}


# --- logs and helpers ---------------------------------------------------------------------

ENCODER_CLASSES = [
    default_registry.get(media_type) for media_type in default_registry.media_types()
]
ENCODERS = [pytest.param(enc, id=enc.__name__) for enc in ENCODER_CLASSES]
SSE_ENCODERS = [
    pytest.param(enc, id=enc.__name__) for enc in ENCODER_CLASSES if uses_event_ids(enc)
]

PLAIN_META = StreamMeta(id=STREAM_ID, model="mock/echo", created=1700000000)
RICH_META = StreamMeta(
    id=STREAM_ID, model="mock/echo", created=1700000000, include_usage=True, retry_ms=2500
)
METAS = [pytest.param(PLAIN_META, id="plain-meta"), pytest.param(RICH_META, id="retry-usage-meta")]

UPSTREAM_ERROR = Error(
    error_type="upstream_error", message="upstream broke", code="upstream_timeout", retryable=True
)
BAD_REQUEST = Error(
    error_type="invalid_request_error", message="bad\nrequest", code="invalid", param="messages"
)

LOGS: dict[str, list[StreamEvent]] = {
    "text": [
        Delta(role="assistant", content=""),
        Delta(content="Hel"),
        Delta(content="lo\n\nw\u00f6rld \U0001f389"),
        Delta(content="data: x\n\nid: 3\r\n\r\nevent: y\n"),
        Delta(content="\u2028\u2029\x00\ufeff"),
        Delta(finish_reason="stop"),
        Done(),
    ],
    "reasoning-then-text": [
        Reasoning("Let me"),
        Reasoning(" think.\n\n"),
        Reasoning("", signature="c2lnbmF0dXJl"),
        Delta(content="The answer"),
        Delta(content=" is 42."),
        Delta(finish_reason="stop"),
        Done(),
    ],
    "tool-calls": [
        Delta(content="Checking."),
        ToolCall(0, "call_1", "get_weather"),
        ToolCall(0, arguments='{"city":'),
        ToolCall(0, arguments='"Paris\\n\\n"}'),
        Delta(tool_calls=(ToolCall(1, "call_2", "get_time", "{}"),)),
        Delta(finish_reason="tool_calls"),
        Done(),
    ],
    "usage": [
        Delta(content="Hi"),
        Delta(content=" there"),
        Delta(finish_reason="stop"),
        Usage(5, 3, 8, cached_tokens=2, cache_write_tokens=1, reasoning_tokens=1),
        Done(),
    ],
    "mixed": [
        Delta(content="See "),
        Citation(url="https://example.com/a", title="A", quoted="q\n\nq"),
        Audio(data="AAAA", format="pcm16", transcript="hi"),
        Image(data="iVBO", mime_type="image/png"),
        Delta(refusal="I can't"),
        Delta(content="ok", finish_reason="length"),
        Done(),
    ],
    "error-mid-stream": [
        Delta(content="partial "),
        Reasoning("hmm"),
        Delta(content="answer"),
        UPSTREAM_ERROR,
    ],
    "aborted": [Delta(content="cut "), Delta(content="short"), Done(aborted=True)],
    "blocks-between-texts": [
        Delta(content=""),
        Delta(content="one"),
        Delta(content=""),
        Delta(content=" two"),
        Reasoning("think"),
        Delta(content="three"),
        Delta(content=" four\n\n"),
        Delta(content=" five"),
        ToolCall(0, "call_1", "f", "{}"),
        Delta(content="six"),
        Delta(refusal="no"),
        Delta(content="seven"),
        Delta(content=" eight"),
        Delta(finish_reason="stop"),
        Done(),
    ],
    "done-only": [Done()],
    "error-only": [BAD_REQUEST],
}
LOG_PARAMS = [pytest.param(log, id=name) for name, log in LOGS.items()]


def split(log: Sequence[StreamEvent], rng: random.Random) -> list[Sequence[StreamEvent]]:
    """``log`` cut into batches at random places (empty batches included)."""
    cuts = sorted(rng.randint(0, len(log)) for _ in range(rng.randint(0, len(log) + 1)))
    bounds = [0, *cuts, len(log)]
    return [log[a:b] for a, b in pairwise(bounds)]


def render_chunks(
    encoder: type[Encoder],
    meta: StreamMeta,
    batches: Sequence[Sequence[StreamEvent]],
    after: Cursor | None = None,
) -> tuple[list[bytes], Renderer]:
    renderer = Renderer(encoder(meta), meta.id, ids=uses_event_ids(encoder), after=after)
    chunks = [renderer.begin()]
    chunks.extend(renderer.feed(batch) for batch in batches)
    return chunks, renderer


def render(
    encoder: type[Encoder],
    meta: StreamMeta,
    log: Sequence[StreamEvent],
    rng: random.Random | None = None,
    after: Cursor | None = None,
) -> tuple[bytes, Renderer]:
    batches = [log] if rng is None else split(log, rng)
    chunks, renderer = render_chunks(encoder, meta, batches, after)
    return b"".join(chunks), renderer


def dispatched(body: bytes) -> list[tuple[ServerSentEvent, int]]:
    """Each event the WHATWG decoder dispatches, with the offset just past its frame.

    Fed one byte at a time, so the offset is exactly where the dispatching blank line ends.
    """
    decoder = SSEDecoder()
    out: list[tuple[ServerSentEvent, int]] = []
    for offset in range(len(body)):
        out.extend((event, offset + 1) for event in decoder.decode(body[offset : offset + 1]))
    assert decoder.flush() == []
    return out


def raw_frames(body: bytes) -> list[tuple[bytes, int]]:
    """The frames of ``body`` (split at blank lines) with the offset just past each."""
    frames = []
    start = 0
    for match in re.finditer(rb"\n\n", body):
        frames.append((body[start : match.end()], match.end()))
        start = match.end()
    assert start == len(body), "the rendering ends with a complete frame"
    return frames


def order(cursor: Cursor) -> tuple[int, float]:
    return (cursor.step, math.inf if cursor.frame is None else cursor.frame)


def seeded(*parts: object) -> random.Random:
    return random.Random("-".join(map(str, parts)))


# --- the full rendering -----------------------------------------------------------------------


@pytest.mark.parametrize("meta", METAS)
@pytest.mark.parametrize("log", LOG_PARAMS)
@pytest.mark.parametrize("encoder", ENCODERS)
def test_rendering_does_not_depend_on_batches(
    encoder: type[Encoder], log: list[StreamEvent], meta: StreamMeta
) -> None:
    whole, renderer = render(encoder, meta, log)
    assert renderer.done
    assert renderer.wrote
    assert renderer.step == last_step(log)
    for attempt in range(5):
        body, again = render(encoder, meta, log, seeded(encoder.__name__, attempt))
        assert body == whole
        assert again.done
        assert again.step == last_step(log)


@pytest.mark.parametrize("meta", METAS)
@pytest.mark.parametrize("log", LOG_PARAMS)
@pytest.mark.parametrize("encoder", SSE_ENCODERS)
def test_every_sse_frame_has_an_id(
    encoder: type[Encoder], log: list[StreamEvent], meta: StreamMeta
) -> None:
    body, _ = render(encoder, meta, log, seeded("ids", encoder.__name__, len(log)))
    text = body.decode("utf-8")

    if meta.retry_ms is not None:
        assert text.startswith(f"retry: {meta.retry_ms}\n")
    else:
        assert "retry:" not in text.split("\n", 1)[0]

    # Raw text: every frame holds exactly one id line, naming this stream.
    cursors = []
    for frame, _ in raw_frames(body):
        lines = frame.decode("utf-8").split("\n")
        id_lines = [line for line in lines if line.startswith("id:")]
        assert len(id_lines) == 1, frame
        assert id_lines[0].startswith(f"id: {STREAM_ID}.")
        cursors.append(parse_cursor(id_lines[0].removeprefix("id: ")))
    assert all(cursor.stream_id == STREAM_ID for cursor in cursors)
    keys = [order(cursor) for cursor in cursors]
    assert keys == sorted(keys)
    assert len(set(keys)) == len(keys), "ids are unique"
    # Step 0 is the opening (native SSE has none without a retry); each log entry writes here.
    assert cursors[0].step == (0 if encoder(meta).start() else 1)
    assert cursors[-1] in (Cursor(STREAM_ID, len(log)), Cursor(STREAM_ID, last_step(log)))
    # A step's frames are numbered 0, 1, ... and the last one goes bare.
    by_step: dict[int, list[int | None]] = {}
    for cursor in cursors:
        by_step.setdefault(cursor.step, []).append(cursor.frame)
    for frames in by_step.values():
        assert frames == [*range(len(frames) - 1), None]

    # Decoded: every dispatched event carries such an id, in order.
    events = dispatched(body)
    assert events
    ids = [parse_cursor(event.id) for event, _ in events]
    assert all(cursor.stream_id == STREAM_ID for cursor in ids)
    assert [order(c) for c in ids] == sorted({order(c) for c in ids})
    if meta.retry_ms is not None and encoder is not NativeSSEEncoder:
        assert events[0][0].retry == meta.retry_ms


@pytest.mark.parametrize("meta", METAS)
@pytest.mark.parametrize("log", LOG_PARAMS)
def test_ndjson_has_no_ids(log: list[StreamEvent], meta: StreamMeta) -> None:
    body, _ = render(NDJSONEncoder, meta, log)
    lines = body.split(b"\n")
    assert lines[-1] == b""
    for line in lines[:-1]:
        assert isinstance(json.loads(line), dict)
    assert lines[-2] == b'{"type":"done"}'
    assert all(line.startswith(b'{"type":') for line in lines[:-1])


# --- resume -----------------------------------------------------------------------------


@pytest.mark.parametrize("meta", METAS)
@pytest.mark.parametrize("log", LOG_PARAMS)
@pytest.mark.parametrize("encoder", SSE_ENCODERS)
def test_resume_after_each_event_id_is_the_exact_suffix(
    encoder: type[Encoder], log: list[StreamEvent], meta: StreamMeta
) -> None:
    rng = seeded("resume", encoder.__name__, len(log), meta.retry_ms)
    full, _ = render(encoder, meta, log, rng)
    events = dispatched(full)
    assert events
    for event, end in events:
        # The Last-Event-ID a browser would send after this event.
        out, renderer = render(encoder, meta, log, rng, after=parse_cursor(event.id))
        assert out == full[end:], event.id
        assert renderer.done
        assert renderer.wrote is (end < len(full))


@pytest.mark.parametrize("meta", METAS)
@pytest.mark.parametrize("log", LOG_PARAMS)
@pytest.mark.parametrize("encoder", SSE_ENCODERS)
def test_resume_after_each_raw_frame_is_the_exact_suffix(
    encoder: type[Encoder], log: list[StreamEvent], meta: StreamMeta
) -> None:
    # Also frames that dispatch nothing (native SSE's retry-only opening frame).
    rng = seeded("raw", encoder.__name__, len(log), meta.retry_ms)
    full, _ = render(encoder, meta, log, rng)
    for frame, end in raw_frames(full):
        (line,) = re.findall(rb"^id: (.*)$", frame, flags=re.MULTILINE)
        out, _ = render(encoder, meta, log, rng, after=parse_cursor(line.decode()))
        assert out == full[end:], line


def _steps(body: bytes) -> set[int]:
    """The steps the ``id:`` lines of ``body`` name."""
    return {parse_cursor(i.decode()).step for i in re.findall(rb"^id: (.*)$", body, re.M)}


@pytest.mark.parametrize("meta", METAS)
@pytest.mark.parametrize("log", LOG_PARAMS)
@pytest.mark.parametrize("encoder", SSE_ENCODERS)
def test_written_counts_the_steps_the_client_got(
    encoder: type[Encoder], log: list[StreamEvent], meta: StreamMeta
) -> None:
    """``written`` (the events a response counts) is the steps whose bytes went out, in
    the first rendering and in one resumed after any frame: never a step that wrote
    nothing (a usage nobody asked for) or that a resume skipped."""
    rng = seeded("written", encoder.__name__, len(log), meta.retry_ms)
    full, renderer = render(encoder, meta, log, rng)
    assert renderer.written == len(_steps(full))
    for frame, _ in raw_frames(full):
        (line,) = re.findall(rb"^id: (.*)$", frame, flags=re.MULTILINE)
        out, resumed = render(encoder, meta, log, rng, after=parse_cursor(line.decode()))
        assert resumed.written == len(_steps(out)), line


@pytest.mark.parametrize("meta", METAS)
@pytest.mark.parametrize("log", LOG_PARAMS)
def test_written_counts_ndjson_lines(log: list[StreamEvent], meta: StreamMeta) -> None:
    body, renderer = render(NDJSONEncoder, meta, log, seeded("lines", len(log)))
    assert renderer.written == body.count(b"\n")
    for count in range(body.count(b"\n") + 1):
        out, resumed = render(NDJSONEncoder, meta, log, after=Cursor(None, count))
        assert resumed.written == out.count(b"\n"), count


def _ndjson_counts(log: list[StreamEvent]) -> Iterator[Any]:
    lines = len(render(NDJSONEncoder, PLAIN_META, log)[0].split(b"\n")) - 1
    for k in range(lines + 3):
        if type(log[-1]) is Error and k == lines - 1:
            continue  # see test_ndjson_resume_between_error_and_done_lines
        yield k


@pytest.mark.parametrize("meta", METAS)
@pytest.mark.parametrize("log", LOG_PARAMS)
def test_ndjson_resume_by_count_is_the_exact_suffix(
    log: list[StreamEvent], meta: StreamMeta
) -> None:
    rng = seeded("ndjson", len(log), meta.retry_ms)
    full, _ = render(NDJSONEncoder, meta, log, rng)
    lines = full.split(b"\n")[:-1]
    for k in _ndjson_counts(log):
        out, renderer = render(NDJSONEncoder, meta, log, rng, after=Cursor(None, k))
        assert out == b"".join(line + b"\n" for line in lines[k:]), k
        assert renderer.done
        assert renderer.wrote is (k < len(lines))


@pytest.mark.parametrize("log", [LOGS["error-mid-stream"], LOGS["error-only"]])
def test_ndjson_resume_between_error_and_done_lines(log: list[StreamEvent]) -> None:
    meta = PLAIN_META
    full, _ = render(NDJSONEncoder, meta, log)
    lines = full.split(b"\n")[:-1]
    assert lines[-1] == b'{"type":"done"}'
    assert json.loads(lines[-2])["type"] == "error"
    out, _ = render(NDJSONEncoder, meta, log, after=Cursor(None, len(lines) - 1))
    assert out == b'{"type":"done"}\n'


@pytest.mark.parametrize("log", LOG_PARAMS)
@pytest.mark.parametrize("encoder", ENCODERS)
def test_resume_at_or_after_the_terminal_step_writes_nothing(
    encoder: type[Encoder], log: list[StreamEvent]
) -> None:
    meta = RICH_META
    stream_id = STREAM_ID if uses_event_ids(encoder) else None
    terminal = last_step(log)
    for after in [
        Cursor(stream_id, terminal),
        Cursor(stream_id, terminal, 99),
        Cursor(stream_id, terminal + 1),
        Cursor(stream_id, 10**12 - 1),
    ]:
        for attempt in range(3):
            rng = seeded("end", encoder.__name__, attempt)
            chunks, renderer = render_chunks(encoder, meta, split(log, rng), after)
            assert chunks == [b""] * len(chunks), after
            assert renderer.done
            assert renderer.wrote is False
            assert renderer.step == terminal


@pytest.mark.parametrize("encoder", SSE_ENCODERS)
def test_resume_before_the_terminal_step_and_past_a_step_frames(encoder: type[Encoder]) -> None:
    # A frame index past the step's frames: the client has the whole step.
    meta = PLAIN_META
    log = LOGS["tool-calls"]
    full, _ = render(encoder, meta, log)
    for step in range(len(log)):
        whole_step, _ = render(encoder, meta, log, after=Cursor(STREAM_ID, step))
        past, _ = render(encoder, meta, log, after=Cursor(STREAM_ID, step, 999))
        assert past == whole_step
        assert full.endswith(whole_step)


@pytest.mark.parametrize("encoder", SSE_ENCODERS)
def test_resumed_frames_are_numbered_as_in_the_first_rendering(encoder: type[Encoder]) -> None:
    meta = RICH_META
    log = LOGS["reasoning-then-text"]
    full, _ = render(encoder, meta, log)
    full_ids = [event.id for event, _ in dispatched(full)]
    for index, event_id in enumerate(full_ids):
        out, _ = render(encoder, meta, log, after=parse_cursor(event_id))
        assert [event.id for event, _ in dispatched(out)] == full_ids[index + 1 :]


# --- fail() -------------------------------------------------------------------------------

GATEWAY_ERROR = Error(
    error_type="server_error", message="shutting down", code="server_shutting_down", retryable=True
)

# What the last events of each format look like after fail(): (SSE event name, data check).
FAIL_TAILS: dict[type[Encoder], list[str]] = {
    OpenAISSEEncoder: ["error", "message"],
    NativeSSEEncoder: ["error", "done"],
    AnthropicSSEEncoder: ["error"],
    ResponsesSSEEncoder: ["error", "response.failed"],
}


@pytest.mark.parametrize("prefix", [0, 1, 3])
@pytest.mark.parametrize("encoder", ENCODERS)
def test_fail_has_no_ids_and_ends_the_format(encoder: type[Encoder], prefix: int) -> None:
    meta = RICH_META
    log = LOGS["tool-calls"][:prefix]
    chunks, renderer = render_chunks(encoder, meta, [log])
    before = b"".join(chunks)
    out = renderer.fail(GATEWAY_ERROR)
    assert renderer.done
    assert renderer.wrote
    assert out
    if encoder is NDJSONEncoder:
        lines = out.split(b"\n")
        assert lines[-1] == b""
        assert [json.loads(line)["type"] for line in lines[:-1]] == ["error", "done"]
        return
    assert not re.search(rb"^id:", out, flags=re.MULTILINE)
    assert out.endswith(b"\n\n")
    events = [event for event, _ in dispatched(before + out)]
    tail = FAIL_TAILS[encoder]
    assert [event.event for event in events[-len(tail) :]] == tail
    if encoder is OpenAISSEEncoder:
        assert events[-1].data == "[DONE]"
        assert json.loads(events[-2].data)["error"]["code"] == "server_shutting_down"
    # The fail frames keep the id of the last logged frame (they are not in the log).
    ids = re.findall(rb"^id: (.*)$", before, flags=re.MULTILINE)
    if not ids:  # Anthropic's message_start waits for the first event: nothing before
        assert encoder is AnthropicSSEEncoder and prefix == 0 and before == b""
        return
    assert {event.id for event in events[-len(tail) :]} == {ids[-1].decode()}


@pytest.mark.parametrize("encoder", SSE_ENCODERS)
def test_fail_while_skipping_a_resume(encoder: type[Encoder]) -> None:
    meta = PLAIN_META
    log = LOGS["text"][:3]
    chunks, renderer = render_chunks(encoder, meta, [log], after=Cursor(STREAM_ID, 10))
    assert chunks == [b"", b""]
    assert not renderer.wrote
    out = renderer.fail(GATEWAY_ERROR)
    assert out
    assert renderer.wrote
    assert not re.search(rb"^id:", out, flags=re.MULTILINE)


# --- random content and batches ------------------------------------------------------------

_TEXT = st.one_of(
    st.text(max_size=12),
    st.sampled_from(
        ["\n\n", "\r\n\r\n", "\r", "data: x\n\n", "id: 1\n\n", ": c\n", "\u2028", "é🎉"]
    ),
)
_EVENT = st.one_of(
    st.builds(Delta, content=_TEXT),
    st.builds(Reasoning, _TEXT),
    st.builds(
        ToolCall,
        index=st.integers(0, 2),
        id=st.none() | st.just("call_x"),
        name=st.none() | st.just("f"),
        arguments=_TEXT,
    ),
)
_TERMINAL = st.sampled_from([Done(), Done(aborted=True), UPSTREAM_ERROR, BAD_REQUEST])


def _text_of(encoder: type[Encoder], body: bytes) -> str:
    """The answer text a client of the format reassembles from ``body``."""
    if encoder is NDJSONEncoder:
        objects = [json.loads(line) for line in body.split(b"\n")[:-1]]
        return "".join(o["delta"].get("content") or "" for o in objects if o["type"] == "delta")
    out: list[str] = []
    for event, _ in dispatched(body):
        if event.data == "[DONE]":
            continue
        data = json.loads(event.data)
        if encoder is OpenAISSEEncoder:
            for choice in data.get("choices", []):
                out.append(choice["delta"].get("content") or "")
        elif encoder is NativeSSEEncoder and data["type"] == "delta":
            out.append(data["delta"].get("content") or "")
        elif encoder is AnthropicSSEEncoder and data["type"] == "content_block_delta":
            if data["delta"]["type"] == "text_delta":
                out.append(data["delta"]["text"])
        elif encoder is ResponsesSSEEncoder and data["type"] == "response.output_text.delta":
            out.append(data["delta"])
    return "".join(out)


@pytest.mark.parametrize("encoder", ENCODERS)
@settings(max_examples=25, deadline=None, database=None)
@given(
    body=st.lists(_EVENT, max_size=8),
    terminal=_TERMINAL,
    retry=st.none() | st.integers(0, 10**6),
    data=st.data(),
)
def test_random_logs_render_and_resume_exactly(
    encoder: type[Encoder],
    body: list[StreamEvent],
    terminal: StreamEvent,
    retry: int | None,
    data: st.DataObject,
) -> None:
    meta = StreamMeta(id=STREAM_ID, model="m", created=1, include_usage=True, retry_ms=retry)
    log = [*body, terminal]
    cuts = data.draw(st.lists(st.integers(0, len(log)), max_size=len(log) + 1).map(sorted))
    batches = [log[a:b] for a, b in pairwise([0, *cuts, len(log)])]

    # The same bytes, batch by batch, as when each prefix is rendered in one go.
    chunks, renderer = render_chunks(encoder, meta, batches)
    assert renderer.done
    full = b"".join(chunks)
    position = 0
    for index, batch in enumerate(batches):
        position += len(batch)
        prefix_chunks, _ = render_chunks(encoder, meta, [log[:position]])
        assert b"".join(chunks[: index + 2]) == b"".join(prefix_chunks)
    whole, _ = render(encoder, meta, log)
    assert full == whole

    # Content with blank lines and any unicode still frames correctly.
    expected = "".join(e.content or "" for e in body if type(e) is Delta)
    assert _text_of(encoder, full) == expected

    if not uses_event_ids(encoder):
        # Every event before the terminal is one line: a count resumes after that many lines.
        k = data.draw(st.integers(0, len(body)))
        out, _ = render(encoder, meta, log, random.Random(k), after=Cursor(None, k))
        lines = full.split(b"\n")[:-1]
        assert out == b"".join(line + b"\n" for line in lines[k:])
        return
    events = dispatched(full)
    assert all(event.data == "[DONE]" or json.loads(event.data) for event, _ in events)
    event, end = data.draw(st.sampled_from(events))
    rng = random.Random(end)
    out, _ = render(encoder, meta, log, rng, after=parse_cursor(event.id))
    assert out == full[end:]


# --- the SDK decoders' persistent-id quirk (docs/protocols.md §1) --------------------------------


def with_heartbeats(renderer: Renderer, chunks: list[bytes], rng: random.Random) -> list[bytes]:
    """The chunks as a pump writes them when idle now and then: heartbeats between frames."""
    out = [renderer.heartbeat()]
    for chunk in chunks:
        for frame, _ in raw_frames(chunk) if chunk else []:
            out.append(frame)
            out.extend(renderer.heartbeat() for _ in range(rng.randint(0, 2)))
        out.append(renderer.heartbeat())
    return out


SDK_DECODERS = [
    pytest.param(OpenAISSEEncoder, OpenAISDKDecoder, id="openai-chat"),
    pytest.param(ResponsesSSEEncoder, OpenAISDKDecoder, id="openai-responses"),
    pytest.param(AnthropicSSEEncoder, AnthropicSDKDecoder, id="anthropic-messages"),
]


@pytest.mark.parametrize("meta", METAS)
@pytest.mark.parametrize("log", LOG_PARAMS)
@pytest.mark.parametrize(("encoder", "decoder_cls"), SDK_DECODERS)
def test_sdk_decoder_sees_no_empty_events_with_heartbeats(
    encoder: type[Encoder], decoder_cls: Any, log: list[StreamEvent], meta: StreamMeta
) -> None:
    rng = seeded("sdk", encoder.__name__, len(log))
    batches = split(log, rng)
    chunks, renderer = render_chunks(encoder, meta, batches)
    stream = with_heartbeats(renderer, chunks, rng)
    assert renderer.heartbeat() in stream

    # Also cut anywhere, as TCP may.
    joined = b"".join(stream)
    cuts = sorted(rng.sample(range(len(joined)), min(20, len(joined))))
    pieces = [joined[a:b] for a, b in pairwise([0, *cuts, len(joined)])]

    frames = [frame for chunk in chunks for frame, _ in raw_frames(chunk)]
    for feed in (stream, pieces):
        events = list(decoder_cls().iter_bytes(iter(feed)))
        if encoder is AnthropicSSEEncoder:
            # Its heartbeat is a real `event: ping` frame.
            events = [event for event in events if event.event != "ping"]
        assert len(events) == len(frames)
        for event in events:
            assert event.data, event
            if event.data != "[DONE]":
                assert isinstance(json.loads(event.data), dict)
            assert event.id is not None
            assert event.id.startswith(f"{STREAM_ID}.")


@pytest.mark.parametrize(("encoder", "decoder_cls"), SDK_DECODERS)
def test_sdk_decoder_after_fail_with_heartbeats(encoder: type[Encoder], decoder_cls: Any) -> None:
    meta = RICH_META
    chunks, renderer = render_chunks(encoder, meta, [LOGS["text"][:3]])
    stream = [*chunks, renderer.heartbeat(), renderer.fail(GATEWAY_ERROR), renderer.heartbeat()]
    events = list(decoder_cls().iter_bytes(iter(stream)))
    events = [event for event in events if event.event != "ping"]
    assert events
    for event in events:
        assert event.data
        assert event.data == "[DONE]" or isinstance(json.loads(event.data), dict)


def last_step(log: list[StreamEvent]) -> int:
    """The terminal step: a failed or aborted stream has one more, error then terminator."""
    end = log[-1]
    return len(log) + (1 if type(end) is Error or (type(end) is Done and end.aborted) else 0)


def test_ids_count_on_over_thousands_of_steps() -> None:
    log: list[StreamEvent] = [Delta(content=f"t{i}") for i in range(4200)] + [Done()]
    data, _ = render(OpenAISSEEncoder, PLAIN_META, log, random.Random(7))
    steps = [int(line.rsplit(b".", 1)[1]) for line in data.split(b"\n") if line.startswith(b"id: ")]
    assert steps == list(range(4202))


def test_a_subclass_that_overrides_encode_is_called_for_content_deltas() -> None:
    # A subclass with its own encode() (a redacting one, say) gets every event.
    class Redacting(NDJSONEncoder):
        def encode(self, event: StreamEvent) -> bytes:
            return super().encode(event).replace(b"secret", b"******")

    data, _ = render(Redacting, PLAIN_META, [Delta(content="my secret"), Done()])
    assert b"secret" not in data and b"my ******" in data


class _UnterminatedSSE(Encoder):
    """An integrator's SSE encoder whose frames lack the closing blank line."""

    media_type = "text/event-stream"

    def encode(self, event: StreamEvent) -> bytes:
        return b"event: " + type(event).type.encode() + b"\ndata: {}"


def test_a_frame_without_its_blank_line_does_not_hang_the_renderer() -> None:
    """A plugin's frame that does not end in a newline is rendered (with its id), not
    scanned for ever: that loop would hold the event loop and every stream with it."""
    import signal

    def hung(signum: int, frame: Any) -> None:
        raise TimeoutError("Renderer.feed did not return")

    meta = StreamMeta.new("m", include_usage=False, provider="mock", upstream_model="m")
    renderer = Renderer(_UnterminatedSSE(meta), meta.id, ids=True)
    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(2)
    try:
        out = renderer.feed([Delta(content="hi")])
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert out == b"id: " + meta.id.encode() + b".1\nevent: delta\ndata: {}"


@pytest.mark.parametrize("encoder", [NDJSONEncoder, OpenAISSEEncoder, AnthropicSSEEncoder])
def test_an_aborted_log_never_reads_as_a_whole_answer(encoder: type[Encoder]) -> None:
    """A log that ends aborted (a realtime turn's abort, its last reader gone) read later
    (GET /v1/streams/{id}) ended like a finished one: a clean terminator after the part
    that was written. It ends with a stream_cancelled error, as a failed stream does."""
    meta = StreamMeta.new("mock/echo")
    body, _ = render(encoder, meta, [Delta(content="cut "), Done(aborted=True)])
    assert b"stream_cancelled" in body
    whole, _ = render(encoder, meta, [Delta(content="whole"), Done()])
    assert b"stream_cancelled" not in whole
