"""The mirror of live logs into Redis: one task for every stream of the process, their
growth written together, their TTLs renewed together; nothing per stream in between.

Runs against the real Redis at 127.0.0.1:6379 (skipped with the reason when there is
none, failed under ``CI=true``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
import redis.asyncio as aioredis
from aiohttp import ClientResponse

from nexus.cache.store import Write
from nexus.server.state import HUB
from redis_support import REDIS_URL, connect_or_skip, drop_keys, new_prefix
from support import GatedProvider, MakeClient, chat


@pytest.fixture
async def redis_client() -> AsyncIterator[aioredis.Redis]:
    client = await connect_or_skip()
    try:
        yield client
    finally:
        await client.aclose()


@pytest.fixture
async def prefix(redis_client: aioredis.Redis) -> AsyncIterator[str]:
    name = new_prefix()
    try:
        yield name
    finally:
        await drop_keys(redis_client, name)


def redis_config(prefix: str, **tables: Any) -> dict[str, Any]:
    return {"store": {"kind": "redis", "url": REDIS_URL, "prefix": prefix}, **tables}


async def test_streams_are_mirrored_together_by_one_task(
    make_client: MakeClient, prefix: str
) -> None:
    gated = GatedProvider(before=2, after=3)
    client = await make_client(redis_config(prefix), providers=[gated])
    hub = client.app[HUB]
    store = hub.store
    batches: list[list[str]] = []
    mirror = store.mirror

    async def counted(writes: Sequence[Write], ttl_s: float) -> list[bool]:
        batches.append([write.info.id for write in writes])
        return await mirror(writes, ttl_s)

    store.mirror = counted  # type: ignore[method-assign]
    responses = [
        await client.post(
            "/v1/chat/completions?stream_format=nexus", json=chat(model="gated/m", stream=True)
        )
        for _ in range(10)
    ]
    for resp in responses:
        seen = b""
        while seen.count(b"event: delta") < 2:
            seen += await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5)
    assert len(hub.live) == 10
    assert len(hub.keeper.tasks) == 1  # the mirror: no task per stream

    batches.clear()
    gated.gate.set()  # every stream grows at once, then ends
    for resp in responses:
        assert (await asyncio.wait_for(resp.read(), 10)).endswith(b'data: {"type":"done"}\n\n')
    await hub.drain()
    assert hub.live == {} and hub.keeper.tasks == set()  # the mirror stops with no stream left
    # Their growth went together: a round trip per turn, not one per stream and read.
    assert max(len(batch) for batch in batches) >= 5
    assert len(batches) < 10 * 5


async def test_a_quiet_stream_is_renewed_until_it_ends(
    make_client: MakeClient, prefix: str, redis_client: aioredis.Redis
) -> None:
    gated = GatedProvider(before=1, after=1)
    client = await make_client(redis_config(prefix, streams={"resume_ttl_s": 0.6}), [gated])
    resp = await client.post(
        "/v1/chat/completions?stream_format=nexus", json=chat(model="gated/m", stream=True)
    )
    stream_id = resp.headers["X-Nexus-Stream-Id"]
    await asyncio.wait_for(resp.content.readuntil(b"event: delta"), 5)
    await asyncio.sleep(1.5)  # quiet for more than twice its TTL: renewed every 0.2 s
    for part in ("info", "log", "owner"):
        assert 0 < await redis_client.pttl(f"{prefix}:stream:{stream_id}:{part}") <= 600
    gated.gate.set()
    await asyncio.wait_for(resp.read(), 5)
    await client.app[HUB].drain()
    assert await redis_client.exists(f"{prefix}:stream:{stream_id}:owner") == 0
    assert 0 < await redis_client.pttl(f"{prefix}:stream:{stream_id}:log") <= 600


async def two_gated_streams(
    make_client: MakeClient, prefix: str
) -> tuple[GatedProvider, GatedProvider, Any, list[ClientResponse]]:
    """Two streams running on a Redis-mirrored gateway (providers ``first`` and
    ``second``, each gated), their first frames read: the providers, hub and responses."""
    first, second = GatedProvider("first"), GatedProvider("second")
    client = await make_client(redis_config(prefix), providers=[first, second])
    responses = []
    for name in ("first", "second"):
        resp = await client.post(
            "/v1/chat/completions?stream_format=nexus", json=chat(model=f"{name}/m", stream=True)
        )
        await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5)
        responses.append(resp)
    return first, second, client.app[HUB], responses


async def end_written(keeper: Any, stream_id: str) -> None:
    """Until the keeper no longer keeps ``stream_id`` (its end is written; 5 s at most)."""
    for _ in range(500):
        if stream_id not in keeper._kept:
            return
        await asyncio.sleep(0.01)


async def test_a_mark_that_comes_after_a_streams_end_was_written_is_ignored(
    make_client: MakeClient, prefix: str
) -> None:
    # The finish's callback may reach the keeper after the turn that wrote the end: the
    # mirror must not write that end again, nor fail on a stream it no longer keeps (the
    # failure ended the mirror's task, and the streams still running went unmirrored).
    first, second, hub, responses = await two_gated_streams(make_client, prefix)
    keeper = hub.keeper
    kept = {k.run.info.meta.provider: k for k in keeper._kept.values()}
    second.gate.set()
    assert (await asyncio.wait_for(responses[1].read(), 10)).endswith(b'{"type":"done"}\n\n')
    await end_written(keeper, kept["second"].run.id)
    assert list(keeper._kept.values()) == [kept["first"]]
    written: list[str] = []
    mirror = hub.store.mirror

    async def counted(writes: Sequence[Write], ttl_s: float) -> list[bool]:
        written.extend(write.info.id for write in writes)
        return await mirror(writes, ttl_s)

    hub.store.mirror = counted  # type: ignore[method-assign]
    keeper._mark(kept["second"])  # late
    await asyncio.sleep(0.1)  # a turn or more
    first.gate.set()  # the running stream grows and ends: still mirrored
    assert (await asyncio.wait_for(responses[0].read(), 10)).endswith(b'{"type":"done"}\n\n')
    await hub.drain()
    assert kept["second"].run.id not in written
    assert kept["first"].run.id in written


async def test_a_mark_that_comes_while_a_streams_end_is_written_is_dropped(
    make_client: MakeClient, prefix: str
) -> None:
    # The finish's callback may reach the keeper while the turn that writes the end is in
    # flight: the next turn must not write that end again (it failed on a stream it no
    # longer kept, which ended the mirror's task: the streams still running went
    # unmirrored, and a reader on another replica waited for their TTL).
    first, second, hub, responses = await two_gated_streams(make_client, prefix)
    keeper = hub.keeper
    kept = {k.run.info.meta.provider: k for k in keeper._kept.values()}
    written: list[tuple[str, bool]] = []
    mirror = hub.store.mirror

    async def marking(writes: Sequence[Write], ttl_s: float) -> list[bool]:
        written.extend((write.info.id, write.end) for write in writes)
        for write in writes:
            if write.end:
                keeper._mark(kept["second"])  # in flight: marked again
        return await mirror(writes, ttl_s)

    hub.store.mirror = marking  # type: ignore[method-assign]
    second.gate.set()
    assert (await asyncio.wait_for(responses[1].read(), 10)).endswith(b'{"type":"done"}\n\n')
    await end_written(keeper, kept["second"].run.id)
    await asyncio.sleep(0.1)  # a turn or more
    first.gate.set()  # the running stream grows and ends: still mirrored
    assert (await asyncio.wait_for(responses[0].read(), 10)).endswith(b'{"type":"done"}\n\n')
    await hub.drain()
    assert written.count((kept["second"].run.id, True)) == 1
    assert (kept["first"].run.id, True) in written
    assert keeper._mirror is None and not keeper._kept


@pytest.mark.parametrize(("interval_ms", "entries"), [(10, range(8, 30)), (400, range(1, 3))])
async def test_the_mirror_interval_sets_how_many_tokens_a_write_carries(
    make_client: MakeClient,
    redis_client: aioredis.Redis,
    prefix: str,
    interval_ms: int,
    entries: range,
) -> None:
    """``[store] mirror_interval_ms``: 20 tokens 25 ms apart are an entry each of the log in
    Redis at 10 ms (and the end one), and one or two at 400 ms (the stream is over before
    the first turn); either way another replica reads them whole."""
    store = {"kind": "redis", "url": REDIS_URL, "prefix": prefix}
    client = await make_client({"store": {**store, "mirror_interval_ms": interval_ms}})
    assert client.app[HUB].store.mirror_interval_s == interval_ms / 1000
    words = " ".join(f"w{i}" for i in range(20))
    resp = await client.post(
        "/v1/chat/completions?stream_format=ndjson",
        json=chat(stream=True, mock={"content": words, "delay_ms": 25}),
    )
    assert resp.status == 200
    stream_id = resp.headers["X-Nexus-Stream-Id"]
    await resp.read()
    key = f"{prefix}:stream:{stream_id}:log"
    async with asyncio.timeout(5):  # the end is written after the last turn
        while b'"in_progress"' in (
            await redis_client.get(f"{prefix}:stream:{stream_id}:info") or b'"in_progress"'
        ):
            await asyncio.sleep(0.05)
    assert await redis_client.xlen(key) in entries
    other = await make_client({"store": store})
    replay = await other.get(f"/v1/streams/{stream_id}?stream_format=ndjson")
    text = "".join(
        line.split('"content":"')[1].split('"')[0]
        for line in (await replay.text()).splitlines()
        if '"content":"' in line
    )
    assert text.split() == words.split()
