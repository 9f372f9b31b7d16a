"""Stream, Channel and accumulate: reading a completion, closing it, merging it."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncGenerator, Sequence

import pytest

from nexus import Engine, MockProvider, Provider
from nexus.errors import StreamError
from nexus.events import (
    Audio,
    Citation,
    Delta,
    Error,
    Image,
    Reasoning,
    StreamEvent,
    ToolCall,
    Usage,
)
from nexus.request import ChatRequest
from nexus.stream import Channel, EndOfStream, Stream, accumulate, merge_events
from nexus.types import CompletedToolCall, ReasoningBlock, StreamMeta
from support import GatedProvider

EVENTS: list[StreamEvent] = [
    Delta(role="assistant"),
    Delta(content="Hello"),
    Delta(content=" world"),
    Delta(finish_reason="stop"),
    Usage(prompt_tokens=3, completion_tokens=2, total_tokens=5),
]


class Recorder:
    """A hand-written provider generator that records what happened to it."""

    def __init__(self, events: Sequence[StreamEvent] = EVENTS, *, sleep_after: int | None = None):
        self.events = list(events)
        self.sleep_after = sleep_after
        self.log: list[str] = []
        self.produced = 0

    async def gen(self) -> AsyncGenerator[StreamEvent, None]:
        try:
            for i, event in enumerate(self.events):
                if self.sleep_after is not None and i == self.sleep_after:
                    self.log.append("sleeping")
                    await asyncio.sleep(10)
                self.produced += 1
                yield event
        finally:
            self.log.append("finally")

    def stream(self) -> Stream:
        return Stream(self.gen(), StreamMeta.new("test/model"))


async def settle() -> None:
    """Let every ready task run until it blocks."""
    for _ in range(20):
        await asyncio.sleep(0)


def chat(content: str = "Hello there world", **extra: object) -> dict[str, object]:
    return {"model": "mock/echo", "messages": [{"role": "user", "content": content}], **extra}


# --- Stream ------------------------------------------------------------------


async def test_async_for_yields_events_in_order() -> None:
    rec = Recorder()
    stream = rec.stream()
    assert [e async for e in stream] == EVENTS
    assert rec.log == ["finally"]


async def test_next_returns_events_then_raises_end_of_stream_twice() -> None:
    stream = Recorder().stream()
    got = [await stream.next() for _ in EVENTS]
    assert got == EVENTS
    with pytest.raises(EndOfStream):
        await stream.next()
    with pytest.raises(EndOfStream):
        await stream.next()


async def test_close_runs_provider_finally_before_returning_and_is_idempotent() -> None:
    rec = Recorder()
    stream = rec.stream()
    assert await stream.next() == EVENTS[0]
    assert rec.log == []
    await stream.close()
    assert rec.log == ["finally"]
    await stream.close()
    assert rec.log == ["finally"]
    with pytest.raises(EndOfStream):
        await stream.next()


async def test_async_with_closes_the_stream() -> None:
    rec = Recorder()
    async with rec.stream() as stream:
        assert await stream.next() == EVENTS[0]
        assert await stream.next() == EVENTS[1]
    assert rec.log == ["finally"]
    assert rec.produced == 2


async def test_stream_over_engine_and_mock_provider() -> None:
    engine = Engine([MockProvider("mock")])
    async with engine.complete_stream(chat("one two three")) as stream:
        events = [e async for e in stream]
    assert events[:3] == [Delta(content="one"), Delta(content=" two"), Delta(content=" three")]
    assert events[3] == Delta(finish_reason="stop")
    assert type(events[4]) is Usage
    assert len(events) == 5


async def test_close_over_engine_runs_provider_finally() -> None:
    rec = Recorder()

    class Hand(Provider):
        kind = "hand"

        async def batches(
            self, request: ChatRequest, model: str
        ) -> AsyncGenerator[list[StreamEvent], None]:
            events = rec.gen()
            try:
                async for event in events:
                    yield [event]
            finally:
                await events.aclose()

    engine = Engine([Hand("hand")])
    stream = engine.complete_stream(chat(model="hand/x"))
    assert await stream.next() == EVENTS[0]
    await stream.close()
    assert rec.log == ["finally"]


async def test_close_while_provider_sleeps_returns_quickly_and_runs_finally() -> None:
    rec = Recorder(sleep_after=1)
    stream = rec.stream()
    assert await stream.next() == EVENTS[0]
    reader = asyncio.create_task(stream.next())
    await settle()
    assert rec.log == ["sleeping"]
    loop = asyncio.get_running_loop()
    start = loop.time()
    try:
        await stream.close()
        assert loop.time() - start < 1.0
        assert rec.log == ["sleeping", "finally"]
    finally:
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)


class Reads:
    """Batches that are not a generator: a coroutine ``__anext__`` waiting on a future."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.gate: asyncio.Future[list[StreamEvent]] | None = None

    def __aiter__(self) -> Reads:
        return self

    async def __anext__(self) -> list[StreamEvent]:
        self.gate = asyncio.get_running_loop().create_future()
        self.log.append("reading")
        return await self.gate

    async def aclose(self) -> None:
        self.log.append("closed")


async def test_a_stream_of_batches_that_is_no_generator_reads_and_closes() -> None:
    source = Reads()
    stream = Stream.of_batches(source, StreamMeta.new("test/model"))
    reader = asyncio.create_task(stream.read_batch())
    await settle()
    assert source.gate is not None
    source.gate.set_result(EVENTS[:2])
    assert await reader == EVENTS[:2]
    # Closed from another task while a read waits: the read ends the stream.
    reader = asyncio.create_task(stream.read_batch())
    await settle()
    await stream.close()
    assert await reader == []
    assert source.log == ["reading", "reading", "closed"]


# --- Channel -----------------------------------------------------------------


async def test_channel_yields_all_events_in_order() -> None:
    rec = Recorder()
    async with rec.stream().channel(buffer=2) as channel:
        assert [e async for e in channel] == EVENTS
    assert rec.log == ["finally"]


async def test_channel_next_raises_end_of_stream_at_the_end() -> None:
    channel = Recorder().stream().channel(buffer=2)
    got = [await channel.next() for _ in EVENTS]
    assert got == EVENTS
    with pytest.raises(EndOfStream):
        await channel.next()
    with pytest.raises(EndOfStream):
        await channel.next()
    await channel.close()


async def test_channel_reads_ahead_by_at_most_buffer_plus_one() -> None:
    events = [Delta(content=str(i)) for i in range(10)]
    rec = Recorder(events)
    channel = rec.stream().channel(buffer=2)
    await settle()
    assert 2 <= rec.produced <= 3
    assert await channel.next() == events[0]
    await settle()
    assert 3 <= rec.produced <= 4
    rest = [e async for e in channel]
    assert rest == events[1:]
    assert rec.produced == 10
    await channel.close()


async def test_channel_over_engine_matches_direct_reading() -> None:
    engine = Engine([MockProvider("mock")])
    async with engine.complete_stream(chat("a b c d e")) as stream:
        direct = [e async for e in stream]
    async with engine.complete_stream(chat("a b c d e")).channel(buffer=2) as channel:
        assert channel.meta.provider == "mock"
        via_channel = [e async for e in channel]
    assert via_channel == direct
    assert len(direct) == 7


async def test_channel_propagates_provider_exception_before_any_event() -> None:
    async def failing() -> AsyncGenerator[StreamEvent, None]:
        raise ValueError("boom")
        yield Delta(content="never")  # pragma: no cover

    channel = Stream(failing(), StreamMeta.new("m")).channel(buffer=2)
    with pytest.raises(ValueError, match="boom"):
        await channel.next()
    await channel.close()

    channel = Stream(failing(), StreamMeta.new("m")).channel(buffer=2)
    with pytest.raises(ValueError, match="boom"):
        async for _ in channel:
            pass
    await channel.close()


async def test_channel_delivers_events_before_the_exception() -> None:
    async def failing() -> AsyncGenerator[StreamEvent, None]:
        yield Delta(content="a")
        raise RuntimeError("late")

    channel = Stream(failing(), StreamMeta.new("m")).channel(buffer=4)
    assert await channel.next() == Delta(content="a")
    with pytest.raises(RuntimeError, match="late"):
        await channel.next()
    await channel.close()


async def test_channel_close_stops_producer_and_runs_finally() -> None:
    rec = Recorder([Delta(content=str(i)) for i in range(100)])
    channel = rec.stream().channel(buffer=1)
    await settle()
    assert await channel.next() == Delta(content="0")
    await channel.close()
    produced = rec.produced
    assert rec.log == ["finally"]
    await settle()
    assert rec.produced == produced < 100
    with pytest.raises(EndOfStream):
        await channel.next()


async def test_channel_close_while_provider_sleeps_is_quick() -> None:
    rec = Recorder(sleep_after=1)
    channel = rec.stream().channel(buffer=2)
    assert await channel.next() == EVENTS[0]
    await settle()
    assert rec.log == ["sleeping"]
    loop = asyncio.get_running_loop()
    start = loop.time()
    await channel.close()
    assert loop.time() - start < 1.0
    assert rec.log == ["sleeping", "finally"]


async def test_channel_buffer_zero_is_rejected() -> None:
    stream = Recorder().stream()
    with pytest.raises(ValueError, match="buffer"):
        stream.channel(buffer=0)
    await stream.close()


# --- accumulate --------------------------------------------------------------


async def test_accumulate_concatenates_content_and_reasoning() -> None:
    rec = Recorder(
        [
            Reasoning("Let me "),
            Reasoning("think."),
            Delta(role="assistant"),
            Delta(content="Hel"),
            Delta(content="lo"),
            Delta(finish_reason="stop"),
        ]
    )
    stream = rec.stream()
    result = await accumulate(stream)
    assert result.content == "Hello"
    assert result.reasoning == "Let me think."
    assert result.role == "assistant"
    assert result.finish_reason == "stop"
    assert result.refusal is None
    assert result.tool_calls == []
    assert result.usage is None
    assert result.id == stream.meta.id
    assert result.model == "test/model"
    assert rec.log == ["finally"]


async def test_accumulate_merges_two_tool_calls_by_index() -> None:
    rec = Recorder(
        [
            ToolCall(index=0, id="call_a", name="get_weather", arguments=""),
            ToolCall(index=1, id="call_b", name="get_time", arguments='{"tz":'),
            ToolCall(index=0, arguments='{"city":'),
            ToolCall(index=0, name="ignored", arguments='"Paris"}'),
            ToolCall(index=1, arguments='"UTC"}'),
            Delta(finish_reason="tool_calls"),
        ]
    )
    result = await accumulate(rec.stream())
    assert result.tool_calls == [
        CompletedToolCall(index=0, id="call_a", name="get_weather", arguments='{"city":"Paris"}'),
        CompletedToolCall(index=1, id="call_b", name="get_time", arguments='{"tz":"UTC"}'),
    ]
    assert result.finish_reason == "tool_calls"


async def test_accumulate_merges_a_repeated_id_by_id() -> None:
    rec = Recorder(
        [
            ToolCall(index=0, id="call_x", name="f", arguments='{"a":'),
            ToolCall(index=3, id="call_x", arguments="1}"),
        ]
    )
    result = await accumulate(rec.stream())
    assert result.tool_calls == [
        CompletedToolCall(index=0, id="call_x", name="f", arguments='{"a":1}')
    ]


@pytest.mark.parametrize("index", [0, 2])
async def test_accumulate_keeps_apart_calls_that_share_an_index(index: int) -> None:
    """Some upstreams give every call the same index (or none, read as 0): a new id for an
    index whose call has another begins a call of its own, and the fragments after it
    (no id) are its."""
    rec = Recorder(
        [
            ToolCall(index=index, id="call_A", name="fa", arguments='{"x":1}'),
            Delta(content="between"),
            ToolCall(index=index, id="call_B", name="fb", arguments='{"y":'),
            ToolCall(index=index, arguments="2}"),
        ]
    )
    result = await accumulate(rec.stream())
    assert result.tool_calls == [
        CompletedToolCall(index=index, id="call_A", name="fa", arguments='{"x":1}'),
        CompletedToolCall(index=index + 1, id="call_B", name="fb", arguments='{"y":2}'),
    ]
    assert result.text_runs == [(1, "between")]


def test_reasoning_is_kept_block_by_block_in_its_place() -> None:
    """A signature ends its block; a redacted block stands alone; each block knows how many
    text runs and tool calls came before it (Anthropic checks each block's signature)."""
    meta = StreamMeta(id="chatcmpl-1", model="m", created=1)
    events = [
        Reasoning("A"),
        Reasoning("."),
        Reasoning("", signature="SIG_A"),
        Reasoning("", redacted="BLOB"),
        ToolCall(index=0, id="toolu_1", name="f", arguments="{}"),
        Reasoning("B."),
        Reasoning("", signature="SIG_B"),
        Reasoning("C."),
        Reasoning("", signature="SIG_C"),
        Delta(content="Done."),
    ]
    result = merge_events(events, meta)
    assert result.reasoning_blocks == [
        ReasoningBlock("A.", "SIG_A", after=0),
        ReasoningBlock("", redacted="BLOB", after=0),
        ReasoningBlock("B.", "SIG_B", after=1),
        ReasoningBlock("C.", "SIG_C", after=1),
    ]
    assert (result.reasoning, result.reasoning_signature) == ("A.B.C.", "SIG_C")
    assert result.text_runs == [(1, "Done.")]


async def test_accumulate_reads_tool_calls_inside_deltas() -> None:
    rec = Recorder(
        [
            Delta(tool_calls=(ToolCall(index=0, id="call_1", name="g", arguments=""),)),
            Delta(tool_calls=(ToolCall(index=0, arguments="{}"),)),
        ]
    )
    stream = rec.stream()
    result = await accumulate(stream)
    assert result.tool_calls == [CompletedToolCall(index=0, id="call_1", name="g", arguments="{}")]


async def test_accumulate_gives_a_call_without_arguments_an_empty_object() -> None:
    """Whatever the upstream sent for a tool that takes none ("" or nothing): "" is not JSON."""
    rec = Recorder(
        [
            ToolCall(index=0, id="call_1", name="now", arguments=""),
            ToolCall(index=1, id="call_2", name="later"),
            ToolCall(index=1, arguments=""),
            Delta(finish_reason="tool_calls"),
        ]
    )
    result = await accumulate(rec.stream())
    assert [call.arguments for call in result.tool_calls] == ["{}", "{}"]


async def test_accumulate_names_a_tool_call_without_id() -> None:
    stream = Recorder([ToolCall(index=2, name="h", arguments="[]")]).stream()
    result = await accumulate(stream)
    assert result.tool_calls == [
        CompletedToolCall(index=2, id=f"call_{stream.meta.id[-12:]}_2", name="h", arguments="[]")
    ]


async def test_accumulate_takes_usage_from_the_last_usage_event() -> None:
    last = Usage(prompt_tokens=4, completion_tokens=6, total_tokens=10, reasoning_tokens=2)
    rec = Recorder(
        [
            Usage(prompt_tokens=4, completion_tokens=0, total_tokens=4),
            Delta(content="x"),
            last,
        ]
    )
    result = await accumulate(rec.stream())
    assert result.usage == last


async def test_accumulate_collects_refusal_citations_audio_and_images() -> None:
    citation = Citation(url="https://example.com", title="Ex", quoted="q")
    audio = [Audio(data="AAA=", format="pcm16"), Audio(transcript="hi")]
    image = Image(url="https://example.com/a.png", mime_type="image/png")
    rec = Recorder(
        [
            Delta(refusal="I can't "),
            citation,
            audio[0],
            Delta(refusal="help."),
            audio[1],
            image,
            Delta(finish_reason="stop"),
        ]
    )
    result = await accumulate(rec.stream())
    assert result.refusal == "I can't help."
    assert result.citations == [citation]
    assert result.audio == audio
    assert result.images == [image]
    assert result.content == ""


async def test_accumulate_raises_stream_error_and_closes_the_stream() -> None:
    error = Error(
        error_type="upstream_error",
        message="upstream went away",
        code="upstream_timeout",
        retryable=True,
    )
    rec = Recorder([Delta(content="partial"), error, Delta(content="never read")])
    with pytest.raises(StreamError) as info:
        await accumulate(rec.stream())
    exc = info.value
    assert exc.code == "upstream_timeout"
    assert exc.message == "upstream went away"
    assert exc.retryable is True
    assert exc.status == 504
    assert exc.event == error
    assert rec.log == ["finally"]
    assert rec.produced == 2


async def test_accumulate_over_a_channel() -> None:
    rec = Recorder()
    channel = rec.stream().channel(buffer=2)
    assert isinstance(channel, Channel)
    result = await accumulate(channel)
    assert result.content == "Hello world"
    assert result.usage == EVENTS[-1]
    assert rec.log == ["finally"]


def test_an_early_partial_usage_never_replaces_the_totals() -> None:
    meta = StreamMeta(id="chatcmpl-1", model="m", created=1)
    early = Usage(41, 0, 41, partial=True)
    totals = Usage(41, 5, 46)
    assert merge_events([early, Delta("hi"), totals], meta).usage == totals
    assert merge_events([totals, early], meta).usage == totals
    # A stream cut short keeps what it knew: the input counts.
    assert merge_events([early, Delta("hi")], meta).usage == early


async def test_a_channel_dropped_without_close_stops_its_provider() -> None:
    """Its filling task held the channel: a dropped channel was never collected, and its
    provider (an upstream connection) stayed open until the loop ended."""
    gated = GatedProvider(before=3)
    async with Engine([gated]) as engine:
        channel = engine.complete_stream(chat("hi", model="gated/x")).channel(buffer=1)
        await channel.next()
        task = channel._task
        with pytest.warns(ResourceWarning, match="channel was not closed"):
            del channel
            gc.collect()
        await asyncio.wait_for(gated.closed.wait(), 2)
        await asyncio.sleep(0)
        assert task.done()
