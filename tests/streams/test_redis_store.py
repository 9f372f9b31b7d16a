"""RedisStore against a real Redis: the Store contract end to end, plus what only Redis has
(live following across tasks, TTLs, atomic claims, cancelled blocking reads)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any

import orjson
import pytest
import redis.asyncio as aioredis

from nexus.cache.codec import loads_events
from nexus.cache.redis import RedisStore, RedisUnavailable, redact_url
from nexus.cache.store import Recording, StreamInfo
from nexus.errors import StreamNotFound
from nexus.events import (
    Audio,
    Citation,
    Delta,
    Done,
    Error,
    Image,
    Reasoning,
    StreamEvent,
    ToolCall,
    Usage,
)
from nexus.types import StreamMeta
from redis_support import REDIS_URL, append, connect_or_skip, drop_keys, new_prefix

MakeStore = Callable[..., Awaitable[RedisStore]]

BODY: list[StreamEvent] = [
    Delta(role="assistant", content=""),
    Reasoning("Let me think… 🤔\nline two"),
    Reasoning("", signature="EqQBCkYIARgCKkB=="),
    Delta(content='Héllo, "world"\n'),
    Delta(
        tool_calls=(
            ToolCall(0, id="call_1", name="get_weather", arguments=""),
            ToolCall(0, arguments='{"city": "Par'),
        )
    ),
    ToolCall(1, id="call_2", name="lookup", arguments="{}"),
    Delta(refusal="I can't do that."),
    Audio(data="UklGRg==", format="pcm16", transcript="hi"),
    Audio(transcript="only text"),
    Image(data="iVBORw0KGgo=", mime_type="image/png"),
    Image(url="https://example.com/a.png"),
    Citation(url="https://example.com", title="Example", quoted="quoted text"),
    Delta(finish_reason="tool_calls"),
    Usage(
        prompt_tokens=5,
        completion_tokens=3,
        total_tokens=8,
        cached_tokens=2,
        cache_write_tokens=1,
        reasoning_tokens=4,
    ),
]
ERROR = Error(
    error_type="upstream_error",
    message="upstream went away",
    code="upstream_error",
    retryable=True,
    param="model",
)
TERMINALS: list[StreamEvent] = [Done(aborted=True), ERROR, Done()]


def make_info(status: Any = "in_progress") -> StreamInfo:
    meta = StreamMeta.new("gpt-test", include_usage=True, provider="mock", upstream_model="m-1")
    return StreamInfo(meta=meta, format="text/event-stream", owner="replica-a", status=status)


def finished(info: StreamInfo, status: Any = "completed") -> StreamInfo:
    return StreamInfo(info.meta, info.format, info.owner, status, info.created_at)


async def read_all(store: RedisStore, stream_id: str, start: int = 0) -> list[list[StreamEvent]]:
    async with asyncio.timeout(10):
        return [batch async for batch in store.read(stream_id, start)]


def flat(batches: list[list[StreamEvent]]) -> list[StreamEvent]:
    return [event for batch in batches for event in batch]


@pytest.fixture
async def redis_client() -> AsyncIterator[aioredis.Redis]:
    client = await connect_or_skip()
    yield client
    await client.aclose()


@pytest.fixture
async def prefix(redis_client: aioredis.Redis) -> AsyncIterator[str]:
    prefix = new_prefix()
    yield prefix
    await drop_keys(redis_client, prefix)


@pytest.fixture
async def make_store(prefix: str) -> AsyncIterator[MakeStore]:
    """``await make_store(**kwargs)``: a started RedisStore on this test's prefix."""
    stores: list[RedisStore] = []

    async def factory(**kwargs: Any) -> RedisStore:
        store = RedisStore(REDIS_URL, prefix, **kwargs)
        await store.start()
        stores.append(store)
        return store

    yield factory
    for store in stores:
        await store.close()


@pytest.fixture
async def store(make_store: MakeStore) -> RedisStore:
    return await make_store(block_s=0.2)


# Logs.
@pytest.mark.parametrize("terminal", TERMINALS, ids=lambda e: repr(e))
async def test_begin_append_end_roundtrip(
    store: RedisStore, redis_client: aioredis.Redis, prefix: str, terminal: StreamEvent
) -> None:
    assert store.shared is True
    info = make_info()
    events = [*BODY, terminal]
    await store.begin(info, ttl_s=30)
    assert await store.info(info.id) == info
    await append(store, info, 0, events[:5])
    await append(store, info, 5, events[5:9])
    done = finished(info, "failed" if terminal is ERROR else "completed")
    await store.end(done, events, 9, ttl_s=20)

    assert await store.info(info.id) == done
    assert flat(await read_all(store, info.id)) == events
    # The layout other replicas rely on: an entry per append, its ID 0-{index after its
    # last event}, its one field "e" the JSON array of its events' codec form.
    entries = await redis_client.xrange(f"{prefix}:stream:{info.id}:log") or []
    assert [entry_id for entry_id, _ in entries] == [b"0-5", b"0-9", f"0-{len(events)}".encode()]
    assert all(fields is not None and list(fields) == [b"e"] for _, fields in entries)
    assert loads_events(entries[1][1][b"e"]) == events[5:9]


async def test_an_info_written_by_a_newer_replica_still_reads(
    store: RedisStore, redis_client: aioredis.Redis, prefix: str
) -> None:
    """Mid rolling upgrade, a newer replica's meta may carry a field this one lacks."""
    info = make_info()
    await store.begin(info, ttl_s=30)
    key = f"{prefix}:stream:{info.id}:info"
    stored = orjson.loads(await redis_client.get(key) or b"{}")
    stored["meta"]["a_field_from_the_future"] = 1
    await redis_client.set(key, orjson.dumps(stored), ex=30)
    assert await store.info(info.id) == info


async def test_the_prompt_s_estimate_stays_with_the_replica_that_runs_the_stream(
    store: RedisStore, redis_client: aioredis.Redis, prefix: str
) -> None:
    """Only the owner charges it; replicas from before it was added refuse a meta with it."""
    info = make_info()
    info.meta = replace(info.meta, prompt_estimate=1234, upstream_accepted=True)
    await store.begin(info, ttl_s=30)
    stored = orjson.loads(await redis_client.get(f"{prefix}:stream:{info.id}:info") or b"{}")
    assert "prompt_estimate" not in stored["meta"]
    assert "upstream_accepted" not in stored["meta"]
    assert stored["meta"]["model"] == info.meta.model
    unstored = replace(info.meta, prompt_estimate=0, upstream_accepted=False)
    assert await store.info(info.id) == replace(info, meta=unstored)


async def test_end_without_begin_writes_everything(store: RedisStore) -> None:
    info = make_info("completed")
    events = [*BODY, Done()]
    await store.end(info, events, 0, ttl_s=30)
    assert await store.info(info.id) == info
    assert flat(await read_all(store, info.id)) == events


async def test_read_from_an_index(store: RedisStore) -> None:
    info = make_info("completed")
    events = [*BODY, Done()]
    await store.end(info, events, 0, ttl_s=30)
    assert flat(await read_all(store, info.id, 3)) == events[3:]
    assert flat(await read_all(store, info.id, len(events) - 1)) == [Done()]
    # At or past the end of a finished log: nothing, and no waiting.
    started = time.monotonic()
    assert await read_all(store, info.id, len(events)) == []
    assert await read_all(store, info.id, len(events) + 5) == []
    assert time.monotonic() - started < 0.5


async def test_read_pages_a_long_log(store: RedisStore) -> None:
    info = make_info("completed")
    events: list[StreamEvent] = [*(Delta(content=str(i)) for i in range(2500)), Done()]
    await store.end(info, events, 0, ttl_s=30)
    assert await store.client.xlen(f"{store.prefix}:stream:{info.id}:log") == 6  # 500 a piece
    assert flat(await read_all(store, info.id)) == events
    assert flat(await read_all(store, info.id, 1234)) == events[1234:]


async def test_a_finished_log_without_terminal_ends_the_read(store: RedisStore) -> None:
    info = make_info("cancelled")
    await store.end(info, BODY[:3], 0, ttl_s=30)
    assert flat(await read_all(store, info.id)) == BODY[:3]


async def test_read_follows_a_live_stream(make_store: MakeStore) -> None:
    # A long block: a batch that arrives promptly was pushed by XREAD, not polled for.
    store = await make_store(block_s=10)
    info = make_info()
    events = [*BODY, Done()]
    await store.begin(info, ttl_s=30)
    await append(store, info, 0, events[:2])

    received: asyncio.Queue[tuple[float, list[StreamEvent]]] = asyncio.Queue()

    async def follow() -> None:
        async for batch in store.read(info.id, 1):
            received.put_nowait((time.monotonic(), batch))

    reader = asyncio.create_task(follow())
    async with asyncio.timeout(5):
        _, first = await received.get()
        assert first == events[1:2]  # caught up from index 1

        await asyncio.sleep(0.2)  # the reader is now blocked in XREAD
        sent = time.monotonic()
        await append(store, info, 2, events[2:6])
        got: list[StreamEvent] = []
        while len(got) < 4:
            arrived, batch = await received.get()
            assert arrived - sent < 1.0
            got += batch
        assert got == events[2:6]

        await store.end(finished(info), events, 6, ttl_s=30)
        await reader  # stops by itself after the terminal
    rest: list[StreamEvent] = []
    while not received.empty():
        rest += received.get_nowait()[1]
    assert rest == events[6:]


async def test_read_waits_for_the_first_entry(store: RedisStore) -> None:
    """Begun but nothing appended yet: the info exists, the log does not; that is not unknown."""
    info = make_info()
    await store.begin(info, ttl_s=30)
    reader = asyncio.create_task(read_all(store, info.id))
    await asyncio.sleep(0.5)  # past a few XREAD timeouts
    assert not reader.done()
    await store.end(finished(info), [Delta(content="x"), Done()], 0, ttl_s=30)
    assert flat(await reader) == [Delta(content="x"), Done()]


async def test_a_followed_stream_that_ends_without_terminal_stops_the_reader(
    store: RedisStore,
) -> None:
    info = make_info()
    await store.begin(info, ttl_s=30)
    await append(store, info, 0, BODY[:1])
    reader = asyncio.create_task(read_all(store, info.id))
    await asyncio.sleep(0.3)
    await store.end(finished(info, "cancelled"), BODY[:2], 1, ttl_s=30)
    assert flat(await reader) == BODY[:2]


async def test_read_unknown_stream(store: RedisStore) -> None:
    with pytest.raises(StreamNotFound) as caught:
        await read_all(store, "nope")
    assert str(caught.value) == "No stream 'nope': unknown, or expired."
    assert caught.value.status == 404
    assert await store.info("nope") is None


async def test_finished_log_expires(store: RedisStore, redis_client: aioredis.Redis) -> None:
    info = make_info("completed")
    await store.end(info, [Delta(content="x"), Done()], 0, ttl_s=0.2)
    assert await store.info(info.id) == info
    await asyncio.sleep(0.4)
    assert await store.info(info.id) is None
    with pytest.raises(StreamNotFound):
        await read_all(store, info.id)


async def test_live_log_expiring_while_followed(store: RedisStore) -> None:
    """The owner stopped appending (it died): the follower gets StreamNotFound, not a hang."""
    info = make_info()
    await store.begin(info, ttl_s=0.3)
    await append(store, info, 0, BODY[:2])
    batches: list[list[StreamEvent]] = []
    with pytest.raises(StreamNotFound):
        async with asyncio.timeout(3):
            async for batch in store.read(info.id):
                batches.append(batch)
    assert flat(batches) == BODY[:2]


async def test_ttls(store: RedisStore, redis_client: aioredis.Redis, prefix: str) -> None:
    info = make_info()
    keys = [f"{prefix}:stream:{info.id}:info", f"{prefix}:stream:{info.id}:log"]
    await store.begin(info, ttl_s=1.0)
    await asyncio.sleep(0.5)
    await append(store, info, 0, BODY[:1])  # renews both to begin's TTL
    for key in keys:  # not renewed, at most 500 would be left (a loaded host is slow)
        assert 600 < await redis_client.pttl(key) <= 1000
    await store.end(finished(info), [*BODY[:1], Done()], 1, ttl_s=60)
    for key in keys:
        assert 59_000 < await redis_client.pttl(key) <= 60_000


async def test_append_is_safe_to_replay(store: RedisStore) -> None:
    """A retried pipeline re-sends entries Redis already has: they are skipped, not doubled."""
    info = make_info()
    await store.begin(info, ttl_s=30)
    await append(store, info, 0, BODY[:2])
    await append(store, info, 0, BODY[:2])
    await append(store, info, 1, BODY[1:4])
    await store.end(finished(info), [*BODY[:4], Done()], 4, ttl_s=30)
    assert flat(await read_all(store, info.id)) == [*BODY[:4], Done()]


async def test_a_log_written_before_begin_still_expires(
    store: RedisStore, redis_client: aioredis.Redis, prefix: str
) -> None:
    info = make_info()
    assert await append(store, info, 0, BODY[:1])  # not begun here: the TTL given
    assert 0 < await redis_client.pttl(f"{prefix}:stream:{info.id}:log") <= 30_000


async def test_a_cancelled_blocked_read_leaves_the_connection_usable(
    make_store: MakeStore,
) -> None:
    # One connection only: had the cancelled XREAD's connection gone back to the pool
    # undrained, the next command would read its stale reply (or find no connection).
    client = aioredis.Redis.from_url(REDIS_URL, max_connections=1)
    try:
        store = await make_store(client=client, block_s=10)
        info = make_info()
        await store.begin(info, ttl_s=30)
        reader = asyncio.create_task(read_all(store, info.id))
        await asyncio.sleep(0.3)  # blocked in XREAD
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader

        await append(store, info, 0, BODY[:3])
        assert await store.info(info.id) == info
        await store.end(finished(info), [*BODY[:3], Done()], 3, ttl_s=30)
        assert flat(await read_all(store, info.id)) == [*BODY[:3], Done()]
        assert await store.claim("k", "a", 5) is None
        await store.close()  # before its client: it stops its keep-alive task
    finally:
        await client.aclose()


# Leases.
async def test_leases(store: RedisStore) -> None:
    assert await store.leased("s1") is False
    await store.lease("s1", ttl_s=0.2)
    assert await store.leased("s1") is True
    assert await store.leased("s2") is False
    await asyncio.sleep(0.3)
    assert await store.leased("s1") is False


async def test_a_lease_left_by_its_reader_lapses_after_the_hold_not_its_full_ttl(
    store: RedisStore,
) -> None:
    await store.lease("s1", ttl_s=60)
    await store.unlease("s1", hold_s=0.5, resumable_hold_s=30)
    left, made = await store.held("s1", resumable=True)
    assert 0 < left <= 0.5 and not made
    await store.make_resumable("s1", ttl_s=60, hold_s=0.1)  # a join elsewhere
    await store.unlease("s1", hold_s=0.5, resumable_hold_s=30)  # now the resumable hold
    left, made = await store.held("s1", resumable=False)
    assert 0.5 < left <= 30 and made


async def test_a_stream_its_owner_ends_for_want_of_clients_is_not_made_resumable(
    store: RedisStore,
) -> None:
    # The owner found no lease and no join: it cancels the stream, and says so atomically.
    assert await store.held("s1", resumable=False) == (0.0, False)
    assert not await store.make_resumable("s1", ttl_s=60, hold_s=5)
    assert not await store.leased("s1")
    # Made resumable before the owner asked: the owner learns it, and waits.
    assert await store.make_resumable("s2", ttl_s=60, hold_s=5)
    left, made = await store.held("s2", resumable=False)
    assert 4 < left <= 5 and made
    info = make_info()
    await store.begin(info, 60)
    assert await store.make_resumable(info.id, ttl_s=60, hold_s=5)
    found = await store.info(info.id)
    assert found is not None and found.resumable  # every replica's readers see it


async def test_a_plain_join_elsewhere_holds_the_stream_in_the_step_that_checks_it(
    store: RedisStore,
) -> None:
    """A plain request that joined a stream of another replica took its lease only once
    its reader began, round trips later: the owner, its last client gone meanwhile, found
    no lease and cancelled the stream under it (about one join in ten)."""
    assert await store.hold_for_join("s1", hold_s=5)
    left, made = await store.held("s1", resumable=False)
    assert 4 < left <= 5 and not made  # the owner waits for the joiner
    assert await store.held("s2", resumable=False) == (0.0, False)  # the owner ends it
    assert not await store.hold_for_join("s2", hold_s=5)  # too late: a fresh call instead
    assert not await store.leased("s2")


# Recordings.
async def test_recordings(store: RedisStore) -> None:
    recording = Recording(
        events=list(BODY),
        offsets=[i * 0.125 for i in range(len(BODY))],
        provider="mock",
        upstream_model="m-1",
    )
    assert await store.get_recording("req-1") is None
    await store.put_recording("req-1", recording, ttl_s=0.3)
    assert await store.get_recording("req-1") == recording
    assert await store.get_recording("req-2") is None
    await asyncio.sleep(0.4)
    assert await store.get_recording("req-1") is None


# In-flight claims.
async def test_claims(store: RedisStore) -> None:
    assert await store.claim("k", "a", ttl_s=5) is None
    assert await store.claim("k", "b", ttl_s=5) == "a"
    assert await store.claim("k", "a", ttl_s=5) is None  # the holder again
    await store.release("k", "b")  # not the holder: no effect
    assert await store.claim("k", "c", ttl_s=5) == "a"
    await store.release("k", "a")
    assert await store.claim("k", "b", ttl_s=5) is None
    assert await store.claim("other", "z", ttl_s=5) is None


async def test_claims_expire(store: RedisStore) -> None:
    assert await store.claim("k", "a", ttl_s=0.2) is None
    await asyncio.sleep(0.3)
    assert await store.claim("k", "b", ttl_s=5) is None
    await store.release("k", "a")  # expired and taken since: must not drop b's claim
    assert await store.claim("k", "c", ttl_s=5) == "b"


async def test_concurrent_claims_have_one_winner(make_store: MakeStore) -> None:
    stores = [await make_store() for _ in range(3)]  # as if three replicas
    results = await asyncio.gather(*(stores[i % 3].claim("k", f"s{i}", ttl_s=5) for i in range(30)))
    winners = [f"s{i}" for i, held in enumerate(results) if held is None]
    assert len(winners) == 1
    assert {held for held in results if held is not None} == set(winners)


# Connecting.
@pytest.mark.parametrize(
    "url",
    [
        "redis://user:secret@127.0.0.1:1/0",
        "redis://:secret@127.0.0.1:1/0",
        "redis://127.0.0.1:1/0?password=secret",
    ],
)
async def test_start_failure_names_the_url_without_secrets(url: str) -> None:
    store = RedisStore(url)
    with pytest.raises(RedisUnavailable) as caught:
        await store.start()
    assert isinstance(caught.value, ConnectionError)
    assert "127.0.0.1:1" in str(caught.value)
    assert "secret" not in str(caught.value)
    assert caught.value.__cause__ is None
    await store.close()


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://user:pw@redis.internal:6380/2", "redis://redis.internal:6380/2"),
        ("rediss://:pw@host/1?password=pw&ssl_cert_reqs=none", "rediss://host/1"),
        ("redis://u:p@[::1]:6379/0", "redis://[::1]:6379/0"),
        ("unix:///run/redis.sock?db=0&password=pw", "unix:///run/redis.sock"),
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
    ],
)
def test_redact_url(url: str, shown: str) -> None:
    assert redact_url(url) == shown


async def test_close_is_idempotent(prefix: str) -> None:
    store = RedisStore(REDIS_URL, prefix)
    await store.start()
    await store.close()
    await store.close()
    with pytest.raises(RuntimeError, match="before start"):
        await store.info("x")


async def test_close_fails_the_commands_its_pipeline_was_sending(prefix: str) -> None:
    """A command in flight when the store closes (shutdown) gets an answer: the store's
    error, not a wait that never ends."""
    from nexus.errors import StoreUnavailable

    store = RedisStore(REDIS_URL, prefix)
    await store.start()
    in_flight = asyncio.create_task(store.call("test", ("BLPOP", f"{prefix}:none", 1)))
    await asyncio.sleep(0.2)  # sent: its reply is awaited
    await store.close()
    with pytest.raises((StoreUnavailable, asyncio.CancelledError)):
        async with asyncio.timeout(3):
            await in_flight
