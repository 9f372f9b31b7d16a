"""A key's places taken while Redis was down count in Redis once it is back.

Against a ``redis-server`` the test starts, stops and starts again (no persistence: the
restart loses every key), shared by two in-process replicas. While Redis is down a
replica counts a key's streams, readers and sockets itself, up to the key's limit. Those
places still held once Redis is back are put back in it: the same replica refuses the
key's next one at once (its admission puts them back first), the other replica as soon
as the first one's renewal has; both admit again once enough of them end. A stream that
ends while Redis is down frees its place at once (its log waits for Redis; the key's next
stream does not). Also, with the
limits alone: two replicas both cut off, a place that ended during the outage, and a
replica that dies after putting its places back.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
import redis.asyncio as aioredis
import websockets
from aiohttp import ClientResponse
from aiohttp.test_utils import TestClient
from websockets.exceptions import InvalidStatus

from nexus.auth import hash_key
from nexus.cache.limits import LocalLimits
from nexus.cache.redis import RedisStore
from nexus.cache.redis_limits import RedisLimits
from redis_server import RedisServer
from support import GatedProvider, MakeClient, chat

A = "nx-outage-key-a-0001"
KEYS = {"keys": [{"name": "a", "sha256": hash_key(A)}]}
HEADERS = {"Authorization": f"Bearer {A}"}
PREFIX = "outage"
LEASE_S = 0.6
SSE = "/v1/chat/completions?stream_format=sse"


@pytest.fixture
async def redis(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    """A client of the test's own Redis, to see what the replicas put in it."""
    client = aioredis.Redis.from_url(redis_server.url, socket_timeout=2.0)
    try:
        yield client
    finally:
        await client.aclose()


def config(server: RedisServer) -> dict[str, Any]:
    return {
        "auth": KEYS,
        # required = false: a stream runs on its replica alone while Redis is down.
        "store": {"kind": "redis", "url": server.url, "prefix": PREFIX, "required": False},
        "limits": {
            "requests_per_second_per_key": 0,
            "max_concurrent_streams_per_key": 2,
            "max_readers_per_key": 2,
            "stream_lease_s": LEASE_S,
        },
        "realtime": {"max_sockets_per_key": 2},
    }


async def in_redis(redis: aioredis.Redis, kind: str, count: int) -> None:
    """Wait until Redis holds ``count`` of key a's places of ``kind`` (5 s at most): a
    replica's renewal put them back."""
    deadline = asyncio.get_running_loop().time() + 5.0
    while (held := await redis.zcard(f"{PREFIX}:limits:{kind}:a")) != count:
        assert asyncio.get_running_loop().time() < deadline, f"{held} {kind} in Redis"
        await asyncio.sleep(0.05)


async def serves(client: TestClient[Any, Any]) -> None:
    """A request on ``client`` while Redis is down: the replica meets the outage (a
    connection that broke is dropped; one left from before a restart fails its first
    command after it, whatever that command is)."""
    resp = await client.get("/v1/streams/nope", headers=HEADERS)
    assert resp.status in (404, 503), await resp.text()
    resp.release()


async def settled(redis: aioredis.Redis, kind: str) -> None:
    """Wait until key a's places of ``kind`` left Redis (they go just after they close)."""
    await in_redis(redis, kind, 0)


# Sockets.


def connect(client: TestClient[Any, Any]) -> Any:
    url = f"ws://{client.server.host}:{client.server.port}/v1/realtime"
    return websockets.connect(url, additional_headers=HEADERS)


async def socket_refused(client: TestClient[Any, Any]) -> None:
    with pytest.raises(InvalidStatus) as caught:
        await connect(client)
    response = caught.value.response
    assert response.status_code == 429
    assert orjson.loads(response.body or b"{}")["error"]["code"] == "too_many_sockets"


async def test_sockets_opened_while_redis_was_down_count_once_it_is_back(
    make_client: MakeClient, redis_server: RedisServer, redis: aioredis.Redis
) -> None:
    one = await make_client(config(redis_server))
    two = await make_client(config(redis_server))
    redis_server.stop()
    await serves(two)
    held = [await connect(one), await connect(one)]  # counted by this replica alone
    await socket_refused(one)
    redis_server.start()  # empty
    await socket_refused(one)  # its admission put them back first
    await in_redis(redis, "sockets", 2)  # (and its renewal)
    await socket_refused(two)
    await socket_refused(one)
    for ws in held:
        await ws.close()
    await settled(redis, "sockets")
    for client in (one, two):
        ws = await connect(client)
        await ws.close()


# Readers.


async def read(client: TestClient[Any, Any], path: str) -> ClientResponse:
    resp = await client.get(path, headers=HEADERS)
    assert resp.status == 200, await resp.text()
    return resp


async def reader_refused(client: TestClient[Any, Any]) -> None:
    resp = await client.get("/v1/streams/nope", headers=HEADERS)  # refused before its lookup
    assert resp.status == 429, await resp.text()
    assert (await resp.json())["error"]["code"] == "too_many_readers"


async def test_readers_that_came_while_redis_was_down_count_once_it_is_back(
    make_client: MakeClient, redis_server: RedisServer, redis: aioredis.Redis
) -> None:
    gated = GatedProvider(before=1, after=1)
    one = await make_client(config(redis_server), providers=[gated])
    two = await make_client(config(redis_server))
    started = await one.post(
        "/v1/chat/completions",
        json=chat(model="gated/m", stream=True, background=True),
        headers=HEADERS,
    )
    assert started.status == 202, await started.text()
    path = f"/v1/streams/{(await started.json())['id']}"
    redis_server.stop()
    await serves(two)
    readers = [await read(one, path), await read(one, path)]  # it runs here: read from memory
    await reader_refused(one)
    redis_server.start()
    await reader_refused(one)
    await in_redis(redis, "readers", 2)
    await reader_refused(two)
    await reader_refused(one)
    for resp in readers:
        resp.close()
    await settled(redis, "readers")
    assert (await two.get("/v1/streams/nope", headers=HEADERS)).status == 404  # admitted
    (await read(one, path)).close()
    gated.gate.set()


# Streams.


async def stream(client: TestClient[Any, Any], body: dict[str, Any]) -> ClientResponse:
    """A streaming request of key a, its first event read."""
    resp = await client.post(SSE, json=body, headers=HEADERS)
    assert resp.status == 200, await resp.text()
    await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5)
    return resp


async def stream_refused(client: TestClient[Any, Any]) -> None:
    resp = await client.post(SSE, json=chat(stream=True), headers=HEADERS)
    assert resp.status == 429, await resp.text()
    assert (await resp.json())["error"]["code"] == "too_many_streams"


async def test_streams_started_while_redis_was_down_count_once_it_is_back(
    make_client: MakeClient, redis_server: RedisServer, redis: aioredis.Redis
) -> None:
    gated = GatedProvider(before=1, after=1)
    one = await make_client(config(redis_server), providers=[gated])
    two = await make_client(config(redis_server))
    redis_server.stop()
    await serves(two)
    body = chat(model="gated/m", stream=True)
    running = [await stream(one, body), await stream(one, body)]
    assert running[0].headers["X-Nexus-Store"] == "unavailable"  # (on this replica alone)
    await stream_refused(one)
    redis_server.start()
    await stream_refused(one)
    await in_redis(redis, "streams", 2)
    await stream_refused(two)
    await stream_refused(one)
    gated.gate.set()
    for resp in running:
        await asyncio.wait_for(resp.read(), 5)
    await settled(redis, "streams")
    for client in (one, two):
        resp = await stream(client, chat(stream=True))
        await resp.read()


async def test_a_stream_that_ends_while_redis_is_down_gives_its_place_back_at_once(
    make_client: MakeClient, redis_server: RedisServer
) -> None:
    """Back to back at the key's limit while Redis is down: each stream is admitted as the
    one before it ended, not once that one's log reached the store (retried after 1 s,
    then 2, 4, 8: until then it held its place in this replica's count)."""
    gated = GatedProvider(before=1, after=1)
    one = await make_client(config(redis_server), providers=[gated])
    redis_server.stop()
    await serves(one)
    held = await stream(one, chat(model="gated/m", stream=True))  # one of the key's two
    for _ in range(6):
        resp = await stream(one, chat(stream=True))  # at once, the one before just ended
        assert resp.headers["X-Nexus-Store"] == "unavailable"
        await asyncio.wait_for(resp.read(), 5)
    # Still the key's limit: two running, a third refused.
    second = await stream(one, chat(model="gated/m", stream=True))
    await stream_refused(one)
    gated.gate.set()
    for resp in (held, second):
        await asyncio.wait_for(resp.read(), 5)


# The limits alone: two replicas, places that end, a replica that dies.


def replica(server: RedisServer) -> RedisLimits:
    store = RedisStore(server.url, PREFIX, pool_timeout_s=1.0)
    return RedisLimits(store, rate=0, per_key=None, lease_s=LEASE_S, fallback=LocalLimits(0, None))


async def test_two_replicas_cut_off_together_refuse_until_the_key_is_under_its_limit(
    redis_server: RedisServer, redis: aioredis.Redis
) -> None:
    one, two = replica(redis_server), replica(redis_server)
    for limits in (one, two):
        await limits.store.start()
        await limits.start()
    try:
        redis_server.stop()
        # Each takes the key's whole limit; one of them closes before Redis is back.
        first = [await one.enter("sockets", "a", 2) for _ in range(3)]
        second = [await two.enter("sockets", "a", 2) for _ in range(2)]
        assert first[2] is None and None not in first[:2] + second
        gone = first[1]
        assert gone is not None
        one.leave(gone)  # never put back
        redis_server.start()
        await in_redis(redis, "sockets", 3)  # over the limit: what is open stays open
        members = {m.decode() for m in await redis.zrange(f"{PREFIX}:limits:sockets:a", 0, -1)}
        assert gone.id not in members
        assert await one.enter("sockets", "a", 2) is None
        assert await two.enter("sockets", "a", 2) is None
        place = second[0]
        assert place is not None
        two.leave(place)
        await in_redis(redis, "sockets", 2)
        assert await one.enter("sockets", "a", 2) is None  # 2 still open: at the limit
        # A replica that dies (stops renewing, releases nothing) loses them with its lease.
        assert two._ticker is not None
        two._ticker.cancel()
        await asyncio.sleep(LEASE_S + 0.2)
        again = await one.enter("sockets", "a", 2)
        assert again is not None
        await in_redis(redis, "sockets", 2)  # the one that stayed, and this one
    finally:
        for limits in (one, two):
            await limits.close()
            await limits.store.close()
