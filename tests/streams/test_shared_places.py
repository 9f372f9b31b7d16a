"""A key's realtime sockets (``[realtime] max_sockets_per_key``) and stream readers
(``[limits] max_readers_per_key``) with the Redis store: two real ``nexus serve``
processes on one Redis count them together.

* A key at its limit on one replica is refused on the other with the refusal the replica
  holding them gives (429 ``too_many_sockets`` / ``too_many_readers``).
* A socket or reader that closes, or a replica shut down, gives its place back at once
  (the lease here is a minute: only a release lets the key in again in time).
* A replica killed (SIGKILL) stops renewing its places, which expire within
  ``[limits] stream_lease_s``.
* Redis unreachable: counted in this process, the places it held before included (in
  process).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import websockets
from websockets.exceptions import InvalidStatus

from nexus.auth import hash_key
from nexus_process import stop_nexus
from redis_support import connect_or_skip, drop_keys, new_prefix, redis_replicas

KEY = "nx-shared-places-0123456789"
HEADERS = {"Authorization": f"Bearer {KEY}"}
LEASE_S = 1.0
LONG_LEASE_S = 60.0


def config(lease_s: float) -> Callable[[str], str]:
    def text(prefix: str) -> str:
        return f"""\
[server]
shutdown_grace_s = 0

[limits]
requests_per_second_per_key = 0
max_readers_per_key = 1
stream_lease_s = {lease_s}

[realtime]
max_sockets_per_key = 1

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

    return text


def connect(url: str) -> Any:
    return websockets.connect(
        "ws" + url.removeprefix("http") + "/v1/realtime", additional_headers=HEADERS
    )


async def socket_refused(url: str) -> tuple[int, str]:
    with pytest.raises(InvalidStatus) as caught:
        await connect(url)
    response = caught.value.response
    return response.status_code, orjson.loads(response.body or b"{}")["error"]["code"]


async def eventually(attempt: Callable[[], Awaitable[Any]], within_s: float) -> Any:
    """``attempt()``'s result once it stops being refused for the key's limit (it raises
    :class:`Refused`), within ``within_s``."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            return await attempt()
        except Refused:
            assert time.monotonic() < deadline, "the key's place was not given back in time"
            await asyncio.sleep(0.05)


class Refused(Exception):
    """A 429 for the key's sockets or readers."""


async def open_socket(url: str) -> Any:
    try:
        return await connect(url)
    except InvalidStatus as exc:
        if exc.response.status_code == 429:
            raise Refused from exc
        raise


async def test_a_keys_sockets_are_counted_by_every_replica_together(tmp_path: Path) -> None:
    async with redis_replicas(tmp_path, config(LONG_LEASE_S)) as ((_, one), (proc, two)):
        held = await connect(one)
        assert await socket_refused(two) == (429, "too_many_sockets")
        assert await socket_refused(one) == (429, "too_many_sockets")
        await held.close()
        # Its place left Redis as it closed: the other replica takes it.
        again = await eventually(lambda: open_socket(two), within_s=5)
        assert await socket_refused(one) == (429, "too_many_sockets")
        # A replica shut down lets its sockets' places go too.
        await asyncio.to_thread(stop_nexus, proc)
        await again.close()
        ws = await eventually(lambda: open_socket(one), within_s=5)
        await ws.close()


async def test_a_killed_replicas_sockets_go_within_their_lease(tmp_path: Path) -> None:
    async with redis_replicas(tmp_path, config(LEASE_S)) as ((proc, one), (_, two)):
        held = await connect(one)
        assert await socket_refused(two) == (429, "too_many_sockets")
        proc.kill()  # SIGKILL: no release, no goodbye
        killed = time.monotonic()
        assert await socket_refused(two) == (429, "too_many_sockets")  # its lease runs
        ws = await eventually(lambda: open_socket(two), within_s=LEASE_S + 1.0)
        assert time.monotonic() - killed < LEASE_S + 1.0
        await ws.close()
        await held.close()


async def background(http: aiohttp.ClientSession, url: str) -> str:
    """A stream of the key that runs for a few seconds: the path that follows it."""
    body = {
        "model": "mock/echo",
        "stream": True,
        "background": True,
        "messages": [{"role": "user", "content": "long"}],
        "mock": {"content": " ".join(["word"] * 100), "delay_ms": 100},
    }
    async with http.post(url + "/v1/chat/completions", json=body, headers=HEADERS) as resp:
        assert resp.status == 202, await resp.text()
        return f"/v1/streams/{(await resp.json())['id']}"


async def read(http: aiohttp.ClientSession, url: str) -> aiohttp.ClientResponse:
    """A reader of ``url`` (its headers in), or :class:`Refused` for the key's readers."""
    resp = await http.get(url, headers=HEADERS)
    if resp.status == 429:
        error = (await resp.json())["error"]
        assert error["code"] == "too_many_readers"
        assert resp.headers["Retry-After"] == "1"
        raise Refused
    return resp


async def test_a_keys_readers_are_counted_by_every_replica_together(tmp_path: Path) -> None:
    async with (
        redis_replicas(tmp_path, config(LONG_LEASE_S)) as ((_, one), (_, two)),
        aiohttp.ClientSession() as http,
    ):
        path = await background(http, one)
        reader = await read(http, one + path)
        assert reader.status == 200
        for url in (two + path, one + path, two + "/v1/streams/nope"):
            with pytest.raises(Refused):
                await read(http, url)
        reader.close()  # the client leaves mid-stream
        again = await eventually(lambda: read(http, two + path), within_s=5)
        assert again.status == 200  # it follows the stream from the other replica
        with pytest.raises(Refused):
            await read(http, one + path)
        again.close()


async def test_a_killed_replicas_readers_go_within_their_lease(tmp_path: Path) -> None:
    async with (
        redis_replicas(tmp_path, config(LEASE_S)) as ((proc, one), (_, two)),
        aiohttp.ClientSession() as http,
    ):
        reader = await read(http, one + await background(http, one))
        assert reader.status == 200
        probe = two + "/v1/streams/nope"  # refused before its lookup, else 404
        with pytest.raises(Refused):
            await read(http, probe)
        proc.kill()
        killed = time.monotonic()
        with pytest.raises(Refused):
            await read(http, probe)  # its lease runs
        found = await eventually(lambda: read(http, probe), within_s=LEASE_S + 1.0)
        assert found.status == 404
        assert time.monotonic() - killed < LEASE_S + 1.0
        found.release()
        reader.close()


async def test_redis_down_counts_places_in_this_process_with_those_it_held() -> None:
    """As streams do: Redis failing, a key's sockets and readers are limited per process
    (a warning, never a 500), counting the places this process took from Redis before."""
    from nexus.cache.limits import LocalLimits
    from nexus.cache.redis import RedisStore
    from nexus.cache.redis_limits import RedisLimits

    class Failing(RedisStore):
        down = False

        async def call(self, op: str, *commands: Any, allow: str = "") -> list[Any]:
            if self.down:
                raise self._unavailable(op)
            return await super().call(op, *commands, allow=allow)

    client = await connect_or_skip()
    prefix = new_prefix()
    store = Failing(prefix=prefix, client=client)
    limits = RedisLimits(store, rate=0, per_key=None, lease_s=60, fallback=LocalLimits(0, None))
    await limits.start()
    try:
        first = await limits.enter("sockets", "k", 2)
        assert first is not None
        assert await client.zcard(f"{prefix}:limits:sockets:k") == 1
        store.down = True
        second = await limits.enter("sockets", "k", 2)
        assert second is not None  # the first counts here: one more fits
        assert await limits.enter("sockets", "k", 2) is None
        assert await limits.enter("readers", "k", 1) is not None  # each kind its own
        limits.leave(second)
        limits.leave(second)  # (twice: counted once)
        assert await limits.enter("sockets", "k", 2) is not None
        assert await limits.enter("sockets", "k", 2) is None
    finally:
        store.down = False
        await limits.close()
        await drop_keys(client, prefix)
        await client.aclose()
