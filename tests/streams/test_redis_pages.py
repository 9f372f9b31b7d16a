"""Readers catching up on logs in Redis, against a ``redis-server`` of the test's own.

* Their pages never queue ahead of the process's other commands: sixty readers of a
  30 MB log, their pages in the commands' pipeline, held an admission's PING 9 s
  (then 503 ``store_unavailable`` for other keys' new streams).
* A page holds about 1 MiB whatever its entries' size (XRANGE's COUNT bounds entries,
  not bytes: a page of 100 entries could be a whole 32 MiB log), and a resume is exact.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

import nexus.cache.redis as redis_store
from nexus.cache.redis import RedisStore
from nexus.cache.store import StreamInfo, Write
from nexus.events import Delta, Done, StreamEvent
from nexus.types import StreamMeta
from redis_server import RedisServer


@pytest.fixture
async def store() -> AsyncIterator[RedisStore]:
    server = RedisServer()
    server.start()
    # 60 readers of 8 MB share 4 connections for pages: on a loaded host the last ones
    # wait for one longer than the default 5 s, which is not what these tests are about.
    store = RedisStore(server.url, "pages", pool_timeout_s=60.0)
    try:
        await store.start()
        yield store
    finally:
        await store.close()
        server.stop()


async def finished_log(store: RedisStore, events: list[StreamEvent]) -> str:
    info = StreamInfo(StreamMeta.new("mock/echo"), "application/x-ndjson", status="completed")
    await store.mirror([Write(info, events, 0, end=True)], 60)
    return info.id


async def read_all(store: RedisStore, stream_id: str, start: int = 0) -> list[StreamEvent]:
    return [event async for events in store.read(stream_id, start) for event in events]


async def test_commands_do_not_wait_behind_readers_pages(store: RedisStore) -> None:
    # 8 MB: 200 events of 40 KB, in entries of 500 events (one entry), then a second log
    # of 40 entries; 30 readers of each.
    big = [Delta(content="x" * 40_000) for _ in range(200)]
    one = await finished_log(store, [*big, Done()])
    two = await finished_log(store, [Delta(content="y" * 200_000) for _ in range(40)] + [Done()])
    readers = [asyncio.ensure_future(read_all(store, stream_id)) for stream_id in (one, two) * 30]
    await asyncio.sleep(0.005)  # their first pages are on their way
    began = time.monotonic()
    await store.call("admit", ("PING",))
    took = time.monotonic() - began
    done = await asyncio.gather(*readers)
    assert all(len(events) == 201 for events in done[::2])
    assert all(len(events) == 41 for events in done[1::2])
    assert took < 0.5, f"a command waited {took:.2f} s behind the readers' pages"


async def test_a_page_holds_about_a_mebibyte_and_a_resume_is_exact(
    store: RedisStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    pages: list[int] = []
    real = getattr(redis_store, "send", None)

    async def counted(client: Any, commands: Any) -> list[Any]:
        assert real is not None
        replies = await real(client, commands)
        pages.append(sum(len(fields[1]) for _, fields in replies[0] or ()))
        return replies

    monkeypatch.setattr(redis_store, "send", counted, raising=False)
    # 20,000 events of 300 bytes, in entries of 500 (~150 KB each): 6 MB.
    events: list[StreamEvent] = [Delta(content=f"{i:06d}" + "z" * 294) for i in range(20_000)]
    stream_id = await finished_log(store, [*events, Done()])
    for start in (0, 1, 499, 500, 12_345, 19_999, 20_000):
        got = await read_all(store, stream_id, start)
        assert got == [*events, Done()][start:], start
    assert pages, "no page was read on the connections for pages"
    assert max(pages) <= (1 << 20) + 200_000, f"a page of {max(pages)} bytes"


async def test_small_entries_then_big_ones_still_come_in_pages_of_about_a_mebibyte(
    store: RedisStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A page's count follows the last page's entries: after one tiny entry it may at most
    double, or 100 entries of 512 KB each came as one reply of 50 MB."""
    pages: list[int] = []
    real = redis_store.send

    async def counted(client: Any, commands: Any) -> list[Any]:
        replies = await real(client, commands)
        pages.append(sum(len(fields[1]) for _, fields in replies[0] or ()))
        return replies

    monkeypatch.setattr(redis_store, "send", counted)
    info = StreamInfo(StreamMeta.new("mock/echo"), "application/x-ndjson")
    await store.mirror([Write(info, [Delta(content="a")], 0, begin=True)], 60)
    big = [Delta(content=f"{i:04d}" + "z" * (512 * 1024)) for i in range(40)]
    for n, event in enumerate(big):
        await store.mirror([Write(info, [event], 1 + n)], 60)
    info.status = "completed"
    await store.mirror([Write(info, [Done()], 41, end=True)], 60)
    assert await read_all(store, info.id) == [Delta(content="a"), *big, Done()]
    assert max(pages) <= (1 << 20) + 600_000, f"a page of {max(pages)} bytes"
