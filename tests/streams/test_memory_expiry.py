"""The memory store gives expired entries back: swept on every put and on its own tick.

Unit tests on :class:`MemoryStore`, then the gateway's resident memory across
rounds of streams whose logs and recordings expire between rounds, on a real
``nexus serve`` process (``VmRSS`` from ``/proc/<pid>/status``).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import re
import sys
import time
import weakref
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from nexus.cache import MemoryStore, Recording, StreamInfo
from nexus.cache.memory import SWEEP_INTERVAL_S
from nexus.events import Delta, Done, StreamEvent
from nexus.types import StreamMeta
from nexus_process import start_nexus, stop_nexus

SHORT = 0.05
LONG = 60.0


def recording(n: int) -> Recording:
    return Recording(events=[Delta(content=f"r{n} " * 20)], offsets=[0.0])


def info(stream_id: str) -> StreamInfo:
    meta = StreamMeta(id=stream_id, model="mock/echo", created=1700000000)
    return StreamInfo(meta=meta, format="text/event-stream", status="completed")


LOG: list[StreamEvent] = [Delta(content="hello"), Delta(finish_reason="stop"), Done()]


async def gone_within(store: MemoryStore, seconds: float, *, keep: int = 0) -> float:
    """How long until only ``keep`` entries (and their bytes) are left; fails past ``seconds``."""
    began = time.monotonic()
    while len(store) > keep:
        assert time.monotonic() - began < seconds, (len(store), store.size)
        await asyncio.sleep(0.02)
    return time.monotonic() - began


async def test_expired_recordings_are_freed_within_a_second_without_another_put() -> None:
    store = MemoryStore()
    await store.start()
    try:
        ttl = 0.5  # all 2,000 put before the first expires (a put sweeps), on a busy host too
        for n in range(2000):
            await store.put_recording(f"key-{n}", recording(n), ttl)
        assert len(store) == 2000
        await gone_within(store, ttl + 1.0)
        assert store.size == 0
        assert store._expiry == []  # nothing keeps the dropped entries alive
    finally:
        await store.close()


async def test_expired_logs_go_and_live_ones_stay() -> None:
    store = MemoryStore()
    await store.start()
    try:
        await store.end(info("chatcmpl-long"), LOG, 0, LONG)
        kept = store.size
        for n in range(500):
            await store.end(info(f"chatcmpl-{n:04d}"), LOG, 0, SHORT)
        await gone_within(store, 1.0, keep=1)
        assert store.size == kept
        assert await store.info("chatcmpl-long") is not None
    finally:
        await store.close()


async def test_a_put_sweeps_what_expired() -> None:
    store = MemoryStore()  # not started: no tick
    ttl = 0.3  # all 100 put before the first expires (a put sweeps), on a busy host too
    for n in range(100):
        await store.put_recording(f"key-{n}", recording(n), ttl)
    await asyncio.sleep(ttl + 0.02)
    assert len(store) == 100  # nothing has looked yet
    await store.put_recording("fresh", recording(0), LONG)
    assert len(store) == 1
    assert await store.get_recording("fresh") is not None


async def test_expired_claims_are_swept() -> None:
    store = MemoryStore()
    await store.start()
    try:
        for n in range(200):
            assert await store.claim(f"k{n}", f"chatcmpl-{n}", SHORT) is None
        assert await store.claim("held", "chatcmpl-held", LONG) is None
        began = time.monotonic()
        while len(store._claims) > 1:
            assert time.monotonic() - began < 1.0, len(store._claims)
            await asyncio.sleep(0.02)
        assert await store.claim("held", "chatcmpl-other", LONG) == "chatcmpl-held"
        assert len(store._claim_expiry) == 1
    finally:
        await store.close()


async def test_prepaid_reads_are_swept_taken_or_not() -> None:
    store = MemoryStore()
    for n in range(100):  # (long enough that the first is still there when taken)
        await store.prepay_read(f"chatcmpl-{n}", "alpha", 0.5)
    await store.prepay_read("chatcmpl-held", "alpha", LONG)
    assert await store.take_prepaid_read("chatcmpl-0", "alpha")
    store.sweep(time.monotonic() + 1.0)
    assert list(store._prepaid) == [("chatcmpl-held", "alpha")]
    assert len(store._prepaid_expiry) == 1
    assert not await store.take_prepaid_read("chatcmpl-1", "alpha")
    assert await store.take_prepaid_read("chatcmpl-held", "alpha")
    assert not await store.take_prepaid_read("chatcmpl-held", "alpha")  # one read per 202


async def test_released_claims_do_not_pile_up_in_the_expiry_heap() -> None:
    store = MemoryStore()
    for n in range(1000):
        assert await store.claim(f"k{n}", f"chatcmpl-{n}", LONG) is None
        await store.release(f"k{n}", f"chatcmpl-{n}")
    assert store._claims == {}
    assert len(store._claim_expiry) <= 65


class Events(list[StreamEvent]):
    """A log that a weak reference can follow."""


async def test_an_evicted_entry_is_not_kept_alive_by_the_expiry_heap() -> None:
    store = MemoryStore(max_bytes=1500)  # room for one of these logs, not two
    first = Events([Delta(content="x" * 600), Done()])
    alive = weakref.ref(first)
    await store.end(info("chatcmpl-a"), first, 0, LONG)
    await store.end(info("chatcmpl-b"), [Delta(content="y" * 600), Done()], 0, LONG)
    assert len(store) == 1
    assert await store.info("chatcmpl-a") is None  # pushed out by b
    del first
    gc.collect()
    assert alive() is None, "the evicted log is still referenced"


async def test_close_stops_the_tick() -> None:
    store = MemoryStore()
    await store.start()
    await store.start()  # once only
    ticks = [t for t in asyncio.all_tasks() if "MemoryStore._tick" in repr(t.get_coro())]
    assert len(ticks) == 1
    await store.close()
    assert ticks[0].done()
    await store.close()  # twice is fine
    assert SWEEP_INTERVAL_S <= 0.5


# --- the gateway's memory across rounds of expiring streams -----------------------------------

_SERVING = re.compile(r"Nexus serving on (http://[\d.]+:\d+)")
TTL_S = 1.0
"""Logs (``resume_ttl_s``) and recordings (``[cache] ttl_s``) alike. Long enough for every
stream of a round to be finished and kept while the round runs; short, so that the
rounds' waits for it stay ~1.7 s each (4 rounds with 3 s would take 8 s more)."""
ROUNDS = 4
STREAMS = 1000
PARALLEL = 50
WORD = "w" * 1000  # ~20 KB of events per stream: ~20 MB per round of logs and recordings


@contextlib.contextmanager
def serve(tmp_path: Path) -> Iterator[tuple[str, int]]:
    config = tmp_path / "config.toml"
    config.write_text(
        f"""\
[streams]
resume_ttl_s = {TTL_S}

[cache]
enabled = true
ttl_s = {TTL_S}

[logging]
access_log = false

[providers.mock]
kind = "mock"
"""
    )
    proc, match = start_nexus(config, tmp_path / "nexus.log", ready=_SERVING)
    try:
        yield match.group(1), proc.pid
    finally:
        stop_nexus(proc)


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


async def one_round(http: aiohttp.ClientSession, url: str, round_: int) -> None:
    async def one(n: int) -> None:
        content = f"{round_}-{n} " + " ".join([WORD] * 20)  # distinct: no cache hit
        body = {
            "model": "mock/echo",
            "stream": True,
            "messages": [{"role": "user", "content": content}],
        }
        async with http.post(url + "/v1/chat/completions?stream_format=ndjson", json=body) as r:
            assert r.status == 200
            assert (await r.read()).endswith(b'{"type":"done"}\n')

    queue = iter(range(STREAMS))

    async def worker() -> None:
        for n in queue:
            await one(n)

    await asyncio.gather(*(worker() for _ in range(PARALLEL)))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/<pid>/status")
async def test_memory_comes_back_after_rounds_of_expiring_streams(tmp_path: Path) -> None:
    with serve(tmp_path) as (url, pid):
        after: list[int] = []
        async with aiohttp.ClientSession() as http:
            for round_ in range(ROUNDS):
                await one_round(http, url, round_)
                # Every log and recording of the round expires and is swept.
                # (A second more than needed: on a busy host a sweep late into the next
                # round raises the heap's high-water mark, which RSS keeps.)
                await asyncio.sleep(TTL_S + SWEEP_INTERVAL_S + 1.0)
                after.append(rss(pid))
    # Before the fix each round kept its ~25 MB until [store] max_bytes (256 MiB): three
    # rounds after the first would add ~75 MB. Fixed, they add 0-7 MB (the heap's
    # fragments; 11 MB once, under a full suite on a busy host).
    mib = [round(size / 2**20, 1) for size in after]
    assert after[-1] - after[0] < 20 * 2**20, f"RSS after each round (MiB): {mib}"
