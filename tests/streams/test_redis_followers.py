"""Followers share blocking reads: hundreds of streams followed from another replica take
a handful of Redis connections, and every one of them is read whole, in order.

Against the real Redis at 127.0.0.1:6379 (skipped with the reason when there is none).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis

from nexus.cache import redis_log
from nexus.cache.redis import RedisStore
from nexus.cache.redis_log import KEYS_PER_READ
from nexus.cache.store import StreamInfo
from nexus.events import Delta, Done, StreamEvent
from nexus.types import StreamMeta
from redis_support import REDIS_URL, append, connect_or_skip, drop_keys, new_prefix

STREAMS = 500
ROUNDS = 4


@pytest.fixture
async def redis_client() -> AsyncIterator[aioredis.Redis]:
    client = await connect_or_skip()
    yield client
    await client.aclose()


@pytest.fixture
async def prefix(redis_client: aioredis.Redis) -> AsyncIterator[str]:
    name = new_prefix()
    yield name
    await drop_keys(redis_client, name)


def make_info() -> StreamInfo:
    meta = StreamMeta.new("mock/echo", include_usage=False, provider="mock", upstream_model="m")
    return StreamInfo(meta=meta, format="text/event-stream")


async def clients_of(redis_client: aioredis.Redis, store: RedisStore, cmd: str = "") -> int:
    """Connections of ``store`` (whose last command was ``cmd``, if given)."""
    listed = await redis_client.client_list()
    name = f"nexus-{store.replica_id}"
    return sum(1 for c in listed if c["name"] == name and (not cmd or c["cmd"] == cmd))


async def test_many_followed_streams_share_a_few_connections(
    redis_client: aioredis.Redis, prefix: str
) -> None:
    owner = RedisStore(REDIS_URL, prefix)
    follower = RedisStore(REDIS_URL, prefix, block_s=0.5)
    await owner.start()
    await follower.start()
    try:
        infos = [make_info() for _ in range(STREAMS)]
        await asyncio.gather(*(owner.begin(info, 60) for info in infos))
        logs: dict[str, list[StreamEvent]] = {info.id: [] for info in infos}

        async def follow(info: StreamInfo) -> list[StreamEvent]:
            return [event async for batch in follower.read(info.id) for event in batch]

        readers = [asyncio.create_task(follow(info)) for info in infos]
        peak = 0
        for n in range(ROUNDS):
            await asyncio.sleep(0.2)  # the readers are following now
            peak = max(peak, await clients_of(redis_client, follower))

            async def grow(info: StreamInfo, n: int = n) -> None:
                log = logs[info.id]
                added = [Delta(content=f"{info.id[-4:]} {n}.{i} ") for i in range(n + 1)]
                assert await append(owner, info, len(log), added)
                log += added

            await asyncio.gather(*(grow(info) for info in infos))
        for info in infos:
            info.status = "completed"
            logs[info.id].append(Done())
        await asyncio.gather(
            *(owner.end(info, logs[info.id], len(logs[info.id]) - 1, 60) for info in infos)
        )
        async with asyncio.timeout(30):
            got = await asyncio.gather(*readers)

        assert [len(events) for events in got] == [1 + sum(range(1, ROUNDS + 1))] * STREAMS
        assert got == [logs[info.id] for info in infos]  # each whole, in order
        assert len(follower.followers) == -(-STREAMS // KEYS_PER_READ)
        assert 0 < peak < 20, peak  # not one per stream
    finally:
        await follower.close()
        await owner.close()
    assert await clients_of(redis_client, follower) == 0  # closed: none left behind


async def test_the_connections_of_a_spike_of_followers_are_closed_once_idle(
    redis_client: aioredis.Redis, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A spike of followers opens a connection per 250 followed logs; once they are gone,
    each connection that follows nothing for ``IDLE_READ_S`` is closed, and a follower
    after that opens one again."""
    monkeypatch.setattr(redis_log, "IDLE_READ_S", 2.0)  # (above the block time)
    owner = RedisStore(REDIS_URL, prefix)
    follower = RedisStore(REDIS_URL, prefix, block_s=0.5)
    await owner.start()
    await follower.start()

    async def follow(info: StreamInfo) -> list[StreamEvent]:
        return [event async for batch in follower.read(info.id) for event in batch]

    async def spike(count: int) -> None:
        infos = [make_info() for _ in range(count)]
        await asyncio.gather(*(owner.begin(info, 60) for info in infos))
        readers = [asyncio.create_task(follow(info)) for info in infos]
        reads = -(-count // KEYS_PER_READ)
        async with asyncio.timeout(10):  # following now, a connection per 250 of them
            while (
                len(follower.followers) < reads
                or await clients_of(redis_client, follower, "xread") < reads
            ):
                await asyncio.sleep(0.05)
        for info in infos:
            info.status = "completed"
        tail = [Delta(content="last "), Done()]
        await asyncio.gather(*(owner.end(info, tail, 0, 60) for info in infos))
        async with asyncio.timeout(30):
            assert await asyncio.gather(*readers) == [tail] * count

    try:
        await spike(300)
        async with asyncio.timeout(15):  # closed in Redis too, not only let go of
            while len(follower.followers) or await clients_of(redis_client, follower, "xread"):
                await asyncio.sleep(0.1)
        await spike(10)  # a new follower after that: a connection again
    finally:
        await follower.close()
        await owner.close()


async def test_a_new_follower_interrupts_the_blocked_read(prefix: str) -> None:
    store = RedisStore(REDIS_URL, prefix, block_s=10)  # a read blocks long: not waited out
    await store.start()
    errors: list[str] = []
    store.on_error.append(errors.append)
    try:
        first, second = make_info(), make_info()
        for info in (first, second):
            await store.begin(info, 60)

        async def follow(info: StreamInfo) -> list[StreamEvent]:
            return [event async for batch in store.read(info.id) for event in batch]

        reading = asyncio.create_task(follow(first))
        await asyncio.sleep(0.3)  # blocked in XREAD on the first key alone
        joining = asyncio.create_task(follow(second))
        await asyncio.sleep(0.3)
        second.status = "completed"
        started = asyncio.get_running_loop().time()
        await store.end(second, [Delta(content="hi"), Done()], 0, 60)
        async with asyncio.timeout(5):
            assert await joining == [Delta(content="hi"), Done()]
        assert asyncio.get_running_loop().time() - started < 2.0  # not at the block's end
        assert len(store.followers) == 1
        reading.cancel()
        assert errors == []
    finally:
        await store.close()


async def test_a_reader_behind_another_on_the_same_log_reads_it_whole(prefix: str) -> None:
    """Two readers of one log on one replica, one slower (its client reads slowly): the
    slow one asks for entries the blocked read of the fast one starts past. It must get
    them, not the fast one's later entries (a false hole: StreamIncomplete)."""
    owner = RedisStore(REDIS_URL, prefix)
    follower = RedisStore(REDIS_URL, prefix, block_s=5)
    await owner.start()
    await follower.start()
    try:
        info = make_info()
        await owner.begin(info, 60)
        log: list[StreamEvent] = []

        async def add(n: int) -> None:
            added = [Delta(content=f"{n}.{i} ") for i in range(2)]
            assert await append(owner, info, len(log), added)
            log.extend(added)

        await add(0)
        slow = follower.read(info.id)
        got_slow = list(await slow.__anext__())  # caught up, then its client stalls

        async def fast_reader() -> list[StreamEvent]:
            return [event async for batch in follower.read(info.id) for event in batch]

        fast = asyncio.create_task(fast_reader())
        await asyncio.sleep(0.2)
        await add(1)  # the fast reader reads it; the slow one does not yet
        await asyncio.sleep(0.2)  # the fast reader blocks again, past entry 1
        more = asyncio.create_task(slow.__anext__())  # the slow one asks for entry 1 on
        await asyncio.sleep(0.2)
        await add(2)
        async with asyncio.timeout(3):
            while len(got_slow) < len(log):
                got_slow += await more
                if len(got_slow) < len(log):
                    more = asyncio.create_task(slow.__anext__())
        assert got_slow == log
        await slow.aclose()
        fast.cancel()
    finally:
        await follower.close()
        await owner.close()


async def test_an_unblock_that_reaches_redis_before_the_read_is_sent_again(prefix: str) -> None:
    """CLIENT UNBLOCK goes on another connection than the XREAD it ends: sent while that
    XREAD is still on its way (the loop marks it blocked, then sends it), it reaches Redis
    first and unblocks nothing. The new follower must not wait for the whole block."""
    store = RedisStore(REDIS_URL, prefix, block_s=10)
    await store.start()
    try:
        first, second = make_info(), make_info()
        for info in (first, second):
            await store.begin(info, 60)

        async def follow(info: StreamInfo) -> list[StreamEvent]:
            return [event async for batch in store.read(info.id) for event in batch]

        reading = asyncio.create_task(follow(first))
        for _ in range(500):  # blocked in XREAD on the first key alone (a loaded host: later)
            if store.followers._reads:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        (read,) = store.followers._reads
        xread = read.client.xread
        sent = asyncio.Event()

        async def slow_xread(*args: Any, **kwargs: Any) -> Any:
            sent.set()
            await asyncio.sleep(0.2)  # on its way to Redis (a slow network, a busy loop)
            return await xread(*args, **kwargs)

        read.client.xread = slow_xread  # type: ignore[method-assign]
        await append(store, first, 0, [Delta(content="a")])  # the read returns; the next one
        await asyncio.wait_for(sent.wait(), 2)  # ... is marked blocked, not yet at Redis
        joining = asyncio.create_task(follow(second))  # its UNBLOCK overtakes the XREAD
        await asyncio.sleep(0.5)
        second.status = "completed"
        started = asyncio.get_running_loop().time()
        await store.end(second, [Delta(content="hi"), Done()], 0, 60)
        async with asyncio.timeout(12):
            assert await joining == [Delta(content="hi"), Done()]
        waited = asyncio.get_running_loop().time() - started
        assert waited < 2.0, f"the new follower waited {waited:.1f}s, the read's block"
        reading.cancel()
    finally:
        await store.close()
