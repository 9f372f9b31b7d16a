"""A middleware that forgot to await ``call_next`` or returned nothing failed deep in the
engine (an ``AttributeError`` on a coroutine, a ``TypeError`` on None): the engine checks
what each middleware returns and names it."""

from __future__ import annotations

import warnings

import pytest

from nexus import CallContext, ChatRequest, Engine, Hooks, Middleware, MockProvider, Next, Stream

BODY = {"model": "mock/echo", "messages": [{"role": "user", "content": "hi"}]}


async def forgets_await(ctx: CallContext, request: ChatRequest, call_next: Next) -> Stream:
    return call_next(request)  # type: ignore[return-value]


async def returns_none(ctx: CallContext, request: ChatRequest, call_next: Next) -> Stream:
    await call_next(request)
    return None  # type: ignore[return-value]


class Plugin:
    async def on_stream_started(self, *args: object) -> None:
        pass


@pytest.mark.parametrize(
    ("middleware", "said"),
    [
        (forgets_await, "forgets_await returned coroutine, not a Stream: did it forget to await"),
        (returns_none, "returns_none returned NoneType, not a Stream"),
    ],
)
@pytest.mark.parametrize("plugins", [False, True])
async def test_a_middleware_that_returns_no_stream_is_named(
    middleware: Middleware, said: str, plugins: bool
) -> None:
    hooks = Hooks()
    if plugins:
        hooks.add(Plugin())
    engine = Engine([MockProvider("mock")], middleware=[middleware], hooks=hooks)
    async with engine:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # (the coroutine not awaited is closed: no warning)
            with pytest.raises(TypeError, match=said):
                await engine.complete(BODY)
