"""The in-process store: finished logs, recordings and claims; TTLs; the byte bound."""

from __future__ import annotations

import asyncio

import pytest

from nexus.cache import MemoryStore, Recording, StreamInfo
from nexus.cache.codec import event_size
from nexus.errors import GatewayError, StreamNotFound
from nexus.events import Delta, Done, Error, Reasoning, StreamEvent, ToolCall, Usage
from nexus.types import StreamMeta

LONG = 60.0
SHORT = 0.05

LOG: list[StreamEvent] = [
    Delta(role="assistant", content=""),
    Reasoning("hmm", signature="sig"),
    Delta(content="Hello"),
    Delta(tool_calls=(ToolCall(0, "call_1", "f", "{}"),)),
    Delta(finish_reason="stop"),
    Usage(5, 3, 8, cached_tokens=1),
    Done(),
]


def info(stream_id: str = "chatcmpl-aaaaaaaaaaaa") -> StreamInfo:
    meta = StreamMeta(id=stream_id, model="mock/echo", created=1700000000)
    return StreamInfo(meta=meta, format="text/event-stream", status="completed")


def log_size(events: list[StreamEvent]) -> int:
    """What the store charges for a finished log."""
    return 256 + sum(event_size(event) for event in events)


def recording_size(recording: Recording) -> int:
    return 256 + sum(event_size(event) + 8 for event in recording.events)


async def read_all(store: MemoryStore, stream_id: str, start: int = 0) -> list[StreamEvent]:
    return [event async for batch in store.read(stream_id, start) for event in batch]


# --- logs -------------------------------------------------------------------------------


async def test_end_info_read_round_trip() -> None:
    store = MemoryStore()
    stream = info()
    await store.end(stream, LOG, 3, LONG)
    assert await store.info(stream.id) == stream
    assert await read_all(store, stream.id) == LOG
    assert len(store) == 1
    assert store.size == log_size(LOG)


@pytest.mark.parametrize("start", [0, 1, 3, len(LOG) - 1, len(LOG), len(LOG) + 5])
async def test_read_from_an_index(start: int) -> None:
    store = MemoryStore()
    await store.end(info(), LOG, 0, LONG)
    batches = [batch async for batch in store.read(info().id, start)]
    assert [event for batch in batches for event in batch] == LOG[start:]
    assert all(batch for batch in batches), "no empty batches"


async def test_read_gives_a_copy() -> None:
    store = MemoryStore()
    events = list(LOG)
    await store.end(info(), events, 0, LONG)
    async for batch in store.read(info().id):
        batch.clear()
    assert await read_all(store, info().id) == LOG


async def test_unknown_stream() -> None:
    store = MemoryStore()
    assert await store.info("chatcmpl-nope") is None
    with pytest.raises(StreamNotFound) as caught:
        await read_all(store, "chatcmpl-nope")
    assert isinstance(caught.value, GatewayError)
    assert caught.value.status == 404
    assert caught.value.code == "stream_not_found"
    assert "chatcmpl-nope" in caught.value.message


async def test_a_log_expires() -> None:
    store = MemoryStore()
    await store.end(info("chatcmpl-short"), LOG, 0, SHORT)
    await store.end(info("chatcmpl-long"), LOG, 0, LONG)
    assert await store.info("chatcmpl-short") is not None
    await asyncio.sleep(SHORT + 0.02)
    assert await store.info("chatcmpl-short") is None
    with pytest.raises(StreamNotFound):
        await read_all(store, "chatcmpl-short")
    assert await read_all(store, "chatcmpl-long") == LOG
    assert len(store) == 1
    assert store.size == log_size(LOG)


async def test_read_of_an_expired_log_raises() -> None:
    store = MemoryStore()
    await store.end(info(), LOG, 0, SHORT)
    await asyncio.sleep(SHORT + 0.02)
    with pytest.raises(StreamNotFound):
        await read_all(store, info().id)
    assert len(store) == 0
    assert store.size == 0


async def test_end_again_replaces_the_log() -> None:
    store = MemoryStore()
    await store.end(info(), LOG, 0, LONG)
    shorter = [*LOG[:2], Done(aborted=True)]
    await store.end(info(), shorter, 0, LONG)
    assert await read_all(store, info().id) == shorter
    assert len(store) == 1
    assert store.size == log_size(shorter)


# --- the byte bound ---------------------------------------------------------------------


def sized_log(n: int) -> list[StreamEvent]:
    events: list[StreamEvent] = [Delta(content="x" * 200) for _ in range(n)]
    return [*events, Done()]


async def test_eviction_is_oldest_first() -> None:
    one = log_size(sized_log(4))
    store = MemoryStore(max_bytes=3 * one + 10)
    for name in ("a", "b", "c"):
        await store.end(info(f"chatcmpl-{name}"), sized_log(4), 0, LONG)
    assert len(store) == 3
    assert store.size == 3 * one

    await store.end(info("chatcmpl-d"), sized_log(4), 0, LONG)
    assert [await store.info(f"chatcmpl-{n}") is not None for n in "abcd"] == [
        False,
        True,
        True,
        True,
    ]
    assert len(store) == 3
    assert store.size == 3 * one

    # Something twice as big pushes out the two oldest.
    big = sized_log(9)
    assert one < log_size(big) <= 2 * one
    await store.end(info("chatcmpl-e"), big, 0, LONG)
    kept = [n for n in "abcde" if await store.info(f"chatcmpl-{n}") is not None]
    assert kept == ["d", "e"]
    assert store.size == one + log_size(big) <= store.max_bytes
    assert len(store) == 2
    with pytest.raises(StreamNotFound):
        await read_all(store, "chatcmpl-b")
    assert await read_all(store, "chatcmpl-e") == big


async def test_replacing_an_entry_makes_it_the_newest() -> None:
    one = log_size(sized_log(4))
    store = MemoryStore(max_bytes=3 * one)
    for name in ("a", "b", "c"):
        await store.end(info(f"chatcmpl-{name}"), sized_log(4), 0, LONG)
    await store.end(info("chatcmpl-a"), sized_log(4), 0, LONG)
    assert store.size == 3 * one
    await store.end(info("chatcmpl-d"), sized_log(4), 0, LONG)
    kept = [n for n in "abcd" if await store.info(f"chatcmpl-{n}") is not None]
    assert kept == ["a", "c", "d"]
    assert store.size == 3 * one


async def test_expired_entries_go_before_live_ones() -> None:
    one = log_size(sized_log(4))
    store = MemoryStore(max_bytes=2 * one)
    await store.end(info("chatcmpl-old-live"), sized_log(4), 0, LONG)
    await store.end(info("chatcmpl-new-short"), sized_log(4), 0, SHORT)
    await asyncio.sleep(SHORT + 0.02)
    await store.end(info("chatcmpl-newest"), sized_log(4), 0, LONG)
    assert await store.info("chatcmpl-old-live") is not None
    assert await store.info("chatcmpl-newest") is not None
    assert len(store) == 2
    assert store.size == 2 * one


async def test_an_item_larger_than_the_store_is_not_kept() -> None:
    store = MemoryStore(max_bytes=1000)
    small: list[StreamEvent] = [Delta(content="hi"), Done()]
    await store.end(info("chatcmpl-small"), small, 0, LONG)
    huge: list[StreamEvent] = [Delta(content="x" * 2000), Done()]
    await store.end(info("chatcmpl-huge"), huge, 0, LONG)
    assert await store.info("chatcmpl-huge") is None
    with pytest.raises(StreamNotFound):
        await read_all(store, "chatcmpl-huge")
    assert await read_all(store, "chatcmpl-small") == small, "the others stay"
    assert store.size == log_size(small)
    assert len(store) == 1

    # Replacing a kept entry with one too large drops both; the count stays right.
    await store.end(info("chatcmpl-small"), huge, 0, LONG)
    assert await store.info("chatcmpl-small") is None
    assert store.size == 0
    assert len(store) == 0


async def test_size_accounting_after_mixed_churn() -> None:
    store = MemoryStore(max_bytes=5000)
    recording = Recording(events=[Delta(content="r" * 300)], offsets=[0.0])
    logs: dict[str, int] = {}  # stream id -> size of its last log
    recordings: set[str] = set()
    for round_ in range(30):
        stream_id = f"chatcmpl-{round_ % 9:04d}"
        events = sized_log(round_ % 7)
        await store.end(info(stream_id), events, 0, LONG)
        logs[stream_id] = log_size(events)
        if round_ % 4 == 0:
            recordings.add(f"key-{round_ % 3}")
            await store.put_recording(f"key-{round_ % 3}", recording, LONG)
        kept_logs = [s for s in logs if await store.info(s) is not None]
        kept_recordings = [k for k in recordings if await store.get_recording(k) is not None]
        assert stream_id in kept_logs, "the newest entry stays"
        expected = sum(logs[s] for s in kept_logs) + recording_size(recording) * len(
            kept_recordings
        )
        assert store.size == expected <= store.max_bytes
        assert len(store) == len(kept_logs) + len(kept_recordings)


# --- recordings -------------------------------------------------------------------------

RECORDING = Recording(
    events=[Delta(content="Hel"), Delta(content="lo"), Delta(finish_reason="stop")],
    offsets=[0.0, 0.1, 0.2],
    provider="mock",
    upstream_model="echo",
)


async def test_recording_put_get() -> None:
    store = MemoryStore()
    assert await store.get_recording("key") is None
    await store.put_recording("key", RECORDING, LONG)
    assert await store.get_recording("key") == RECORDING
    assert await store.get_recording("other") is None
    assert store.size == recording_size(RECORDING)


async def test_recordings_and_logs_do_not_collide() -> None:
    store = MemoryStore()
    await store.put_recording("chatcmpl-same", RECORDING, LONG)
    assert await store.info("chatcmpl-same") is None
    with pytest.raises(StreamNotFound):
        await read_all(store, "chatcmpl-same")
    await store.end(info("chatcmpl-same"), LOG, 0, LONG)
    assert await store.get_recording("chatcmpl-same") == RECORDING
    assert await read_all(store, "chatcmpl-same") == LOG
    assert len(store) == 2
    assert store.size == recording_size(RECORDING) + log_size(LOG)


async def test_a_recording_expires() -> None:
    store = MemoryStore()
    await store.put_recording("key", RECORDING, SHORT)
    assert await store.get_recording("key") == RECORDING
    await asyncio.sleep(SHORT + 0.02)
    assert await store.get_recording("key") is None
    assert len(store) == 0
    assert store.size == 0


async def test_a_recording_is_evicted_like_a_log() -> None:
    store = MemoryStore(max_bytes=recording_size(RECORDING) + log_size(LOG) - 1)
    await store.put_recording("key", RECORDING, LONG)
    await store.end(info(), LOG, 0, LONG)
    assert await store.get_recording("key") is None
    assert await read_all(store, info().id) == LOG
    assert store.size == log_size(LOG)


async def test_put_recording_replaces() -> None:
    store = MemoryStore()
    await store.put_recording("key", RECORDING, LONG)
    other = Recording(events=[Delta(content="x")], offsets=[0.0])
    await store.put_recording("key", other, LONG)
    assert await store.get_recording("key") == other
    assert store.size == recording_size(other)


# --- claims -----------------------------------------------------------------------------


async def test_second_claimer_gets_the_holder() -> None:
    store = MemoryStore()
    assert await store.claim("k", "chatcmpl-a", LONG) is None
    assert await store.claim("k", "chatcmpl-b", LONG) == "chatcmpl-a"
    assert await store.claim("k", "chatcmpl-c", LONG) == "chatcmpl-a"
    assert await store.claim("other", "chatcmpl-b", LONG) is None


async def test_the_holder_may_claim_again() -> None:
    store = MemoryStore()
    assert await store.claim("k", "chatcmpl-a", LONG) is None
    assert await store.claim("k", "chatcmpl-a", LONG) is None
    assert await store.claim("k", "chatcmpl-b", LONG) == "chatcmpl-a"


async def test_a_reclaim_renews_the_ttl() -> None:
    store = MemoryStore()
    assert await store.claim("k", "chatcmpl-a", SHORT) is None
    assert await store.claim("k", "chatcmpl-a", LONG) is None
    await asyncio.sleep(SHORT + 0.02)
    assert await store.claim("k", "chatcmpl-b", LONG) == "chatcmpl-a"


async def test_release_only_by_the_holder() -> None:
    store = MemoryStore()
    assert await store.claim("k", "chatcmpl-a", LONG) is None
    await store.release("k", "chatcmpl-b")
    assert await store.claim("k", "chatcmpl-b", LONG) == "chatcmpl-a"
    await store.release("k", "chatcmpl-a")
    assert await store.claim("k", "chatcmpl-b", LONG) is None
    assert await store.claim("k", "chatcmpl-a", LONG) == "chatcmpl-b"
    await store.release("unknown", "chatcmpl-a")  # nothing to release: no error


async def test_an_expired_claim_can_be_taken_over() -> None:
    store = MemoryStore()
    assert await store.claim("k", "chatcmpl-a", SHORT) is None
    await asyncio.sleep(SHORT + 0.02)
    assert await store.claim("k", "chatcmpl-b", LONG) is None
    assert await store.claim("k", "chatcmpl-a", LONG) == "chatcmpl-b"
    # The old holder's release no longer drops the new claim.
    await store.release("k", "chatcmpl-a")
    assert await store.claim("k", "chatcmpl-c", LONG) == "chatcmpl-b"


async def test_claims_do_not_count_against_the_byte_bound() -> None:
    store = MemoryStore(max_bytes=300)
    for n in range(50):
        assert await store.claim(f"k{n}", f"chatcmpl-{n}", LONG) is None
    assert store.size == 0
    assert len(store) == 0


def test_memory_store_is_not_shared() -> None:
    assert MemoryStore.shared is False


async def test_a_log_ending_in_error_round_trips() -> None:
    store = MemoryStore()
    log: list[StreamEvent] = [Delta(content="partial"), Error("upstream_error", "boom")]
    await store.end(info(), log, 0, LONG)
    assert await read_all(store, info().id) == log


async def test_an_entry_replaced_with_a_longer_ttl_outlives_its_old_expiry() -> None:
    one = log_size(sized_log(4))
    store = MemoryStore(max_bytes=3 * one)
    await store.end(info("chatcmpl-aaaa-a"), sized_log(4), 0, SHORT)
    await store.end(info("chatcmpl-bbbb-b"), sized_log(4), 0, LONG)
    await store.end(info("chatcmpl-aaaa-a"), sized_log(4), 0, LONG)  # now the newest
    await asyncio.sleep(SHORT + 0.02)
    await store.end(info("chatcmpl-cccc-c"), sized_log(4), 0, LONG)
    await store.end(info("chatcmpl-dddd-d"), sized_log(4), 0, LONG)  # over: one must go
    assert await store.info("chatcmpl-aaaa-a") is not None, "its first expiry is stale"
    assert await store.info("chatcmpl-bbbb-b") is None, "the oldest live entry went"
    assert store.size == 3 * one


async def test_the_size_counted_by_the_caller_is_taken() -> None:
    store = MemoryStore()
    events: list[StreamEvent] = [Delta(content="hi"), Done()]
    await store.end(info(), events, 0, LONG, size=1000)
    assert store.size == 256 + 1000
    await store.end(info(), events, 0, LONG)
    assert store.size == log_size(events)


async def test_replacing_one_entry_again_and_again_keeps_the_expiry_heap_small() -> None:
    store = MemoryStore(max_bytes=10 * log_size(sized_log(1)))
    for _ in range(500):
        await store.end(info(), sized_log(1), 0, LONG)
    assert len(store) == 1
    assert len(store._expiry) <= 2 * len(store) + 65


async def test_one_keys_streams_push_out_its_own_oldest_never_another_keys() -> None:
    # Each key may keep two logs' worth; the store, five. Key alpha writes ten: its own
    # oldest go, beta's stay to their TTL, and so does what no key wrote.
    one = log_size(sized_log(4))
    store = MemoryStore(max_bytes=5 * one + 10, max_bytes_per_key=2 * one + 10)
    evicted: list[tuple[str, int]] = []
    store.on_evict.append(lambda why, count: evicted.append((why, count)))

    def owned(stream_id: str, owner: str | None) -> StreamInfo:
        return StreamInfo(StreamMeta(id=stream_id, model="m", created=0), "sse", owner)

    await store.end(owned("chatcmpl-beta1", "beta"), sized_log(4), 0, LONG)
    await store.end(owned("chatcmpl-anon1", None), sized_log(4), 0, LONG)
    for n in range(10):
        await store.end(owned(f"chatcmpl-alpha{n}", "alpha"), sized_log(4), 0, LONG)
    kept = [f"alpha{n}" for n in range(10) if await store.info(f"chatcmpl-alpha{n}")]
    assert kept == ["alpha8", "alpha9"]
    assert evicted == [("key_limit", 1)] * 8  # nexus_store_evictions_total{reason}
    assert await store.info("chatcmpl-beta1") is not None
    assert await store.info("chatcmpl-anon1") is not None
    # Recordings count to their key the same way.
    recording = Recording(sized_log(4)[:-1], [0.0] * 4)
    for n in range(3):
        await store.put_recording(f"beta-rec{n}", recording, LONG, "beta")
    assert await store.info("chatcmpl-beta1") is None  # beta's own oldest went
    assert [await store.get_recording(f"beta-rec{n}") is not None for n in range(3)] == [
        False,
        True,
        True,
    ]
    assert await store.info("chatcmpl-alpha9") is not None


async def test_a_full_store_takes_from_the_key_that_holds_the_most() -> None:
    # Four keys each under their quota fill the store; a fifth's log pushes out the
    # oldest of the biggest holder, not the oldest of all (key a's).
    one = log_size(sized_log(4))
    store = MemoryStore(max_bytes=5 * one + 10, max_bytes_per_key=3 * one + 10)

    def owned(stream_id: str, owner: str) -> StreamInfo:
        return StreamInfo(StreamMeta(id=stream_id, model="m", created=0), "sse", owner)

    await store.end(owned("chatcmpl-a0", "a"), sized_log(4), 0, LONG)
    for n in range(3):
        await store.end(owned(f"chatcmpl-b{n}", "b"), sized_log(4), 0, LONG)
    await store.end(owned("chatcmpl-c0", "c"), sized_log(4), 0, LONG)
    await store.end(owned("chatcmpl-e0", "e"), sized_log(4), 0, LONG)
    assert await store.info("chatcmpl-a0") is not None
    assert await store.info("chatcmpl-b0") is None  # b held the most: its oldest went
    assert [await store.info(f"chatcmpl-{n}") is not None for n in ("b1", "b2", "c0", "e0")] == [
        True,
        True,
        True,
        True,
    ]
