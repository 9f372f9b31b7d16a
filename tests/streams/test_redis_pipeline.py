"""The store's command pipeline keeps one connection of the pool: taken once, checked before
each pipeline, given back at close (a store of one connection still closes at once)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from nexus.cache.redis import RedisStore
from redis_support import REDIS_URL, connect_or_skip, drop_keys, new_prefix


async def test_pipelines_share_one_connection_taken_once(monkeypatch: pytest.MonkeyPatch) -> None:
    client = await connect_or_skip()
    prefix = new_prefix()
    store = RedisStore(REDIS_URL, prefix=prefix, max_connections=1)
    await store.start()
    taken: list[Any] = []
    pool = store.client.connection_pool
    get = pool.get_connection
    monkeypatch.setattr(pool, "get_connection", lambda: taken.append(1) or get())
    try:
        for i in range(20):  # one after another: twenty pipelines
            assert await store.call(
                "t", ("SET", f"{prefix}:k{i}", i), ("GET", f"{prefix}:k{i}")
            ) == [
                b"OK",
                str(i).encode(),
            ]
        assert len(taken) <= 1  # (none when the heartbeat's pipeline took it first)
    finally:
        started = time.monotonic()
        await store.close()
        # The replica's key is deleted on the pool's only connection: given back first,
        # not waited for until the pool's timeout.
        assert time.monotonic() - started < 2.0
        assert await client.exists(f"{prefix}:replica:{store.replica_id}") == 0
        await drop_keys(client, prefix)
        await client.aclose()


async def test_a_kept_connection_closed_by_redis_is_connected_again() -> None:
    client = await connect_or_skip()
    prefix = new_prefix()
    store = RedisStore(REDIS_URL, prefix=prefix, max_connections=1)
    await store.start()
    try:
        await store.call("t", ("SET", f"{prefix}:k", b"1"))
        # Redis closes the kept connection (as a restart closes them all).
        ((kept,),) = [await store.call("t", ("CLIENT", "ID"))]
        assert await client.execute_command("CLIENT", "KILL", "ID", kept) == 1
        await asyncio.sleep(0.1)  # the close arrives
        assert await store.call("t", ("GET", f"{prefix}:k")) == [b"1"]
    finally:
        await store.close()
        await drop_keys(client, prefix)
        await client.aclose()
