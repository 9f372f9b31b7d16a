"""Upstreams that send what no honest one does, through the running gateway: each test
is named for what it keeps from breaking (tests/upstreams.py is the fake)."""

from __future__ import annotations

import asyncio
import gzip
import math
import re
import select
import socket
import threading
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest

from nexus.config import OpenAIProviderConfig
from nexus.events import Delta
from nexus.providers import OpenAIProvider
from nexus.request import ChatRequest
from support import MakeClient
from upstreams import DONE, FakeUpstream, Reply, openai_chunk, openai_usage_chunk

KEY_ENV = "NEXUS_TEST_HOSTILE_KEY"
KEY = "sk-hostile-upstream-secret"
USAGE = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}


@pytest.fixture(autouse=True)
def key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, KEY)


@pytest.fixture
async def upstream() -> AsyncIterator[FakeUpstream]:
    async with FakeUpstream() as fake:
        yield fake


def openai(fake: FakeUpstream, **options: Any) -> dict[str, Any]:
    provider = {"kind": "openai", "base_url": fake.url + "/v1", "api_key_env": KEY_ENV, **options}
    return {"providers": {"up": provider}}


def chat(stream: bool = True) -> dict[str, Any]:
    return {"model": "up/m", "messages": [{"role": "user", "content": "Hi"}], "stream": stream}


async def ndjson(client: Any, body: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    resp = await client.post("/v1/chat/completions?stream_format=ndjson", json=body or chat())
    assert resp.status == 200, await resp.text()
    return [orjson.loads(line) for line in (await resp.read()).splitlines()]


async def test_an_event_past_max_event_bytes_ends_the_stream(
    make_client: MakeClient, upstream: FakeUpstream
) -> None:
    """A valid 100 MB event used to be held, then sent whole to the client."""
    big = [b"x" * 65536] * 8  # 512 KiB of one content string, in writes of 64 KiB
    upstream.add(
        Reply.stream(
            [
                openai_chunk(content="start"),
                b'data: {"choices":[{"index":0,"delta":{"content":"',
                *big,
                b'"}}]}\n\n',
                openai_usage_chunk(USAGE),
                DONE,
            ]
        )
    )
    client = await make_client(openai(upstream, max_event_bytes=128 * 1024))
    lines = await ndjson(client)
    assert lines[0] == {"type": "delta", "delta": {"content": "start"}}
    assert [line["type"] for line in lines] == ["delta", "error", "done"]
    assert lines[1]["error"]["code"] == "upstream_protocol_error"
    assert "max_event_bytes" in lines[1]["error"]["message"]


async def test_bodies_are_asked_for_uncompressed(
    make_client: MakeClient, upstream: FakeUpstream
) -> None:
    """aiohttp's default Accept-Encoding (gzip, deflate) invited compressed bodies."""
    upstream.add(Reply.stream([openai_chunk(content="ok"), openai_usage_chunk(USAGE), DONE]))
    client = await make_client(openai(upstream))
    await ndjson(client)
    assert upstream.requests[0].headers["Accept-Encoding"] == "identity"


async def test_a_compressed_stream_is_refused_not_inflated(
    make_client: MakeClient, upstream: FakeUpstream
) -> None:
    """A gzip body used to be inflated whole in one call: 300 MB of comments from 306 KB
    held the event loop 35 s; a 1 MB bomb took 3 GB."""
    body = gzip.compress(openai_chunk(content="zipped") + b":\n\n" * 1000 + DONE)
    upstream.add(
        Reply(body=body, headers={"Content-Type": "text/event-stream", "Content-Encoding": "gzip"})
    )
    client = await make_client(openai(upstream))
    resp = await client.post("/v1/chat/completions", json=chat())
    assert resp.status == 502
    error = (await resp.json())["error"]
    assert error["code"] == "upstream_protocol_error"
    assert "gzip" in error["message"]


async def test_keepalive_comments_keep_a_slow_first_event_alive(
    make_client: MakeClient, upstream: FakeUpstream
) -> None:
    """A live upstream says so with comments while its model thinks (OpenRouter's
    keepalives, Anthropic's pings): past first_byte_timeout_s without an event, it is not
    cut as silent, and the alias does not go to its next target."""
    comments = [b": keepalive\n\n"] * 30  # 1.5 s of them, then the answer
    late = [openai_chunk(content="late"), openai_usage_chunk(USAGE), DONE]
    upstream.add(Reply.stream([*comments, *late], delay=0.05))
    upstream.add(Reply.stream([openai_chunk(content="next"), openai_usage_chunk(USAGE), DONE]))
    config = openai(upstream, first_byte_timeout_s=0.5)
    config["models"] = {"alias": {"targets": ["up/a", "up/b"]}}
    client = await make_client(config)
    lines = await ndjson(client, {**chat(), "model": "alias"})
    assert lines[0] == {"type": "delta", "delta": {"content": "late"}}
    assert [seen.body["model"] for seen in upstream.requests] == ["a"]


class Blaster:
    """An upstream in a thread of its own (no turn of the test's event loop is its) that
    answers one request with ``body`` as an event stream, as fast as the socket takes it.
    ``filled`` is set once the socket takes no more (or took it all): from then on the
    client finds bytes already buffered at each read."""

    def __init__(self, body: bytes) -> None:
        head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
        self.response = head + b"Content-Length: %d\r\n\r\n" % len(body) + body
        self.writing, self.filled = threading.Event(), threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(10)
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        connection, _ = self.listener.accept()
        with connection:
            connection.settimeout(10)
            received = b""
            while b"\r\n\r\n" not in received:
                received += connection.recv(65536)
            request, _, sent = received.partition(b"\r\n\r\n")
            length = re.search(rb"(?i)content-length: *(\d+)", request)
            assert length is not None
            while len(sent) < int(length[1]):
                sent += connection.recv(65536)
            self.writing.set()
            rest = memoryview(self.response)
            connection.setblocking(False)
            while rest:
                try:
                    rest = rest[connection.send(rest) :]
                except BlockingIOError:
                    self.filled.set()
                    if not select.select([], [connection], [], 10)[1]:
                        return  # the client stopped reading
            self.filled.set()
            connection.settimeout(10)
            while connection.recv(65536):  # until the client leaves
                pass

    async def __aenter__(self) -> Blaster:
        self.thread.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await asyncio.to_thread(self.thread.join, 10)  # the loop runs on: the client's close
        self.listener.close()


async def test_a_comment_flood_lets_other_streams_run() -> None:
    """A flood of comments (no event) used to hold the event loop, every other stream
    included, until an event came: reads of bytes already buffered did not pause. Each
    socket read is a callback of its own now: other tasks run between them. The loop is
    held while the upstream fills the socket, so that what is counted is the client's
    turns over bytes already there."""
    flood = b":\n\n" * 20_000 * 64  # 3.75 MiB, never an event
    async with Blaster(flood + openai_chunk(content="end") + DONE) as upstream:
        provider = OpenAIProvider("up", OpenAIProviderConfig(kind="openai", base_url=upstream.url))
        await provider.start()
        others = 0

        async def other_stream() -> None:
            nonlocal others
            while not upstream.writing.is_set():
                await asyncio.sleep(0)
            upstream.filled.wait(5)  # the loop held: the socket fills
            while True:
                others += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(other_stream())
        batches = provider.batches(ChatRequest.model_validate(chat()), "m")
        try:
            events = await asyncio.wait_for(batches.__anext__(), 10)
        finally:
            task.cancel()
            await batches.aclose()
            await provider.close()
    assert events == [Delta("end")]
    assert others >= 10  # a turn per socket read (at most 256 KiB) of the flood


@pytest.mark.parametrize(
    "usage",
    [
        b'{"prompt_tokens":1e308,"completion_tokens":1e308,"total_tokens":1}',
        b'{"prompt_tokens":1' + b"0" * 400 + b',"completion_tokens":1,"total_tokens":1}',
        b'{"prompt_tokens":"100","completion_tokens":"5","total_tokens":"105"}',
        b'{"prompt_tokens":100,"completion_tokens":5,"prompt_tokens_details":{"cached_tokens":"x"}}',
    ],
)
async def test_a_usage_that_is_no_count_is_a_protocol_error(
    make_client: MakeClient, upstream: FakeUpstream, usage: bytes
) -> None:
    """1e308 prompt tokens used to cost inf (the key's budget spent for good, the cost
    metric +Inf); a string or a count past 64 bits, a 500 with a traceback."""
    usage_chunk = b'data: {"choices":[],"usage":' + usage + b"}\n\n"
    upstream.add(Reply.stream([openai_chunk(content="hi"), usage_chunk, DONE]))
    config = openai(upstream)
    config["models"] = {"up/m": {"input_usd_per_mtok": 1.0, "output_usd_per_mtok": 2.0}}
    client = await make_client(config)
    resp = await client.post("/v1/chat/completions", json=chat(stream=False))
    assert resp.status == 502
    assert (await resp.json())["error"]["code"] == "upstream_protocol_error"
    metrics = (await (await client.get("/metrics")).text()).splitlines()
    costs = [line for line in metrics if line.startswith("nexus_cost_usd_total{")]
    assert costs and all(math.isfinite(float(line.split()[-1])) for line in costs)
