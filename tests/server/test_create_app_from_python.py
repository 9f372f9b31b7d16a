"""``create_app`` as docs/python-api.md describes it, with ``nexus`` names only: a registry of
your own, and middleware behind the HTTP server."""

from __future__ import annotations

from typing import Any

import pytest

from nexus import (
    CallContext,
    ChatRequest,
    Config,
    ConfigError,
    Delta,
    EncoderRegistry,
    Engine,
    MockProvider,
    Next,
    Stream,
    StreamEvent,
    create_app,
    map_stream,
)
from support import PlainTextEncoder, chat

ANTHROPIC = "application/vnd.nexus.anthropic-messages+sse"


def _only_openai_sse() -> EncoderRegistry:
    registry = EncoderRegistry()
    registry.register("text/event-stream", EncoderRegistry(builtins=True).get("text/event-stream"))
    return registry


@pytest.mark.parametrize(
    ("registry", "media_type", "endpoint"),
    [
        (EncoderRegistry, "text/event-stream", "/v1/chat/completions"),
        (_only_openai_sse, ANTHROPIC, "/v1/messages"),
    ],
)
def test_a_registry_without_an_endpoints_default_format_fails_at_create_app(
    registry: Any, media_type: str, endpoint: str
) -> None:
    with pytest.raises(ConfigError) as info:
        create_app(Config(), registry=registry())
    assert str(info.value) == (
        f"the encoder registry has no {media_type!r}, the default format of {endpoint}: start "
        "it from the built-in formats, EncoderRegistry(builtins=True)"
    )


async def test_a_registry_of_your_own_from_the_builtins_serves_every_default(
    aiohttp_client: Any,
) -> None:
    registry = EncoderRegistry(builtins=True)
    registry.register("text/plain", PlainTextEncoder)
    client = await aiohttp_client(create_app(Config(), registry=registry))
    body = chat(stream=True, max_tokens=16)
    answers = {
        "/v1/chat/completions": ("text/event-stream", body),
        "/v1/messages": (ANTHROPIC, body),
        "/v1/responses": (
            "application/vnd.nexus.openai-responses+sse",
            {"model": "mock/echo", "input": "hi", "stream": True},
        ),
    }
    for path, (media_type, sent) in answers.items():
        resp = await client.post(path, json=sent)
        assert resp.status == 200, await resp.text()
        assert resp.headers["X-Nexus-Stream-Format"] == media_type
        await resp.read()
    resp = await client.post("/v1/chat/completions?stream_format=plain", json=body)
    assert resp.headers["X-Nexus-Stream-Format"] == "text/plain"
    assert await resp.read() == b"Hello there world\n"


async def shout(ctx: CallContext, request: ChatRequest, call_next: Next) -> Stream:
    stream = await call_next(request)

    def upper(event: StreamEvent) -> StreamEvent:
        if isinstance(event, Delta) and event.content:
            return Delta(content=event.content.upper(), finish_reason=event.finish_reason)
        return event

    return map_stream(stream, upper)


async def test_create_app_serves_middleware_over_http(aiohttp_client: Any) -> None:
    client = await aiohttp_client(create_app(Config(), middleware=[shout]))
    resp = await client.post("/v1/chat/completions", json=chat())
    assert (await resp.json())["choices"][0]["message"]["content"] == "HELLO THERE WORLD"


def test_create_app_takes_middleware_for_its_own_engine_only() -> None:
    with pytest.raises(ValueError, match="give the middleware to the Engine passed as engine="):
        create_app(Config(), engine=Engine([MockProvider("mock")]), middleware=[shout])


async def test_an_app_s_plugins_stay_its_own_with_hooks_shared_by_engines(
    aiohttp_client: Any,
) -> None:
    """Engines may share one Hooks. The app's metrics went into it, so a Python-only
    engine's streams were counted in the server's /metrics; and a second create_app with
    one engine counted every stream twice (now refused)."""
    from nexus import Hooks, accumulate

    class Counting:
        def __init__(self) -> None:
            self.ends = 0

        async def on_stream_completed(self, *args: Any) -> None:
            self.ends += 1

    counting = Counting()
    shared = Hooks()
    shared.add(counting)
    served = Engine([MockProvider("mock")], hooks=shared)
    app = create_app(Config(), engine=served)
    client = await aiohttp_client(app)
    async with Engine([MockProvider("mock")], hooks=shared) as alone:
        for _ in range(3):
            await accumulate(await alone.open_stream(chat()))
    assert counting.ends == 3  # the shared plugin hears both engines' streams
    page = await (await client.get("/metrics")).text()
    assert 'nexus_requests_total{endpoint="/v1/chat/completions"' not in page
    assert "nexus_tokens_total{" not in page  # none of the Python-only engine's
    assert (await client.post("/v1/chat/completions", json=chat())).status == 200
    page = await (await client.get("/metrics")).text()
    assert 'nexus_requests_total{endpoint="/v1/chat/completions"' in page
    with pytest.raises(ValueError, match="already serves an app"):
        create_app(Config(), engine=served)
