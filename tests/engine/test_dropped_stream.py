"""A stream dropped before its end without ``close()`` (``async for ...: break``) had
its upstream connection, and its pool slot, held for good when the engine had no plugin:
nothing closed a source that is not an async generator."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import pytest

from nexus import ChatRequest, Delta, Engine, Hooks, Provider, StreamEvent
from nexus.events import Error


class Connection:
    """A provider's batches that hold a connection until closed, as an HTTP one's do (a
    plain object: no async generator for asyncio to close when it is collected)."""

    def __init__(self, held: set[Connection]) -> None:
        self.held = held
        held.add(self)

    def __aiter__(self) -> Connection:
        return self

    async def __anext__(self) -> list[StreamEvent]:
        return [Delta(content="word ")]  # endless

    async def aclose(self) -> None:
        self.held.discard(self)


class Pooled(Provider):
    def __init__(self) -> None:
        super().__init__("pooled")
        self.held: set[Connection] = set()

    def batches(self, request: ChatRequest, model: str) -> Connection:
        return Connection(self.held)


class Ends:
    def __init__(self) -> None:
        self.codes: list[str | None] = []

    async def on_stream_completed(self, *args: Any) -> None:
        self.codes.append("completed")

    async def on_stream_failed(self, ctx: Any, request_id: str, model: str, error: Error) -> None:
        self.codes.append(error.code)


BODY = {"model": "pooled/m", "messages": [{"role": "user", "content": "hi"}]}


async def collected() -> None:
    """Collect what was dropped, then let the loop run the closes it scheduled."""
    gc.collect()
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_dropped_stream_gives_its_connection_back() -> None:
    provider = Pooled()
    async with Engine([provider]) as engine:
        for _ in range(3):
            stream = await engine.open_stream(BODY)
            async for _event in stream:
                break
        assert len(provider.held) == 3
        with pytest.warns(ResourceWarning, match="was not closed"):
            del stream
            await collected()
        assert provider.held == set()


async def test_a_dropped_complete_stream_gives_its_connection_back() -> None:
    provider = Pooled()
    async with Engine([provider]) as engine:
        stream = engine.complete_stream(BODY)
        assert isinstance(await stream.next(), Delta)
        with pytest.warns(ResourceWarning):
            del stream
            await collected()
        assert provider.held == set()


async def test_a_dropped_watched_stream_ends_with_its_hooks_read_or_not() -> None:
    provider, ends = Pooled(), Ends()
    hooks = Hooks()
    hooks.add(ends)
    async with Engine([provider], hooks=hooks) as engine:
        read = await engine.open_stream(BODY)
        await read.next()
        unread = await engine.open_stream(BODY)
        with pytest.warns(ResourceWarning):
            del read, unread
            await collected()
        assert provider.held == set()
        assert ends.codes == ["stream_cancelled", "stream_cancelled"]


async def test_a_closed_or_finished_stream_is_dropped_without_a_warning() -> None:
    provider = Pooled()
    async with Engine([provider]) as engine:
        stream = await engine.open_stream(BODY)
        await stream.next()
        await stream.close()
        del stream
        await collected()  # (a warning would be an error here: filterwarnings)
        assert provider.held == set()
