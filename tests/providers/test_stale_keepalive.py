"""A kept-alive upstream connection the upstream closes just as it is reused (its own
keep-alive ran out: uvicorn's is 5 s, Nexus keeps one 15 s) failed the request with a
502, or sent an alias to its next provider. Not a byte of the answer came, so the
request goes once more, on a new connection; a connection that answered something, or a
new one that fails, is an error as before."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from nexus import Engine, OpenAIProvider, OpenAIProviderConfig
from nexus.errors import UpstreamDisconnected
from nexus.providers.connections import STALE_CLOSE_S
from upstreams import DONE, openai_chunk

BODY = {"model": "up/m", "messages": [{"role": "user", "content": "hi"}]}
ANSWER = openai_chunk(content="hi") + openai_chunk(finish_reason="stop") + DONE
RESPONSE = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
    b"Content-Length: %d\r\n\r\n" % len(ANSWER) + ANSWER
)


class Upstream:
    """Answers one request per connection, then closes it when the next one comes in
    (``then``: ``"close"``), after working on it a while (``"worked"``), or answers a few
    bytes of it and closes (``"half"``)."""

    def __init__(self, then: str) -> None:
        self.then = then
        self.requests = 0
        self.port = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            for turn in range(2):
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                )
                await reader.readexactly(length)
                self.requests += 1
                if turn == 1:
                    if self.then == "half":
                        writer.write(b"HTTP/1.1 200 OK\r\n")
                        await writer.drain()
                    elif self.then == "worked":  # read it, worked on it, then died
                        await asyncio.sleep(STALE_CLOSE_S + 0.3)
                    break
                writer.write(RESPONSE)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()


Make = Callable[[str], Awaitable[tuple[Engine, "Upstream"]]]


@pytest.fixture
async def engine_for() -> AsyncIterator[Make]:
    servers = []

    async def make(then: str) -> tuple[Engine, Upstream]:
        upstream = Upstream(then)
        server = await asyncio.start_server(upstream.serve, "127.0.0.1", 0)
        servers.append(server)
        upstream.port = server.sockets[0].getsockname()[1]
        config = OpenAIProviderConfig(base_url=f"http://127.0.0.1:{upstream.port}/v1")
        return Engine([OpenAIProvider("up", config, api_key="sk-test")]), upstream

    yield make
    for server in servers:
        server.close()


async def test_a_reused_connection_closed_unanswered_is_tried_once_more(engine_for: Make) -> None:
    engine, upstream = await engine_for("close")
    async with engine:
        for _ in range(3):
            assert (await engine.complete(BODY)).content == "hi"
    assert upstream.requests == 5  # 1, then (closed, again) twice


@pytest.mark.parametrize("then", ["half", "worked"])
async def test_a_request_the_upstream_may_have_read_is_not_sent_again(
    engine_for: Make, then: str
) -> None:
    """Something of the answer came, or the close came long after the request went out
    (the upstream may have read it, and be billing it): an error, never a second copy."""
    engine, upstream = await engine_for(then)
    async with engine:
        assert (await engine.complete(BODY)).content == "hi"
        with pytest.raises(UpstreamDisconnected):
            await engine.complete(BODY)
    assert upstream.requests == 2
