"""An engine with an HTTP provider used before ``start()`` or after ``close()`` failed as
the provider's bug: a retryable ``internal_error`` that hid why. It is a plain error that
says so now, raised before anything is routed."""

from __future__ import annotations

import asyncio

import pytest

from nexus import (
    Engine,
    GatewayError,
    MockProvider,
    OpenAIProvider,
    OpenAIProviderConfig,
    accumulate,
)
from upstreams import DONE, FakeUpstream, Reply, openai_chunk

BODY = {"model": "up/m", "messages": [{"role": "user", "content": "hi"}]}


def http_engine() -> Engine:
    # Nothing listens there: the call must fail before any connection is tried.
    config = OpenAIProviderConfig(base_url="http://127.0.0.1:9/v1")
    return Engine([OpenAIProvider("up", config, api_key="sk-test")])


async def test_an_engine_not_started_says_so() -> None:
    engine = http_engine()
    with pytest.raises(RuntimeError, match="not started") as raised:
        await engine.complete(BODY)
    assert not isinstance(raised.value, GatewayError)
    with pytest.raises(RuntimeError, match="not started"):
        engine.complete_stream(BODY)


async def test_a_closed_engine_says_so_until_started_again() -> None:
    engine = http_engine()
    async with engine:
        pass
    with pytest.raises(RuntimeError, match="is closed"):
        await engine.open_stream(BODY)
    with pytest.raises(RuntimeError, match="is closed"):
        engine.complete_stream(BODY)
    mock = Engine([MockProvider("mock")])
    async with mock:
        pass
    with pytest.raises(RuntimeError, match="is closed"):
        await mock.complete({**BODY, "model": "mock/echo"})
    async with mock:
        completion = await mock.complete({**BODY, "model": "mock/echo"})
    assert completion.content == "hi"


async def test_a_started_engine_refuses_a_second_start_and_its_close_ends_every_task() -> None:
    """A second start replaced each provider's pool with the first's connections still
    open (unclosed sockets); and the providers' watchdog outlived ``close()`` by a tick."""
    reply = Reply.stream([openai_chunk(content="hi"), openai_chunk(finish_reason="stop"), DONE])
    async with FakeUpstream(default=reply) as fake:
        config = OpenAIProviderConfig(base_url=fake.url + "/v1")
        engine = Engine([OpenAIProvider("up", config, api_key="sk-test")])
        async with engine:
            with pytest.raises(RuntimeError, match="started already"):
                await engine.start()
            stream = engine.complete_stream(BODY)
            completion = await accumulate(stream)
            # The completion is the stream's: the id its hooks and its meta name.
            assert completion.id == stream.meta.id != ""
            assert completion.content == "hi"
        left = [t for t in asyncio.all_tasks() if "Watchdog" in repr(t.get_coro())]
        assert left == []
        async with engine:  # closed, it starts again
            assert (await engine.complete(BODY)).content == "hi"


async def test_an_engine_whose_start_failed_may_be_started_again() -> None:
    class Flaky(MockProvider):
        failures = 1

        async def start(self) -> None:
            if Flaky.failures:
                Flaky.failures -= 1
                raise OSError("not yet")

    engine = Engine([Flaky("mock")])
    with pytest.raises(OSError):
        await engine.start()
    await engine.start()  # not "started already": nothing was
    assert (await engine.complete({**BODY, "model": "mock/echo"})).content == "hi"
    await engine.close()


async def test_a_watchdog_stopped_before_its_first_tick_ticks_again_when_watched() -> None:
    from nexus.watchdog import Watchdog

    ticks: list[float] = []

    class Watched:
        def check(self, now: float) -> None:
            ticks.append(now)

    dog, watched = Watchdog(), Watched()
    dog.add(watched, 0.01)
    await dog.stop()  # in the same turn of the loop: its task never ran
    dog.add(watched, 0.01)
    await asyncio.sleep(0.1)
    assert ticks
    await dog.stop()
