"""Per-key limits shared by replicas: two real ``nexus serve`` processes on one Redis.

* Together they admit exactly ``requests_per_second_per_key`` (one bucket in Redis,
  not one per process).
* Together they run exactly ``max_concurrent_streams_per_key`` streams of a key; a
  stream that ends (completed, or its client gone) gives its slot back at once.
* A replica killed (SIGKILL) mid-stream stops renewing its slot, which expires
  within ``[limits] stream_lease_s``: the other replica admits the key again.
* An admission whose reply was lost, or whose client left while it was in flight, gives
  its slot back at once (in process).
* A slot Redis lost while its stream runs comes back at the next renewal (in process).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from nexus.auth import hash_key
from redis_support import connect_or_skip, drop_keys, new_prefix, redis_replicas

KEY = "nx-shared-limits-0123456789"
LEASE_S = 1.0


def config(prefix: str, *, rate: float = 0, per_key: int = 100) -> str:
    return f"""\
[server]
shutdown_grace_s = 0

[streams]
detach_timeout_s = 0           # a client that leaves ends its stream at once

[limits]
requests_per_second_per_key = {rate}
max_concurrent_streams_per_key = {per_key}
stream_lease_s = {LEASE_S}

[store]
kind = "redis"
url = "redis://127.0.0.1:6379/0"
prefix = "{prefix}"

[[auth.keys]]
name = "alpha"
sha256 = "{hash_key(KEY)}"

[providers.mock]
kind = "mock"
"""


def replicas(tmp_path: Path, **limits: Any) -> contextlib.AbstractAsyncContextManager[list[Any]]:
    """Two gateways sharing one Redis prefix: [(process, url), ...]."""
    return redis_replicas(tmp_path, lambda prefix: config(prefix, **limits))


def headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


def slow(tag: str, delay_ms: int = 200) -> dict[str, Any]:
    return {
        "model": "mock/echo",
        "stream": True,
        "messages": [{"role": "user", "content": tag}],
        "mock": {"content": "one two three four five six", "delay_ms": delay_ms},
    }


async def test_two_replicas_admit_exactly_the_rate_together(tmp_path: Path) -> None:
    async with replicas(tmp_path, rate=2) as (one, two), aiohttp.ClientSession() as http:

        async def get(url: str) -> tuple[int, str]:
            async with http.get(url + "/v1/models/mock/echo", headers=headers()) as resp:
                body = await resp.json()
                return resp.status, "" if resp.status == 200 else body["error"]["code"]

        # Ten at once, five on each: a bucket of two for both (a process of its own would
        # admit two each).
        results = await asyncio.gather(*(get(url) for _, url in (one, two) * 5))
        assert sorted(results) == [(200, "")] * 2 + [(429, "rate_limited")] * 8


async def open_stream(
    http: aiohttp.ClientSession, url: str, tag: str
) -> tuple[int, aiohttp.ClientResponse]:
    resp = await http.post(url + "/v1/chat/completions", json=slow(tag), headers=headers())
    if resp.status != 200:
        assert (await resp.json())["error"]["code"] == "too_many_streams"
        resp.release()
    return resp.status, resp


async def test_two_replicas_run_exactly_the_keys_streams_together(tmp_path: Path) -> None:
    async with replicas(tmp_path, per_key=2) as (one, two), aiohttp.ClientSession() as http:
        urls = [url for _, url in (one, two)]
        opened = await asyncio.gather(*(open_stream(http, urls[n % 2], f"s{n}") for n in range(6)))
        running = [resp for status, resp in opened if status == 200]
        assert len(running) == 2, [status for status, _ in opened]
        # One ends well, the other's client leaves: both slots come back.
        assert b"[DONE]" in await running[0].read()
        running[1].close()
        for _ in range(50):
            again = await asyncio.gather(*(open_stream(http, url, "again") for url in urls))
            if all(status == 200 for status, _ in again):
                break
            for status, resp in again:
                if status == 200:
                    resp.close()
            await asyncio.sleep(0.05)
        assert [status for status, _ in again] == [200, 200]
        for _, resp in again:
            resp.close()


async def test_a_killed_replicas_slot_expires_within_its_lease(tmp_path: Path) -> None:
    async with replicas(tmp_path, per_key=1) as (one, two), aiohttp.ClientSession() as http:
        status, held = await open_stream(http, one[1], "held")
        assert status == 200
        status, _ = await open_stream(http, two[1], "refused")
        assert status == 429
        one[0].kill()  # SIGKILL: no release, no goodbye
        killed = time.monotonic()
        held.close()
        while True:
            status, resp = await open_stream(http, two[1], "after")
            if status == 200:
                resp.close()
                break
            assert time.monotonic() - killed < LEASE_S + 1.0, "the dead replica's slot stayed"
            await asyncio.sleep(0.1)


@pytest.fixture(autouse=True)
def _quick() -> Iterator[None]:
    began = time.monotonic()
    yield
    assert time.monotonic() - began < 20


async def test_redis_down_fails_open_to_this_process_except_for_budgets() -> None:
    import redis.asyncio as aioredis

    from nexus.auth import ApiKey
    from nexus.cache.limits import LocalLimits, StoreUnavailable
    from nexus.cache.redis import RedisStore
    from nexus.cache.redis_limits import RedisLimits

    client = aioredis.Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.2)
    store = RedisStore(prefix=new_prefix(), client=client)
    limits = RedisLimits(
        store, rate=1, per_key=5, lease_s=1, fallback=LocalLimits(1, 5, lambda name: 0)
    )
    await limits.start()
    try:
        # No budget: admitted against this process's bucket (one token), never a 500; its
        # slot held here (put in Redis once it is back).
        plain = ApiKey("plain")
        slot = await limits.admit(plain, stream=True)
        assert slot is not None and slot.id in limits._held["streams", "plain"]
        with pytest.raises(Exception) as limited:
            await limits.admit(plain, stream=True)
        assert getattr(limited.value, "code", None) == "rate_limited"
        # A budget that cannot be checked is not spent: 503 store_unavailable.
        with pytest.raises(StoreUnavailable) as refused:
            await limits.admit(ApiKey("capped", budget_usd=1.0), stream=True)
        assert refused.value.status == 503
        # A charge that cannot be sent is kept for the next tick.
        await limits.charge(ApiKey("capped", budget_usd=1.0), 0.5)
        assert sum(entry[2] for entry in limits._unsent.values()) == 0.5
    finally:
        await limits.close()
        await client.aclose()


async def test_a_slot_whose_admission_reply_was_lost_is_held_until_its_stream_ends() -> None:
    """The admission script ran in Redis (the slot is taken) but its reply never came:
    the request is admitted by this process, which holds the slot as one it took while
    Redis failed (its stream runs: it counts), and lets it go as the stream ends, not at
    the end of its lease."""
    from nexus.auth import ApiKey
    from nexus.cache.limits import LocalLimits
    from nexus.cache.redis import RedisStore
    from nexus.cache.redis_limits import RedisLimits

    class ReplyLost(RedisStore):
        async def call(self, op: str, *commands: Any, allow: str = "") -> list[Any]:
            replies = await super().call(op, *commands, allow=allow)
            if op == "admit":
                raise self._unavailable(op)
            return replies

    client = await connect_or_skip()
    prefix = new_prefix()
    store = ReplyLost(prefix=prefix, client=client)
    limits = RedisLimits(
        store, rate=0, per_key=1, lease_s=60, fallback=LocalLimits(0, 1, lambda name: 0)
    )
    slots = f"{prefix}:limits:streams:lost"
    await limits.start()
    try:
        slot = await limits.admit(ApiKey("lost"), stream=True)  # admitted here
        assert slot is not None
        assert await client.zrange(slots, 0, -1) == [slot.id.encode()]
        await limits.end(slot)  # (it waits for the slot to leave Redis)
        assert await client.zcard(slots) == 0, "the lost admission's slot stayed for its lease"
    finally:
        await limits.close()
        await drop_keys(client, prefix)
        await client.aclose()


async def test_a_slot_whose_admission_was_cancelled_in_flight_is_given_back() -> None:
    """The client left (its handler cancelled) while the admission script was in flight:
    the script ran and took the slot, nobody here holds it, and it leaves Redis at once
    rather than refuse the key for its lease."""
    from nexus.auth import ApiKey
    from nexus.cache.limits import LocalLimits
    from nexus.cache.redis import RedisStore
    from nexus.cache.redis_limits import RedisLimits

    class SlowReply(RedisStore):
        async def call(self, op: str, *commands: Any, allow: str = "") -> list[Any]:
            replies = await super().call(op, *commands, allow=allow)
            if op == "admit":
                await asyncio.sleep(30)  # the reply is still on its way
            return replies

    client = await connect_or_skip()
    prefix = new_prefix()
    store = SlowReply(prefix=prefix, client=client)
    limits = RedisLimits(
        store, rate=0, per_key=1, lease_s=60, fallback=LocalLimits(0, 1, lambda name: 0)
    )
    slots = f"{prefix}:limits:streams:gone"
    await limits.start()
    try:
        admitting = asyncio.ensure_future(limits.admit(ApiKey("gone"), stream=True))
        deadline = time.monotonic() + 2
        while not await client.zcard(slots) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert await client.zcard(slots) == 1  # the script ran
        admitting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await admitting
        deadline = time.monotonic() + 2
        while await client.zcard(slots) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert await client.zcard(slots) == 0, "the cancelled admission's slot stayed"
    finally:
        await limits.close()
        await drop_keys(client, prefix)
        await client.aclose()


async def test_a_slot_redis_lost_comes_back_at_the_next_renewal() -> None:
    """Redis lost the key's slots (a restart without persistence, an outage past the set's
    TTL) while this process's stream still runs: the renewal puts the slot back, so the
    key's other replicas are refused again, rather than admitted past the limit until
    the stream ends."""
    from nexus.auth import ApiKey
    from nexus.cache.limits import LocalLimits
    from nexus.cache.redis import RedisStore
    from nexus.cache.redis_limits import RedisLimits

    client = await connect_or_skip()
    prefix = new_prefix()
    here, there = (
        RedisLimits(
            RedisStore(prefix=prefix, client=client),
            rate=0,
            per_key=1,
            lease_s=LEASE_S,
            fallback=LocalLimits(0, 1, lambda name: 0),
        )
        for _ in range(2)
    )
    key = ApiKey("kept")
    await here.start()
    try:
        assert await here.admit(key, stream=True) is not None  # its stream runs on
        with pytest.raises(Exception) as refused:
            await there.admit(key, stream=True)
        assert getattr(refused.value, "code", None) == "too_many_streams"
        await client.delete(f"{prefix}:limits:streams:kept")  # Redis forgot it
        await asyncio.sleep(LEASE_S / 3 + 0.2)  # one renewal
        with pytest.raises(Exception) as refused:
            await there.admit(key, stream=True)
        assert getattr(refused.value, "code", None) == "too_many_streams"
    finally:
        await here.close()
        await drop_keys(client, prefix)
        await client.aclose()


async def test_a_stream_whose_rate_token_was_taken_before_its_body_takes_no_second() -> None:
    from nexus.auth import ApiKey
    from nexus.cache.limits import LocalLimits
    from nexus.cache.redis import RedisStore
    from nexus.cache.redis_limits import RedisLimits

    client = await connect_or_skip()
    prefix = new_prefix()
    limits = RedisLimits(
        RedisStore(prefix=prefix, client=client),
        rate=1,
        per_key=5,
        lease_s=LEASE_S,
        fallback=LocalLimits(1, 5, lambda name: 0),
    )
    key = ApiKey("once")
    await limits.start()
    try:
        assert await limits.admit(key, stream=False) is None  # the token, before the body
        slot = await limits.admit(key, stream=True, rate=False)  # then the place only
        assert slot is not None
        with pytest.raises(Exception) as refused:  # the bucket held one: it is spent
            await limits.admit(key, stream=False)
        assert getattr(refused.value, "code", None) == "rate_limited"
        limits.release(slot)
    finally:
        await limits.close()
        await drop_keys(client, prefix)
        await client.aclose()


async def test_a_charge_cut_by_its_hooks_timeout_is_sent_again_later(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stream's end waits for its charge a second at most (``_END_WAIT_S``), and the
    budget plugin's hook call is bounded too ([[plugins]] timeout_s): a charge whose wait
    is cut while Redis is slow goes on being sent, and if that send fails, it stays unsent
    for the next tick, never lost."""
    from nexus.auth import ApiKey
    from nexus.cache import redis_limits
    from nexus.cache.limits import LocalLimits
    from nexus.cache.redis import RedisStore
    from nexus.cache.redis_limits import RedisLimits

    monkeypatch.setattr(redis_limits, "_END_WAIT_S", 0.1)
    limits = RedisLimits(
        RedisStore(prefix=new_prefix()),
        rate=0,
        per_key=None,
        lease_s=1,
        fallback=LocalLimits(0, None),
    )
    sending, answer = asyncio.Event(), asyncio.Event()

    async def slow_send(op: str, commands: list[Any]) -> bool:
        sending.set()
        await answer.wait()
        return False  # Redis failed, late

    def charges(held: dict[str, Any]) -> list[tuple[str, float]]:
        return [(entry[0], entry[2]) for entry in held.values()]

    limits._send = slow_send  # type: ignore[method-assign]
    key = ApiKey("capped", budget_usd=1.0)
    await asyncio.wait_for(limits.charge(key, 0.25), 1)  # its wait ends; its send goes on
    assert charges(limits._sending) == [("capped", 0.25)]
    charge = asyncio.create_task(limits.charge(key, 0.5))
    await asyncio.sleep(0.01)
    charge.cancel()  # cut by its hook's timeout: its send goes on too
    with pytest.raises(asyncio.CancelledError):
        await charge
    answer.set()
    for _ in range(100):
        if len(limits._unsent) == 2:
            break
        await asyncio.sleep(0.01)
    assert sorted(charges(limits._unsent)) == [("capped", 0.25), ("capped", 0.5)]


async def test_admissions_refused_while_redis_stalled_leave_no_slot_after_it(
    redis_server: Any,
) -> None:
    """Redis paused (SIGSTOP) runs the admissions it was sent once it resumes, and they
    take their slots (and budget holds) then, for a whole lease, while their requests were
    refused: the removals sent during the stall failed. They are sent again until one
    lands, so the key is not locked out for a lease after the stall."""
    import signal

    import redis.asyncio as aioredis

    from nexus.auth import ApiKey
    from nexus.cache.limits import LocalLimits, StoreUnavailable
    from nexus.cache.redis import RedisStore
    from nexus.cache.redis_limits import RedisLimits

    prefix = new_prefix()
    store = RedisStore(redis_server.url, prefix=prefix)
    store.socket_timeout_s = 0.3
    await store.start()
    limits = RedisLimits(
        store, rate=0, per_key=3, lease_s=60, fallback=LocalLimits(0, 3, lambda name: 0)
    )
    client = aioredis.Redis.from_url(redis_server.url)
    key = ApiKey("stalled", budget_usd=1.0)
    slots, held = f"{prefix}:limits:streams:stalled", f"{prefix}:limits:held:stalled"
    await limits.start()
    try:
        redis_server.process.send_signal(signal.SIGSTOP)
        for _ in range(3):
            with pytest.raises(StoreUnavailable):
                await limits.admit(key, stream=True, hold=0.01)
        redis_server.process.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if not await client.zcard(slots) and not await client.hlen(held):
                break
            await asyncio.sleep(0.1)
        assert await client.zcard(slots) == 0, "slots of refused admissions stayed"
        assert await client.hlen(held) == 0, "holds of refused admissions stayed"
        assert await limits.admit(key, stream=True, hold=0.01) is not None
    finally:
        redis_server.process.send_signal(signal.SIGCONT)
        await limits.close()
        await store.close()
        await client.aclose()
