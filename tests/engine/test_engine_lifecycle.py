"""An engine with an HTTP provider used before ``start()`` or after ``close()`` failed as
the provider's bug: a retryable ``internal_error`` that hid why. It is a plain error that
says so now, raised before anything is routed."""

from __future__ import annotations

import pytest

from nexus import Engine, GatewayError, MockProvider, OpenAIProvider, OpenAIProviderConfig

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
