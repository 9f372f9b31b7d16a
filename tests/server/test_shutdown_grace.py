"""The shutdown's grace waits for requests that are not streaming yet (an upload under
way, an admission, a stream being opened), not only for the streams: with nothing else
running it ended at once, and aiohttp's cleanup cut the request half a second later (no
answer, no error frame; its line said the client had left)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest

from nexus.cache.hub import StreamHub
from nexus.server.shutdown import drain, shutdown_event
from nexus.server.state import HUB, RUNTIME
from support import MakeClient


async def test_an_upload_under_way_at_the_signal_is_answered_within_the_grace(
    make_client: MakeClient,
) -> None:
    client = await make_client({"server": {"shutdown_grace_s": 5}})
    app = client.server.app
    body = orjson.dumps(
        {
            "model": "mock/echo",
            "stream": True,
            "messages": [{"role": "user", "content": "one two three four"}],
            "mock": {"delay_ms": 50},
        }
    )
    rest = asyncio.Event()

    async def upload() -> AsyncIterator[bytes]:
        yield body[:10]
        await rest.wait()
        yield body[10:]

    post = asyncio.ensure_future(
        client.post(
            "/v1/chat/completions",
            data=upload(),
            headers={"Content-Type": "application/json", "Content-Length": str(len(body))},
        )
    )
    for _ in range(100):  # its head read: the request is being answered
        if app[RUNTIME].requests:
            break
        await asyncio.sleep(0.01)
    assert app[RUNTIME].requests == 1
    draining = asyncio.ensure_future(drain(app))
    await asyncio.sleep(0.3)
    assert not draining.done()  # the grace waits for it
    rest.set()
    resp = await asyncio.wait_for(post, 5)
    assert resp.status == 200
    text = await asyncio.wait_for(resp.text(), 5)
    assert "four" in text and text.endswith("data: [DONE]\n\n")
    await asyncio.wait_for(draining, 5)
    assert app[RUNTIME].requests == 0


async def test_a_stream_opened_as_the_streams_are_ended_is_ended_too(
    make_client: MakeClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request still opening its stream (an upload that outlasted the grace, a slow
    provider's connect) when the grace ended started a run nobody cancelled: it streamed
    on until aiohttp's cleanup cut its connection. Such a run is ended as the others are,
    and a request that reaches the hub after that is refused, both with the retryable
    ``server_shutting_down``."""
    client = await make_client()
    hub = client.server.app[HUB]
    opening, go_on = asyncio.Event(), asyncio.Event()
    real_open = StreamHub._open

    async def slow_open(self: StreamHub, *args: Any, **kwargs: Any) -> Any:
        opening.set()
        await go_on.wait()
        return await real_open(self, *args, **kwargs)

    monkeypatch.setattr(StreamHub, "_open", slow_open)
    body = {"model": "mock/echo", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    post = asyncio.ensure_future(client.post("/v1/chat/completions", json=body))
    await asyncio.wait_for(opening.wait(), 5)
    await hub.shutdown(shutdown_event(), timeout_s=1)
    go_on.set()
    resp = await asyncio.wait_for(post, 5)
    assert resp.status == 503
    assert (await resp.json())["error"]["code"] == "server_shutting_down"
    assert not hub.live

    late = await client.post("/v1/chat/completions", json=body)
    assert late.status == 503
    assert (await late.json())["error"]["code"] == "server_shutting_down"


async def test_a_response_that_ends_once_the_server_stops_closes_its_connection(
    make_client: MakeClient,
) -> None:
    """A request under way at the signal, answered in the grace, said nothing and its
    connection was closed after it: a keep-alive client (the SDKs) sent its next request
    onto a closed socket (a connection error, on every deploy) instead of one elsewhere."""
    client = await make_client()
    body = {
        "model": "mock/echo",
        "messages": [{"role": "user", "content": "one two three"}],
        "mock": {"delay_ms": 100},
    }
    before = await client.post("/v1/chat/completions", json=body)
    assert before.headers.get("Connection", "").lower() != "close"
    under_way = asyncio.ensure_future(client.post("/v1/chat/completions", json=body))
    await asyncio.sleep(0.05)
    client.server.app[RUNTIME].shutting_down = True
    answer = await under_way
    assert answer.status == 200
    assert answer.headers["Connection"].lower() == "close"
    await answer.read()
