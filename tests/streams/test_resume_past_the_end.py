"""A ``Last-Event-ID`` past what a live stream has produced, on every replica.

On the replica running the stream it is ``204`` at once (tests/streams/test_streams.py).
On another replica, following it through Redis, it is the same: that replica's copy may
trail what the stream already sent, so the replica running it is asked how far it is
(:mod:`nexus.cache.redis_asks`). An id past the copy that the stream did send attaches
and gets the rest, never a stream with a hole; one it never sent is ``204`` at once,
never a wait.

Runs against the real Redis at 127.0.0.1:6379 (skipped with the reason when there is
none, failed under ``CI=true``): two real ``nexus serve`` processes, and two in-process
replicas whose owner's copy in Redis is held back.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from test_streams_across_replicas import replica

from nexus.cache.redis import RedisStore
from nexus.cache.store import StreamInfo, Write
from nexus.errors import StoreUnavailable
from nexus.server.state import HUB
from nexus.types import StreamMeta
from redis_server import RedisServer
from redis_support import REDIS_URL, redis_replicas
from support import GatedProvider, chat, parse_sse

WORDS = " ".join(f"w{n}" for n in range(40))


def config(prefix: str) -> str:
    return f"""\
[server]
shutdown_grace_s = 0

[store]
kind = "redis"
url = "redis://127.0.0.1:6379/0"
prefix = "{prefix}"

[providers.mock]
kind = "mock"
"""


def content(body: bytes) -> str:
    text = ""
    for event in parse_sse(body):
        if event.data != "[DONE]":
            for choice in orjson.loads(event.data)["choices"]:
                text += choice["delta"].get("content") or ""
    return text


async def test_an_id_past_a_live_stream_is_204_at_once_on_either_replica(
    tmp_path: Path,
) -> None:
    """Two ``nexus serve`` processes on one Redis: the stream runs on the first; the
    second answers an id it never produced as the first does, at once, and resumes from
    the last id it sent with the rest, whole."""
    body = {**chat(WORDS, stream=True), "mock": {"delay_ms": 100}}
    async with (
        redis_replicas(tmp_path, config) as ((_, one), (_, two)),
        aiohttp.ClientSession() as http,
    ):
        resp = await http.post(f"{one}/v1/chat/completions", json=body)
        stream_id = resp.headers["X-Nexus-Stream-Id"]
        seen = b""
        while seen.count(b"data: ") < 2:
            seen += await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 10)
        last = parse_sse(seen)[-1].id
        step = int(last.rsplit(".", 1)[1])
        for url in (one, two):
            for beyond in (f"{stream_id}.{step + 5}", f"{stream_id}.{step + 5}.0"):
                started = time.monotonic()
                headers = {"Last-Event-ID": beyond}
                async with http.get(f"{url}/v1/streams/{stream_id}", headers=headers) as got:
                    assert got.status == 204, (url, beyond, await got.text())
                    assert await got.read() == b""
                async with http.post(
                    f"{url}/v1/chat/completions", json=body, headers=headers
                ) as posted:
                    assert posted.status == 204, (url, beyond, await posted.text())
                path = f"/v1/streams/{stream_id}?stream_format=ndjson&last_event_id={step + 5}"
                async with http.get(url + path) as counted:
                    assert counted.status == 204, (url, await counted.text())
                assert time.monotonic() - started < 1.0  # at once: nothing attached
        # The last id it sent resumes on the other replica: every word after it, once.
        async with http.get(
            f"{two}/v1/streams/{stream_id}", headers={"Last-Event-ID": last}
        ) as resumed:
            assert resumed.status == 200
            rest = await asyncio.wait_for(resumed.read(), 20)
        whole = seen + await asyncio.wait_for(resp.read(), 20)
        assert content(whole) == content(seen) + content(rest)
        assert content(whole).split() == WORDS.split()
        resp.release()


class HeldCopy(RedisStore):
    """A replica whose mirror into Redis waits for ``flowing`` once its stream has
    begun: its copy trails what it sent (a busy Redis, a mirror retrying)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.flowing = asyncio.Event()

    async def mirror(self, writes: Sequence[Write], ttl_s: float) -> list[bool]:
        if any(write.events for write in writes):
            await self.flowing.wait()
        return await super().mirror(writes, ttl_s)


async def test_an_id_the_copy_has_not_caught_up_with_attaches_and_gets_the_rest(
    aiohttp_client: Any, prefix: str
) -> None:
    gated = GatedProvider(before=2, after=2)
    owner = HeldCopy(REDIS_URL, prefix)
    one = await replica(aiohttp_client, prefix, [gated], owner)
    two = await replica(aiohttp_client, prefix)
    resp = await one.post("/v1/chat/completions", json=chat(model="gated/m", stream=True))
    stream_id = resp.headers["X-Nexus-Stream-Id"]
    seen = b""
    while seen.count(b"before") < 2:
        seen += await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5)
    last = parse_sse(seen)[-1].id
    step = int(last.rsplit(".", 1)[1])
    assert stream_id in one.app[HUB].live and not owner.flowing.is_set()  # (nothing copied)
    path = f"/v1/streams/{stream_id}"
    # Never sent: 204 at once, however far behind the copy is.
    beyond = await asyncio.wait_for(
        two.get(path, headers={"Last-Event-ID": f"{stream_id}.{step + 1}"}), 5
    )
    assert beyond.status == 204
    # Sent, and not in the copy yet: attached; the rest comes as the copy catches up.
    resumed = await asyncio.wait_for(two.get(path, headers={"Last-Event-ID": last}), 5)
    assert resumed.status == 200
    owner.flowing.set()
    gated.gate.set()
    rest = await asyncio.wait_for(resumed.read(), 10)
    assert content(rest) == "after0 after1 "
    assert content(seen + await resp.read()) == "before0 before1 after0 after1 "


async def test_a_replica_that_cannot_be_asked_is_503_not_a_wait(
    aiohttp_client: Any, prefix: str
) -> None:
    """The replica running the stream does not hear the question (its subscription is
    gone: reconnecting, or a replica from before it): the resume cannot be judged, and
    is refused at once, to be retried."""
    gated = GatedProvider(before=2, after=2)
    owner = HeldCopy(REDIS_URL, prefix)
    one = await replica(aiohttp_client, prefix, [gated], owner)
    two = await replica(aiohttp_client, prefix)
    await owner.asks.close()
    resp = await one.post("/v1/chat/completions", json=chat(model="gated/m", stream=True))
    stream_id = resp.headers["X-Nexus-Stream-Id"]
    seen = b""
    while seen.count(b"before") < 2:
        seen += await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5)
    last = parse_sse(seen)[-1].id
    try:
        started = time.monotonic()
        refused = await two.get(f"/v1/streams/{stream_id}", headers={"Last-Event-ID": last})
        assert refused.status == 503
        assert (await refused.json())["error"]["code"] == "store_unavailable"
        assert refused.headers["Retry-After"] == "1"
        assert time.monotonic() - started < 0.5
    finally:
        owner.flowing.set()
        gated.gate.set()
    await resp.read()


@contextlib.asynccontextmanager
async def replicas(
    owner_url: str, asker_url: str, prefix: str
) -> AsyncIterator[tuple[RedisStore, RedisStore, StreamInfo]]:
    """Two replicas' stores, started: the owner runs ``info``'s stream (3 entries logged
    here, none in its copy), the asker asks it about that stream; closed after."""
    owner, asker = RedisStore(owner_url, prefix), RedisStore(asker_url, prefix)
    info = StreamInfo(StreamMeta.new("mock/echo"), "text/event-stream")
    owner.live_entries = lambda stream_id: 3 if stream_id == info.id else None
    await owner.start()
    await asker.start()
    try:
        await owner.begin(info, 30)  # (nothing in its copy)
        yield owner, asker, info
    finally:
        await asker.close()
        await owner.close()


async def test_a_replica_answers_again_once_redis_is_back(redis_server: RedisServer) -> None:
    """Redis restarted (every key lost): the replica running a stream subscribes again
    to its questions, and answers them."""
    async with replicas(redis_server.url, redis_server.url, "asks") as (owner, asker, info):
        assert await asker.reached(info.id, 3)
        assert not await asker.reached(info.id, 4)
        redis_server.stop()
        with pytest.raises(StoreUnavailable):
            await asker.reached(info.id, 3)
        redis_server.start()
        async with asyncio.timeout(5):
            while True:
                with contextlib.suppress(StoreUnavailable):
                    await owner.begin(info, 30)  # (what its keeper does once Redis is back)
                    assert not await asker.reached(info.id, 4)
                    break
                await asyncio.sleep(0.1)
        assert await asker.reached(info.id, 3)
        owner.live_entries = lambda stream_id: None  # it ended here: the read tells
        assert await asker.reached(info.id, 4)


async def test_a_replica_refused_its_subscription_still_starts_and_warns(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A Redis user without ``SUBSCRIBE`` (an ACL written before the questions): the store
    starts all the same, with a warning, and a question for it goes unheard (503, retry).
    It tries again, backing off: one warning, not one a try, and few connections."""
    import redis.asyncio as aioredis

    admin = aioredis.Redis.from_url(redis_server.url)
    await admin.execute_command(
        "ACL", "SETUSER", "nosub", "on", ">pw", "~*", "&*", "+@all", "-subscribe", "-psubscribe"
    )
    await admin.aclose()
    limited = redis_server.url.replace("redis://", "redis://nosub:pw@")
    with caplog.at_level("WARNING", logger="nexus.store"):
        async with replicas(limited, redis_server.url, "acl") as (_, asker, info):
            with pytest.raises(StoreUnavailable):
                await asker.reached(info.id, 3)
            async with asyncio.timeout(3):
                while "cannot ask this one" not in caplog.text:
                    await asyncio.sleep(0.05)
            before = await connections_received(redis_server)
            await asyncio.sleep(2.0)
            tries = await connections_received(redis_server) - before - 1  # (but this count's)
            assert tries <= 3  # after 0.25, 0.75, 1.75 s, ...; not 8, at 4 a second
    (warning,) = [r for r in caplog.records if "cannot ask this one" in r.getMessage()]
    assert "no permissions" in warning.getMessage()


async def connections_received(server: RedisServer) -> int:
    import redis.asyncio as aioredis

    async with aioredis.Redis.from_url(server.url) as admin:
        return int((await admin.info("stats"))["total_connections_received"])


class Proxy:
    """A TCP proxy to a Redis whose subscription connections can go silent: no byte
    forwarded either way from then on, and none closed (a NAT that forgot them, a path
    that blackholes them)."""

    def __init__(self, port: int) -> None:
        self.port_to = port
        self.subscribers: list[asyncio.StreamWriter] = []
        """The Redis side of connections that sent a SUBSCRIBE."""
        self.silent: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []

    async def __aenter__(self) -> Proxy:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"redis://127.0.0.1:{self._server.sockets[0].getsockname()[1]}/0"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._server.close()
        for task in self._tasks:
            task.cancel()
        for writer in self._writers:
            writer.close()

    def silence(self) -> list[str]:
        """Silence the subscriptions so far; their addresses as Redis sees them."""
        self.silent.update(self.subscribers)
        return ["{}:{}".format(*writer.get_extra_info("sockname")) for writer in self.subscribers]

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        redis_r, redis_w = await asyncio.open_connection("127.0.0.1", self.port_to)
        self._writers += [client_w, redis_w]
        for source, to in ((client_r, redis_w), (redis_r, client_w)):
            self._tasks.add(asyncio.ensure_future(self._pump(source, to, redis_w)))

    async def _pump(
        self, source: asyncio.StreamReader, to: asyncio.StreamWriter, upstream: asyncio.StreamWriter
    ) -> None:
        with contextlib.suppress(OSError):
            while data := await source.read(65536):
                if b"SUBSCRIBE" in data.upper() and upstream not in self.subscribers:
                    self.subscribers.append(upstream)
                if upstream not in self.silent:
                    to.write(data)
                    await to.drain()
        if upstream not in self.silent:
            to.close()


@pytest.mark.parametrize("how", ["silenced", "dropped by Redis"])
async def test_a_subscription_that_died_silently_is_made_again(
    redis_server: RedisServer,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    how: str,
) -> None:
    """The replica running a stream stops hearing its channel without an error (its
    connection silenced on the way; or dropped by Redis, the close never arriving): its
    own probe goes unheard, or nobody is there to hear it, and it subscribes again, so a
    question from another replica is answered again, not refused forever."""
    import redis.asyncio as aioredis

    from nexus.cache import redis_asks

    monkeypatch.setattr(redis_asks, "PROBE_S", 0.3)
    # Dropped by Redis, the probe's PUBLISH says so at once (0 heard): a wait that long
    # would fail the test were that not looked at.
    monkeypatch.setattr(redis_asks, "PROBE_WAIT_S", 0.3 if how == "silenced" else 30)
    async with (
        Proxy(redis_server.port) as proxy,
        replicas(proxy.url, redis_server.url, "probe") as (owner, asker, info),
    ):
        assert not await asker.reached(info.id, 4)
        (address,) = proxy.silence()
        if how == "dropped by Redis":
            admin = aioredis.Redis.from_url(redis_server.url)
            await admin.execute_command("CLIENT", "KILL", "ADDR", address)
            assert await admin.publish(f"probe:asks:{owner.replica_id}", b"?") == 0
            await admin.aclose()
        with caplog.at_level("WARNING", logger="nexus.store"):
            async with asyncio.timeout(5):
                while True:
                    with contextlib.suppress(StoreUnavailable):
                        assert not await asker.reached(info.id, 4)
                        break
                    await asyncio.sleep(0.05)
        assert await asker.reached(info.id, 3)
        assert "cannot ask this one" in caplog.text
        if how == "dropped by Redis":
            assert "holds no subscription" in caplog.text
