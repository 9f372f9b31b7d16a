"""The store down when a run's last reader here has left: the run cannot count its readers
elsewhere (none can read it through a store that is down), so it ends as abandoned, with a
warning, not an ERROR and a traceback for every such stream of the outage."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator

import pytest

from nexus.cache.readers import RunReader
from nexus.cache.run import StreamRun
from nexus.cache.store import StreamInfo
from nexus.errors import StoreUnavailable
from nexus.events import Delta, Error, StreamEvent
from nexus.stream import Stream
from nexus.types import StreamMeta
from nexus.watchdog import Watchdog


async def test_a_lease_check_in_an_outage_ends_the_run_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    gate: asyncio.Queue[list[StreamEvent] | None] = asyncio.Queue()

    async def source() -> AsyncGenerator[list[StreamEvent], None]:
        while (batch := await gate.get()) is not None:
            yield batch

    async def held(resumable: bool) -> tuple[float, bool]:
        raise StoreUnavailable("The stream store cannot be reached right now; retry shortly.")

    meta = StreamMeta.new("mock/echo")
    run = StreamRun(
        StreamInfo(meta, "text/event-stream"),
        Stream.of_batches(source(), meta),
        detach_timeout_s=0.01,
        max_log_bytes=1 << 20,
        watchdog=Watchdog(),
        held=held,
    )
    run.start()
    reader = RunReader(run)
    await gate.put([Delta("a")])
    assert await anext(reader) == [Delta("a")]
    with caplog.at_level(logging.WARNING, logger="nexus"):
        await reader.close()
        async with asyncio.timeout(2):
            await run.done
    last = run.events[-1]
    assert isinstance(last, Error), last
    assert "cannot be counted: store_unavailable" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
