"""What one API key holds in Redis is bounded by ``[store] max_bytes_per_key``, counted by
every replica alike (nexus.cache.redis_quota), against a ``redis-server`` of the test's own.

Without the bound, one key repeating a cached 3.5 MB request 100 times (no upstream call)
took Redis from 1 MiB to 358 MiB, kept for ``resume_ttl_s``.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import redis.asyncio as aioredis

from nexus.auth import hash_key
from nexus.cache.redis import RedisStore
from nexus.cache.store import Recording, StreamInfo
from nexus.events import Delta, Done, StreamEvent
from nexus.types import StreamMeta
from redis_server import RedisServer
from redis_support import append
from support import MakeClient, chat

PREFIX = "quota"
LIMIT = 60_000
"""Bytes per key in these tests: five logs of about 10 kB, and change."""


@pytest.fixture
def server() -> Iterator[RedisServer]:
    redis_server = RedisServer()
    redis_server.start()
    try:
        yield redis_server
    finally:
        redis_server.stop()


@pytest.fixture
async def client(server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    redis_client = aioredis.Redis.from_url(server.url)
    yield redis_client
    await redis_client.aclose()


async def started(server: RedisServer, limit: int | None = LIMIT) -> RedisStore:
    store = RedisStore(server.url, PREFIX, max_bytes_per_key=limit)
    await store.start()
    return store


def make_info(owner: str | None) -> StreamInfo:
    meta = StreamMeta.new("mock/echo", include_usage=False, provider="mock", upstream_model="m")
    return StreamInfo(meta=meta, format="text/event-stream", owner=owner, status="completed")


def text(size: int) -> list[StreamEvent]:
    """About ``size`` bytes of events."""
    return [Delta(content="x" * 1000) for _ in range(size // 1000)]


async def finished(store: RedisStore, owner: str | None, ttl_s: float = 60) -> str:
    """A finished log of about 10 kB of ``owner``'s; its stream id."""
    info = make_info(owner)
    await store.end(info, [*text(10_000), Done()], 0, ttl_s)
    await asyncio.sleep(0.003)  # another millisecond: a later expiry than the one before
    return info.id


async def kept(store: RedisStore, stream_ids: list[str]) -> list[bool]:
    return [await store.info(stream_id) is not None for stream_id in stream_ids]


async def counted(client: aioredis.Redis, owner: str) -> int:
    return int(await client.hget(f"{PREFIX}:quota:{owner}:sizes", "*") or 0)


async def test_a_key_past_its_limit_loses_its_own_oldest_finished_entries_only(
    server: RedisServer, client: aioredis.Redis
) -> None:
    store = await started(server)
    evicted: list[tuple[str, int]] = []
    store.on_evict.append(lambda why, count: evicted.append((why, count)))
    try:
        bobs = [await finished(store, "bob") for _ in range(2)]
        nobodys = [await finished(store, None) for _ in range(8)]  # no keys: not counted
        running = make_info("alice")
        running.status = "in_progress"
        await store.begin(running, 60)
        assert await append(store, running, 0, text(20_000))  # alive, never deleted
        alices = [await finished(store, "alice") for _ in range(8)]
        await store.put_recording("r1", Recording(text(5_000), [0.0] * 5), 60, "alice")
        # 60 kB for alice: her running 20 kB, and of her finished 10 kB logs, the newest
        # that fit beside it and the recording (which is newer than all of them).
        assert await kept(store, alices) == [False] * 5 + [True] * 3
        assert sum(count for _, count in evicted) == 5  # nexus_store_evictions_total
        assert {why for why, _ in evicted} == {"key_limit"}
        assert await kept(store, bobs) == [True, True]
        assert await kept(store, nobodys) == [True] * 8
        assert await kept(store, [running.id]) == [True]
        assert await store.get_recording("r1") is not None
        assert 40_000 < await counted(client, "alice") <= LIMIT
        assert 20_000 < await counted(client, "bob") < 30_000
        assert not await client.exists(f"{PREFIX}:quota:None:sizes")
        running.status = "completed"
        # Ended with 20 kB more: it stays, as the newest, and pushes out her oldest two.
        await store.end(running, [*text(20_000), *text(20_000), Done()], 20, 60)
        assert await kept(store, [running.id, *alices[5:]]) == [True, False, False, True]
        assert await counted(client, "alice") <= LIMIT
    finally:
        await store.close()


async def test_a_growing_live_log_pushes_out_its_keys_finished_logs_never_itself(
    server: RedisServer, client: aioredis.Redis
) -> None:
    store = await started(server, limit=200_000)
    try:
        old = [await finished(store, "alice") for _ in range(10)]
        running = make_info("alice")
        running.status = "in_progress"
        await store.begin(running, 60)
        for at in range(0, 300):  # 300 kB in 1 kB turns: counted every 64 kB (STEP)
            assert await append(store, running, at, text(1000))
        assert await kept(store, old) == [False] * 10  # all went, and it stays
        assert await kept(store, [running.id]) == [True]
        assert 230_000 < await counted(client, "alice") <= 300_256
    finally:
        await store.close()


async def test_replicas_sharing_a_prefix_keep_one_count(
    server: RedisServer, client: aioredis.Redis
) -> None:
    one, two = await started(server), await started(server)
    try:
        logs = []
        for turn in range(12):
            logs.append(await finished(one if turn % 2 else two, "alice"))
        # One count for both: five logs of 10 kB fit, whichever replica wrote them.
        assert await kept(one, logs) == [False] * 7 + [True] * 5
        sizes = await client.hgetall(f"{PREFIX}:quota:alice:sizes")
        members = {key for key in sizes if key != b"*"}
        assert members == {f"log:{stream_id}".encode() for stream_id in logs[7:]}
        assert int(sizes[b"*"]) == sum(int(sizes[member]) for member in members)
    finally:
        await one.close()
        await two.close()


async def test_the_count_expires_with_what_it_counts(
    server: RedisServer, client: aioredis.Redis
) -> None:
    store = await started(server)
    try:
        early = await finished(store, "alice", ttl_s=0.4)
        keys = [f"{PREFIX}:quota:alice:{part}" for part in ("sizes", "done")]
        for key in keys:
            assert 0 < await client.pttl(key) <= 400
        await asyncio.sleep(0.5)
        assert await client.exists(*keys) == 0  # gone with the log it counted
        await finished(store, "alice", ttl_s=30)
        late = await finished(store, "alice", ttl_s=0.3)
        assert 25_000 < await client.pttl(keys[0]) <= 30_000  # the longest-lived entry's
        await asyncio.sleep(0.4)
        await finished(store, "alice", ttl_s=30)  # the expired one leaves the count
        sizes = await client.hgetall(keys[0])
        assert f"log:{early}".encode() not in sizes and f"log:{late}".encode() not in sizes
        assert 20_000 < int(sizes[b"*"]) < 25_000
    finally:
        await store.close()


KEY_A, KEY_B = "sk-alpha-" + os.urandom(8).hex(), "sk-beta-" + os.urandom(8).hex()


async def test_cache_hits_repeated_by_one_key_stay_within_its_bytes(
    make_client: MakeClient, server: RedisServer, client: aioredis.Redis
) -> None:
    """A flood of cache hits, smaller: one key repeats a cached 100 kB request as JSON; each
    replay is a new log of 100 kB, and another key's log must survive them."""
    config: dict[str, Any] = {
        "auth": {
            "keys": [
                {"name": "alpha", "sha256": hash_key(KEY_A)},
                {"name": "beta", "sha256": hash_key(KEY_B)},
            ]
        },
        "cache": {"enabled": True},
        "limits": {"requests_per_second_per_key": 1000},
        "store": {"kind": "redis", "url": server.url, "prefix": PREFIX, "max_bytes_per_key": 2**20},
    }
    gateway = await make_client(config)
    beta = await gateway.post(
        "/v1/chat/completions", json=chat("b " * 1000), headers={"Authorization": f"Bearer {KEY_B}"}
    )
    beta_id = (await beta.json())["id"]
    body = chat(" ".join(["y" * 999] * 100))  # 100 deltas of 1 kB
    for _ in range(40):
        resp = await gateway.post(
            "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY_A}"}
        )
        assert resp.status == 200
        await resp.read()
    assert resp.headers["X-Nexus-Cache"] == "hit"
    await asyncio.sleep(0.2)  # the last ends mirrored
    logs = [key async for key in client.scan_iter(match=f"{PREFIX}:stream:*:log")]
    assert 5 <= len(logs) <= 12  # 40 without the bound: about 4 MB
    assert await counted(client, "alpha") <= 2**20
    assert await client.exists(f"{PREFIX}:stream:{beta_id}:log")
    assert len([key async for key in client.scan_iter(match=f"{PREFIX}:rec:*")]) == 2
