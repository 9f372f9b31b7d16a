"""Two replicas on one Redis, in their races.

``SlowBegin`` stands for a Redis a few milliseconds away: a stream must be
visible to every replica (begun in the store) before anyone is told its id.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from nexus import Engine, MockProvider, Provider
from nexus.cache.recording import cache_key
from nexus.cache.redis import RedisStore
from nexus.cache.store import Recording, StreamInfo
from nexus.config import parse_config
from nexus.encoders.registry import default_registry
from nexus.events import Delta, StreamEvent
from nexus.request import ChatRequest
from nexus.server.app import create_app
from nexus.server.state import HUB
from nexus.types import StreamMeta
from redis_support import REDIS_URL, append
from support import GatedProvider, chat


class SlowBegin(RedisStore):
    async def begin(self, info: StreamInfo, ttl_s: float) -> None:
        await asyncio.sleep(0.2)
        await super().begin(info, ttl_s)


class SlowRecording(RedisStore):
    """A recording lands ``delay_s`` after its stream's end (a busy Redis, far away)."""

    def __init__(self, *args: Any, delay_s: float = 0.3, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.delay_s = delay_s

    async def put_recording(
        self, key: str, recording: Recording, ttl_s: float, owner: str | None = None
    ) -> None:
        await asyncio.sleep(self.delay_s)
        await super().put_recording(key, recording, ttl_s, owner)


class Counting(GatedProvider):
    def __init__(self) -> None:
        super().__init__(before=1, after=1)
        self.calls = 0

    async def batches(
        self, request: ChatRequest, model: str
    ) -> AsyncGenerator[list[StreamEvent], None]:
        self.calls += 1
        async for batch in super().batches(request, model):
            yield batch


async def replica(
    aiohttp_client: Any,
    prefix: str,
    providers: list[Provider] = (),  # type: ignore[assignment]
    store: RedisStore | None = None,
    **tables: Any,
) -> TestClient[Any, Any]:
    config = parse_config(
        {"store": {"kind": "redis", "url": REDIS_URL, "prefix": prefix}, **tables}
    )
    engine = Engine(
        [MockProvider(n, models=p.models) for n, p in config.providers.items()] + list(providers),
        {},
        retry_ms=config.server.retry_ms,
    )
    app = create_app(config, engine=engine, registry=default_registry.copy(), store=store)
    return await aiohttp_client(app)


async def test_identical_requests_on_two_replicas_make_one_upstream_call(
    aiohttp_client: Any, prefix: str
) -> None:
    provider = Counting()
    one = await replica(
        aiohttp_client, prefix, [provider], SlowBegin(REDIS_URL, prefix), cache={"enabled": True}
    )
    two = await replica(aiohttp_client, prefix, [provider], cache={"enabled": True})
    body = chat(model="gated/m", stream=True)
    first = await one.post("/v1/chat/completions?stream_format=ndjson", json=body)
    await asyncio.wait_for(first.content.readline(), 5)
    second = await two.post("/v1/chat/completions?stream_format=ndjson", json=body)
    provider.gate.set()
    await first.read()
    await second.read()
    assert second.headers["X-Nexus-Cache"] == "hit"
    assert provider.calls == 1


async def test_a_background_stream_can_be_got_from_any_replica_once_202_is_sent(
    aiohttp_client: Any, prefix: str
) -> None:
    one = await replica(aiohttp_client, prefix, store=SlowBegin(REDIS_URL, prefix))
    two = await replica(aiohttp_client, prefix)
    resp = await one.post(
        "/v1/chat/completions", json=chat("hello world", stream=True, background=True)
    )
    stream_id = (await resp.json())["id"]
    got = await two.get(f"/v1/streams/{stream_id}")
    assert got.status == 200, await got.text()


async def test_a_crashed_replicas_stream_is_not_joined(aiohttp_client: Any, prefix: str) -> None:
    body = chat("hello world", stream=True)
    # What a replica that died mid-stream leaves in Redis.
    dead = RedisStore(REDIS_URL, prefix)
    await dead.start()
    try:
        info = StreamInfo(StreamMeta.new("mock/echo"), "text/event-stream")
        await dead.begin(info, 300)
        await append(dead, info, 0, [Delta(content="hel")])
        await dead.claim(cache_key(ChatRequest.model_validate(body)), info.id, 300)
    finally:
        await dead.close()
    live = await replica(
        aiohttp_client, prefix, cache={"enabled": True}, server={"heartbeat_interval_s": 0.5}
    )
    resp = await live.post("/v1/chat/completions?stream_format=ndjson", json=body)
    try:
        data = await asyncio.wait_for(resp.read(), 4)
    except TimeoutError:
        pytest.fail("an identical request joined the dead replica's stream and hangs")
    assert b'"hello' in data


async def test_a_stream_followed_from_another_replica_gets_the_shutdown_grace(
    aiohttp_client: Any, prefix: str
) -> None:
    gated = GatedProvider(before=1, after=1)
    one = await replica(aiohttp_client, prefix, [gated], server={"shutdown_grace_s": 3})
    two = await replica(aiohttp_client, prefix)
    resp = await one.post(
        "/v1/chat/completions", json=chat(model="gated/m", stream=True, background=True)
    )
    stream_id = (await resp.json())["id"]
    follower = await two.get(f"/v1/streams/{stream_id}?stream_format=ndjson")
    await asyncio.wait_for(follower.content.readline(), 5)
    closing = asyncio.create_task(one.server.close())
    await asyncio.sleep(0.3)
    gated.gate.set()  # finishes well within the 3 s grace
    rest = await asyncio.wait_for(follower.read(), 10)
    await closing
    assert b"server_shutting_down" not in rest
    assert rest.endswith(b'{"type":"done"}\n')


async def test_an_identical_request_right_after_one_ended_replays_it(
    aiohttp_client: Any, prefix: str
) -> None:
    provider = Counting()
    provider.gate.set()
    store = SlowRecording(REDIS_URL, prefix, delay_s=0.3)
    one = await replica(aiohttp_client, prefix, [provider], store, cache={"enabled": True})
    body = chat(model="gated/m", stream=True)
    first = await one.post("/v1/chat/completions?stream_format=ndjson", json=body)
    full = await first.read()
    # Its client saw the end; its recording is not in Redis yet.
    second = await one.post("/v1/chat/completions?stream_format=ndjson", json=body)
    assert second.headers["X-Nexus-Cache"] == "hit"
    assert await second.read() == full
    assert second.headers["X-Nexus-Stream-Id"] != first.headers["X-Nexus-Stream-Id"]  # replayed
    assert provider.calls == 1


async def test_an_identical_request_on_another_replica_right_after_one_ended_joins_it(
    aiohttp_client: Any, prefix: str
) -> None:
    provider = Counting()
    provider.gate.set()
    store = SlowRecording(REDIS_URL, prefix, delay_s=2)
    one = await replica(aiohttp_client, prefix, [provider], store, cache={"enabled": True})
    two = await replica(aiohttp_client, prefix, [provider], cache={"enabled": True})
    body = chat(model="gated/m", stream=True)
    first = await one.post("/v1/chat/completions?stream_format=ndjson", json=body)
    full = await first.read()
    stream_id = first.headers["X-Nexus-Stream-Id"]
    async with asyncio.timeout(5):  # its end is in Redis, its recording not yet
        while (info := await two.app[HUB].store.info(stream_id)) is None or (
            info.status == "in_progress"
        ):
            await asyncio.sleep(0.01)
    second = await two.post("/v1/chat/completions?stream_format=ndjson", json=body)
    assert second.headers["X-Nexus-Cache"] == "hit"
    assert await second.read() == full
    assert provider.calls == 1
