"""Redis holds a bounded amount per stream, for a bounded time, and never serves a hole.

Against the real Redis at 127.0.0.1:6379 (skipped with the reason when there is
none, failed under ``CI=true``), each test on a key prefix of its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from nexus.cache.redis import RedisStore
from nexus.cache.store import StreamInfo, Write
from nexus.errors import StreamIncomplete
from nexus.events import Delta, Done, StreamEvent
from nexus.types import StreamMeta
from redis_support import REDIS_URL, append, connect_or_skip, drop_keys, new_prefix
from support import MakeClient, chat


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


async def read_all(store: RedisStore, stream_id: str, start: int = 0) -> list[StreamEvent]:
    async with asyncio.timeout(10):
        return [event async for batch in store.read(stream_id, start) for event in batch]


async def test_a_log_past_max_log_bytes_is_trimmed_and_not_served_from_its_start(
    redis_client: aioredis.Redis, prefix: str
) -> None:
    store = RedisStore(REDIS_URL, prefix, max_log_bytes=20_000)
    await store.start()
    try:
        info = make_info()
        await store.begin(info, 60)
        events: list[StreamEvent] = [Delta(content=f"token {i:05d} ") for i in range(3000)]
        for at in range(0, len(events), 100):
            assert await append(store, info, at, events[at : at + 100])
        key = f"{prefix}:stream:{info.id}:log"
        kept = await redis_client.xlen(key)
        assert kept < 1000  # about 20 kB of ~40-byte entries, trimmed by whole nodes
        assert await redis_client.memory_usage(key) < 80_000
        info.status = "completed"
        await store.end(info, [*events, Done()], len(events), 60)
        with pytest.raises(StreamIncomplete):
            await read_all(store, info.id)  # entry 0 is gone: an error, not a partial log
        tail = await read_all(store, info.id, len(events) - 10)
        assert tail == [*events[-10:], Done()]
    finally:
        await store.close()


async def test_a_log_under_max_log_bytes_as_the_run_counts_it_is_never_trimmed(
    redis_client: aioredis.Redis, prefix: str
) -> None:
    """The bound counts what the run counts (128 + characters per text delta), not the
    UTF-8 bytes of the copy: text of emoji, CJK or escaped control characters takes
    several times more bytes than characters, and a stream the run let finish must
    resume whole."""
    store = RedisStore(REDIS_URL, prefix, max_log_bytes=20_000)
    await store.start()
    try:
        info = make_info()
        await store.begin(info, 60)
        # 10 x 1,628 = 16,280 as counted; 10 x ~6,000 bytes of JSON in Redis.
        events: list[StreamEvent] = [Delta(content="\U0001f600" * 1500) for _ in range(10)]
        for at in range(len(events)):  # one entry each: trimming works on whole entries
            assert await append(store, info, at, events[at : at + 1])
        info.status = "completed"
        await store.end(info, [*events, Done()], len(events), 60)
        assert await read_all(store, info.id) == [*events, Done()]
    finally:
        await store.close()


async def test_a_log_lost_in_a_restart_is_noticed_and_written_again_whole(
    redis_client: aioredis.Redis, prefix: str
) -> None:
    store = RedisStore(REDIS_URL, prefix)
    await store.start()
    try:
        info = make_info()
        await store.begin(info, 60)
        events: list[StreamEvent] = [Delta(content=f"t{i} ") for i in range(6)]
        assert await append(store, info, 0, events[:3])
        await redis_client.delete(f"{prefix}:stream:{info.id}:log")  # a restart, say
        assert not await append(store, info, 3, events[3:])  # not written with a hole
        assert not await redis_client.exists(f"{prefix}:stream:{info.id}:log")
        info.status = "completed"
        await store.end(info, [*events, Done()], 3, 60)  # rewrites it from entry 0
        assert await read_all(store, info.id) == [*events, Done()]
    finally:
        await store.close()


async def write_a_log_with_a_hole(store: RedisStore) -> tuple[StreamInfo, list[StreamEvent]]:
    """A finished log of six tokens, ``t0 `` to ``t5 ``, of which 2 and 3 are missing (as
    after a stale restore); its info, and the six."""
    info = make_info()
    await store.begin(info, 60)
    events: list[StreamEvent] = [Delta(content=f"t{i} ") for i in range(6)]
    assert await append(store, info, 0, events[:2])
    assert await append(store, info, 4, events[4:])
    info.status = "completed"
    await store.end(info, [*events, Done()], 6, 60)
    return info, events


async def test_a_log_with_a_hole_is_an_error_for_its_reader(
    redis_client: aioredis.Redis, prefix: str
) -> None:
    store = RedisStore(REDIS_URL, prefix)
    await store.start()
    try:
        info, events = await write_a_log_with_a_hole(store)
        with pytest.raises(StreamIncomplete):
            await read_all(store, info.id)
        with pytest.raises(StreamIncomplete):
            await read_all(store, info.id, 1)
        assert await read_all(store, info.id, 4) == [*events[4:], Done()]
    finally:
        await store.close()


async def test_a_client_resuming_a_log_with_a_hole_gets_an_error_never_the_hole(
    make_client: MakeClient, redis_client: aioredis.Redis, prefix: str
) -> None:
    """Over HTTP: before any byte, 410 ``stream_incomplete``; after the part before the hole
    was sent, the format's error frame, then its end. Never the entries past it as if whole."""
    store = RedisStore(REDIS_URL, prefix)
    await store.start()
    try:
        info, _ = await write_a_log_with_a_hole(store)
    finally:
        await store.close()
    client = await make_client({"store": {"kind": "redis", "url": REDIS_URL, "prefix": prefix}})
    # From the start: the first page holds only entry 0, so the hole comes after bytes.
    resp = await client.get(f"/v1/streams/{info.id}?stream_format=ndjson")
    assert resp.status == 200
    lines = [line for line in (await resp.text()).splitlines() if line]
    assert lines[:2] == [
        '{"type":"delta","delta":{"content":"t0 "}}',
        '{"type":"delta","delta":{"content":"t1 "}}',
    ]
    assert '"code":"stream_incomplete"' in lines[-2] and lines[-1] == '{"type":"done"}'
    assert not any("t4" in line or "t5" in line for line in lines)
    # From inside the hole: nothing can be sent, so the status says it.
    resp = await client.get(f"/v1/streams/{info.id}?stream_format=ndjson&last_event_id=3")
    assert resp.status == 410
    assert (await resp.json())["error"]["code"] == "stream_incomplete"


async def test_a_thousand_streams_leave_no_key_behind_after_their_ttls(
    make_client: MakeClient, redis_client: aioredis.Redis, prefix: str
) -> None:
    config = {
        "store": {"kind": "redis", "url": REDIS_URL, "prefix": prefix},
        "streams": {"resume_ttl_s": 2},
        "cache": {"enabled": True, "ttl_s": 2},
    }
    client = await make_client(config)

    async def one(i: int) -> None:
        resp = await client.post("/v1/chat/completions", json=chat(f"hello {i}", stream=True))
        assert resp.status == 200
        assert (await resp.read()).endswith(b"data: [DONE]\n\n")

    for at in range(0, 1000, 50):
        await asyncio.gather(*(one(i) for i in range(at, at + 50)))
    await asyncio.sleep(0.1)  # the last keepers hand their logs over

    keys = [key async for key in redis_client.scan_iter(match=f"{prefix}:*", count=1000)]
    # Logs, infos, recordings of the streams within their TTLs (on a slow machine the
    # first ones may already be gone: ~2,500 when all 1,000 streams took under 2 s).
    assert len(keys) > 100
    pipe = redis_client.pipeline(transaction=False)
    for key in keys:
        pipe.pttl(key)
        pipe.memory_usage(key)
    replies = await pipe.execute()
    ttls, sizes = replies[0::2], replies[1::2]
    forever = [key for key, ttl in zip(keys, ttls, strict=True) if ttl == -1]
    assert forever == []  # every key the gateway writes expires
    # Measured: ~2,500 keys, ~4.6 MB (a Redis stream starts with a 4 kB node).
    assert sum(size or 0 for size in sizes) < 8_000 * 1000

    await asyncio.sleep(2.2)  # past resume_ttl_s and the cache's ttl_s
    left = [key async for key in redis_client.scan_iter(match=f"{prefix}:*", count=1000)]
    # Only this replica's keep-alive and its beat's mark (renewed while it runs, deleted
    # when it stops).
    replica, beat = sorted(left)
    assert replica.startswith(f"{prefix}:replica:".encode())
    assert beat == replica + b":beat"


async def test_a_mirror_write_that_failed_does_not_count_toward_the_trim(
    redis_client: aioredis.Redis, prefix: str
) -> None:
    """The keeper retries a failed write from the same entry: the bytes of the attempts
    that never reached Redis must not count as the log's size, or a log well under
    max_log_bytes is trimmed and a reader from its start gets StreamIncomplete."""
    from nexus.errors import StoreUnavailable

    store = RedisStore(REDIS_URL, prefix, max_log_bytes=60_000)
    await store.start()
    try:
        info = make_info()
        await store.begin(info, 60)
        events: list[StreamEvent] = [Delta(content=f"token {i:05d} ") for i in range(400)]
        for at in range(200):  # one entry each: trimming works on whole nodes of entries
            assert await append(store, info, at, events[at : at + 1])
        real_call = store.call

        async def down(op: str, *commands: object, allow: str = "") -> list[object]:
            raise StoreUnavailable("Redis is down")

        store.call = down  # type: ignore[method-assign]
        for _ in range(4):  # the keeper's retries while Redis is down
            with pytest.raises(StoreUnavailable):
                await append(store, info, 200, events[200:])
        store.call = real_call  # type: ignore[method-assign]
        assert await append(store, info, 200, events[200:])
        info.status = "completed"
        await store.end(info, [*events, Done()], len(events), 60)
        # 400 x (128 + 12) = 56,000 as the bound counts them: under it, nothing may be
        # trimmed (the four failed attempts would have counted 112,000 more).
        assert await read_all(store, info.id) == [*events, Done()]
    finally:
        await store.close()


async def test_the_end_of_a_log_lost_in_a_restart_is_not_written_without_its_entries(
    redis_client: aioredis.Redis, prefix: str
) -> None:
    """An end whose entries were refused (the log vanished: NOMKSTREAM) must not mark the
    stream finished nor drop its owner: a reader elsewhere would take the missing log for
    an ended one (stream_incomplete) in the turn before the keeper rewrites it from 0."""
    store = RedisStore(REDIS_URL, prefix)
    await store.start()
    try:
        info = make_info()
        await store.begin(info, 60)
        events: list[StreamEvent] = [Delta(content=f"t{i} ") for i in range(6)]
        assert await append(store, info, 0, events[:3])
        await redis_client.delete(f"{prefix}:stream:{info.id}:log")  # a restart, say
        info.status = "completed"
        (written,) = await store.mirror([Write(info, [*events[3:], Done()], 3, end=True)], 60)
        assert not written
        stored = await store.info(info.id)
        assert stored is not None and stored.status == "in_progress"
        assert await redis_client.exists(f"{prefix}:stream:{info.id}:owner")
        # The keeper's next turn writes it whole, and its end with it.
        await store.mirror([Write(info, [*events, Done()], 0, end=True)], 60)
        assert await read_all(store, info.id) == [*events, Done()]
    finally:
        await store.close()
