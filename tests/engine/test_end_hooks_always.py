"""Every plugin told of a stream's start hears of its end, once: a stream closed before
it was read, a caller cancelling while a slow end hook runs, and a request refused by a
plugin after others were told of its start each left plugins without their end hook
(an in-flight counter leaked)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from nexus import CallContext, Engine, GatewayError, Hooks, MockProvider, StreamRejected
from nexus.events import Error
from nexus.types import Completion

BODY = {"model": "mock/echo", "messages": [{"role": "user", "content": "hi there"}]}


class InFlight:
    """+1 at the start, -1 at the end; the end hooks' outcomes."""

    def __init__(self) -> None:
        self.n = 0
        self.ends: list[str | None] = []

    async def on_stream_started(
        self, ctx: CallContext, rid: str, model: str, provider: str
    ) -> None:
        self.n += 1

    async def on_stream_completed(
        self,
        ctx: CallContext,
        rid: str,
        model: str,
        provider: str,
        elapsed: float,
        final: Completion,
    ) -> None:
        self.n -= 1
        self.ends.append("completed")

    async def on_stream_failed(self, ctx: CallContext, rid: str, model: str, error: Error) -> None:
        self.n -= 1
        self.ends.append(error.code)


class SlowEnd:
    """An end hook that takes a second (a write to a slow billing store)."""

    def __init__(self) -> None:
        self.begun = asyncio.Event()

    async def on_stream_completed(self, *args: Any) -> None:
        self.begun.set()
        await asyncio.sleep(1)


class Gate:
    def __init__(self, refuse: bool) -> None:
        self.refuse = refuse
        self.ends = 0

    async def on_stream_started(
        self, ctx: CallContext, rid: str, model: str, provider: str
    ) -> None:
        if self.refuse:
            raise StreamRejected("Not today.", code="policy", status=403)
        await asyncio.sleep(1)  # past its bound: 503 plugin_timeout

    async def on_stream_failed(self, *args: Any) -> None:
        self.ends += 1


def engine_with(*plugins: object, timeout_s: float = 5.0) -> Engine:
    hooks = Hooks()
    for plugin in plugins:
        hooks.add(plugin, timeout_s=timeout_s)
    return Engine([MockProvider("mock")], hooks=hooks)


async def test_a_stream_closed_before_it_is_read_ends_with_stream_cancelled() -> None:
    counter = InFlight()
    async with engine_with(counter) as engine:
        stream = await engine.open_stream(BODY)
        await stream.close()
        async with await engine.open_stream(BODY):
            pass
    assert counter.ends == ["stream_cancelled", "stream_cancelled"]
    assert counter.n == 0


@pytest.mark.parametrize("how", ["complete", "complete_stream"])
async def test_a_cancellation_during_a_slow_end_hook_leaves_the_others_theirs(how: str) -> None:
    slow, counter = SlowEnd(), InFlight()
    async with engine_with(slow, counter) as engine:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.3):
                if how == "complete":
                    await engine.complete(BODY)
                else:
                    async with engine.complete_stream(BODY) as stream:
                        async for _ in stream:
                            pass
        assert slow.begun.is_set()
        assert counter.ends == ["completed"]  # before the cancellation went on
        assert counter.n == 0
        assert not engine.hooks.errors  # an interrupted hook is not the plugin's error


@pytest.mark.parametrize(("refuse", "code"), [(True, "policy"), (False, "plugin_timeout")])
async def test_a_refusal_ends_the_stream_for_the_plugins_told_of_its_start(
    refuse: bool, code: str
) -> None:
    counter, gate, after = InFlight(), Gate(refuse), InFlight()
    async with engine_with(counter, gate, after, timeout_s=0.1) as engine:
        for _ in range(2):
            with pytest.raises(GatewayError) as raised:
                await engine.complete(BODY)
            assert raised.value.code == code
    assert counter.ends == [code, code]
    assert counter.n == 0
    assert gate.ends == 0  # it refused: it knows
    assert after.ends == [] and after.n == 0  # never told of the start
