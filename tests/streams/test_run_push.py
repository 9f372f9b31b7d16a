"""A run pushes each new batch to a caught-up reader's sink, in the producer's task."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nexus.cache.readers import RunReader
from nexus.cache.run import StreamRun
from nexus.cache.store import StreamInfo
from nexus.events import Delta, Done, StreamEvent
from nexus.stream import Stream
from nexus.types import StreamMeta
from nexus.watchdog import Watchdog


def gated_run(gate: asyncio.Queue[list[StreamEvent] | None]) -> StreamRun:
    """A run whose source yields what is put on ``gate`` (None ends it)."""

    async def source() -> AsyncGenerator[list[StreamEvent], None]:
        while (batch := await gate.get()) is not None:
            yield batch

    meta = StreamMeta.new("mock/echo")
    run = StreamRun(
        StreamInfo(meta, "text/event-stream"),
        Stream.of_batches(source(), meta),
        detach_timeout_s=0,
        max_log_bytes=1 << 20,
        watchdog=Watchdog(),
    )
    run.start()
    return run


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_sink_takes_batches_while_the_reader_sleeps() -> None:
    gate: asyncio.Queue[list[StreamEvent] | None] = asyncio.Queue()
    run = gated_run(gate)
    reader = RunReader(run)
    pushed: list[tuple[list[StreamEvent], asyncio.Task[object] | None]] = []

    def sink(batch: list[StreamEvent]) -> bool:
        pushed.append((batch, asyncio.current_task()))
        return True

    reader.sink = sink
    read = asyncio.ensure_future(anext(reader))
    await settle()
    await gate.put([Delta("a")])
    await gate.put([Delta("b"), Delta("c")])
    await settle()
    assert [batch for batch, _ in pushed] == [[Delta("a")], [Delta("b"), Delta("c")]]
    assert all(task is run._task for _, task in pushed)  # written by the producer
    assert not read.done()  # the reader's task was not woken for them
    await gate.put(None)  # the end is never pushed: it wakes the reader
    assert await asyncio.wait_for(read, 1) == [Done()]
    with pytest.raises(StopAsyncIteration):
        await anext(reader)
    await reader.close()


async def test_a_declined_batch_is_returned_by_the_reader() -> None:
    gate: asyncio.Queue[list[StreamEvent] | None] = asyncio.Queue()
    run = gated_run(gate)
    reader = RunReader(run)
    reader.sink = lambda batch: False
    read = asyncio.ensure_future(anext(reader))
    await settle()
    await gate.put([Delta("a")])
    assert await asyncio.wait_for(read, 1) == [Delta("a")]
    await gate.put(None)
    await reader.close()


async def test_what_a_sink_raised_is_raised_by_the_next_read_and_the_batch_is_not_read_twice() -> (
    None
):
    gate: asyncio.Queue[list[StreamEvent] | None] = asyncio.Queue()
    run = gated_run(gate)
    reader = RunReader(run)

    def sink(batch: list[StreamEvent]) -> bool:
        raise ConnectionResetError("client gone")

    reader.sink = sink
    read = asyncio.ensure_future(anext(reader))
    await settle()
    await gate.put([Delta("a")])
    with pytest.raises(ConnectionResetError):
        await asyncio.wait_for(read, 1)
    reader.sink = None
    await gate.put([Delta("b")])
    assert await asyncio.wait_for(anext(reader), 1) == [Delta("b")]
    await gate.put(None)
    await reader.close()


async def test_a_reader_behind_the_log_is_not_pushed_to() -> None:
    gate: asyncio.Queue[list[StreamEvent] | None] = asyncio.Queue()
    run = gated_run(gate)
    await gate.put([Delta("a")])
    await settle()
    reader = RunReader(run)
    reader.sink = lambda batch: True
    # Caught up only after returning the backlog; its own read gets what came meanwhile.
    assert await asyncio.wait_for(anext(reader), 1) == [Delta("a")]
    assert not reader._push([Delta("x")])  # not at the end of the log: refused
    await gate.put(None)
    await reader.close()


@settings(max_examples=60, deadline=None, database=None)
@given(
    batches=st.lists(st.lists(st.sampled_from("abcxyz"), min_size=1, max_size=4), max_size=12),
    takes=st.lists(st.booleans(), min_size=12, max_size=12),
    pauses=st.lists(st.booleans(), min_size=12, max_size=12),
)
def test_pushed_and_read_batches_together_are_the_log_in_order(
    batches: list[list[str]], takes: list[bool], pauses: list[bool]
) -> None:
    """The push is a fast path beside the reader's own reads: whatever the sink takes or
    declines, and however the reader's task is scheduled, one reader sees every entry of
    the log once, in order, exactly as a reader without a sink does."""

    async def scenario() -> list[StreamEvent]:
        gate: asyncio.Queue[list[StreamEvent] | None] = asyncio.Queue()
        run = gated_run(gate)
        reader = RunReader(run)
        seen: list[StreamEvent] = []
        decisions = iter(takes)

        def sink(batch: list[StreamEvent]) -> bool:
            if next(decisions, True):
                seen.extend(batch)
                return True
            return False

        reader.sink = sink

        async def consume() -> None:
            async for batch in reader:
                seen.extend(batch)

        consumer = asyncio.ensure_future(consume())
        for texts, pause in zip(batches, pauses, strict=False):
            await gate.put([Delta(text) for text in texts])
            if pause:
                await settle()
        await gate.put(None)
        await asyncio.wait_for(consumer, 2)
        await reader.close()
        return seen

    expected = [Delta(text) for texts in batches for text in texts] + [Done()]
    assert asyncio.run(scenario()) == expected
