"""The store's command pipeline keeps one connection of the pool: taken once, checked before
each pipeline, given back at close (a store of one connection still closes at once)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from redis.exceptions import RedisError

from nexus.cache.redis import RedisStore
from nexus.cache.redis_pipeline import DOWN_S, SLOW_S, Pipeliner
from nexus.cache.redis_url import connect
from nexus.errors import StoreUnavailable
from redis_server import RedisServer
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


@contextlib.asynccontextmanager
async def pausable(
    server: RedisServer, store: RedisStore, deadline_s: float
) -> AsyncIterator[subprocess.Popen[bytes]]:
    """``store``, started on ``server`` with a round trip's deadline of ``deadline_s``, one
    key ``{prefix}:k`` set; yields the server's process, to pause (SIGSTOP), and always
    resumes it (the fixture stops it) and closes the store."""
    store.socket_timeout_s = deadline_s
    await store.start()
    process = server.process
    assert process is not None
    try:
        assert await store.call("t", ("SET", f"{store.prefix}:k", b"1")) == [b"OK"]
        yield process
    finally:
        process.send_signal(signal.SIGCONT)
        await store.close()


async def test_a_connection_closed_mid_round_trip_fails_that_one_only() -> None:
    """A kept connection Redis (or a proxy's idle timeout) closes while a round trip is on
    it fails that round trip; the next connects again at once. It does not put the store
    in its failing-fast moment, which is for a Redis that does not answer or connect."""
    client = await connect_or_skip()
    prefix = new_prefix()
    store = RedisStore(REDIS_URL, prefix=prefix, max_connections=2)
    await store.start()
    try:
        ((kept,),) = [await store.call("t", ("CLIENT", "ID"))]
        blocked = asyncio.ensure_future(store.call("t", ("BLPOP", f"{prefix}:never", 2)))
        await asyncio.sleep(0.2)
        assert await client.execute_command("CLIENT", "KILL", "ID", kept) == 1
        with pytest.raises(StoreUnavailable):
            await blocked
        started = time.monotonic()
        assert await store.call("t", ("SET", f"{prefix}:k", b"1")) == [b"OK"]
        assert time.monotonic() - started < 0.5
    finally:
        await store.close()
        await drop_keys(client, prefix)
        await client.aclose()


async def test_a_redis_that_stops_answering_fails_the_round_trip_in_time(
    redis_server: RedisServer,
) -> None:
    # The pipeline's connection has no per-reply timer: its round trip has one deadline.
    # Redis paused mid-life (SIGSTOP): the call fails as the store failing, within it,
    # and the next call after Redis is back goes through on a connection made again.
    store = RedisStore(redis_server.url, prefix="paused", max_connections=2)
    async with pausable(redis_server, store, 0.5) as process:
        process.send_signal(signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(StoreUnavailable):
            await store.call("t", ("GET", "paused:k"), ("GET", "paused:k"))
        assert 0.4 < time.monotonic() - started < 2.0
        process.send_signal(signal.SIGCONT)
        await asyncio.sleep(DOWN_S)  # (until then, calls fail at once: see below)
        assert await store.call("t", ("GET", "paused:k")) == [b"1"]


async def test_after_a_round_trip_redis_failed_calls_fail_at_once_then_it_is_tried_again(
    redis_server: RedisServer,
) -> None:
    """A request makes several round trips: behind a Redis that hangs, each waited out its
    own deadline, 15-30 s a request before its 503 (or before it ran on its replica alone
    with ``required = false``). After one fails, the calls of the next DOWN_S fail at once,
    those queued behind it too, counted ``unreachable``; then one goes, and decides."""
    store = RedisStore(redis_server.url, prefix="down")
    counted: list[tuple[str, str]] = []
    store.on_error.append(lambda op, cause: counted.append((op, cause)))
    async with pausable(redis_server, store, 0.5) as process:
        process.send_signal(signal.SIGSTOP)
        first = asyncio.ensure_future(store.call("first", ("GET", "down:k")))
        await asyncio.sleep(0.1)
        behind = asyncio.ensure_future(store.call("behind", ("GET", "down:k")))
        for call in (first, behind):
            with pytest.raises(StoreUnavailable):
                await call
        for op in ("begin", "admit", "charge"):
            started = time.monotonic()
            with pytest.raises(StoreUnavailable):
                await store.call(op, ("GET", "down:k"))
            assert time.monotonic() - started < 0.05, op
        assert {cause for _, cause in counted} == {"unreachable"} and len(counted) == 5
        await asyncio.sleep(DOWN_S)  # then one goes: Redis still stopped, it waits, fails
        started = time.monotonic()
        with pytest.raises(StoreUnavailable):
            await store.call("probe", ("GET", "down:k"))
        assert time.monotonic() - started > 0.4
        process.send_signal(signal.SIGCONT)
        await asyncio.sleep(DOWN_S)
        assert await store.call("back", ("GET", "down:k")) == [b"1"]
        assert await store.call("again", ("GET", "down:k")) == [b"1"]


async def test_calls_behind_a_round_trip_unanswered_past_slow_s_fail_at_once(
    redis_server: RedisServer,
) -> None:
    """Behind a Redis that hangs, every call that came while the probe waited out its 5 s
    queued behind it and waited the rest (5.0, 4.75, 4.5... s): most requests, not one in
    a while. Past SLOW_S unanswered, the calls that come fail at once."""
    store = RedisStore(redis_server.url, prefix="slow")
    async with pausable(redis_server, store, 3.0) as process:
        process.send_signal(signal.SIGSTOP)
        probe = asyncio.ensure_future(store.call("probe", ("GET", "slow:k")))
        await asyncio.sleep(SLOW_S + 0.2)
        started = time.monotonic()
        with pytest.raises(StoreUnavailable):
            await store.call("later", ("GET", "slow:k"))
        assert time.monotonic() - started < 0.05
        with pytest.raises(StoreUnavailable):
            await probe
        process.send_signal(signal.SIGCONT)
        await asyncio.sleep(DOWN_S)
        assert await store.call("back", ("GET", "slow:k")) == [b"1"]


async def test_commands_queued_behind_a_redis_that_stopped_answering_count_it_unreachable(
    redis_server: RedisServer,
) -> None:
    """A call queued past ``pool_timeout_s`` behind a round trip that Redis never answers
    fails with that round trip, counted ``unreachable`` like it; only a queue behind round
    trips that went through (a slow or overloaded Redis) is ``busy``."""
    store = RedisStore(redis_server.url, prefix="queued", pool_timeout_s=0.1)
    counted: list[tuple[str, str]] = []
    store.on_error.append(lambda op, cause: counted.append((op, cause)))
    async with pausable(redis_server, store, 0.6) as process:
        process.send_signal(signal.SIGSTOP)
        first = asyncio.ensure_future(store.call("first", ("GET", "queued:k")))
        await asyncio.sleep(0.3)  # in flight, unanswered: the next one queues past its wait
        with pytest.raises(StoreUnavailable):
            await store.call("queued", ("GET", "queued:k"))
        with pytest.raises(StoreUnavailable):
            await first
        assert sorted(counted) == [("first", "unreachable"), ("queued", "unreachable")]


async def test_a_wait_for_a_full_pool_does_not_put_the_store_in_its_failing_moment() -> None:
    """With the defaults the pool's wait and the round trip's deadline are both 5 s, so the
    deadline ended a wait for the pool first, and the store failed every call for a second
    though Redis was well. A full pool is busy, not Redis failing."""
    await (await connect_or_skip()).aclose()  # (skipped without a Redis)
    client = connect(
        REDIS_URL, max_connections=1, pool_timeout_s=0.3, socket_timeout_s=None, client_name="t"
    )
    pipeline = Pipeliner(client, 0.3, 0.3)
    held = await client.connection_pool.get_connection()  # type: ignore[no-untyped-call]
    try:
        with pytest.raises((TimeoutError, RedisError)):
            await pipeline.run([("PING",)])
        await client.connection_pool.release(held)
        assert await pipeline.run([("PING",)]) == [b"PONG"]
    finally:
        await pipeline.close()
        await client.connection_pool.disconnect()
        await client.aclose()
