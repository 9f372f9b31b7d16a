"""Running streams across a Redis restart that loses every key (no persistence), against a
``redis-server`` the test starts and restarts on its own port.

Whatever a stream was doing when Redis came back empty (waiting for its first token,
quiet between two, or ending while Redis was still down), another replica finds it again
and reads it whole, and its own replica reads it all along: never a 404 for a stream that
runs, never a part of one.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

import orjson
import pytest
from aiohttp.test_utils import TestClient

from nexus.cache import redis_holds
from nexus.cache.redis import RedisStore
from nexus.cache.store import StreamInfo
from nexus.errors import StoreUnavailable
from nexus.events import Delta, StreamEvent, Usage
from nexus.providers.base import Provider
from nexus.request import ChatRequest
from nexus.server.state import HUB
from nexus.types import StreamMeta
from redis_server import RedisServer
from support import MakeClient, chat, parse_sse


class Gates(Provider):
    """One token per gate, each yielded once its gate is set; then the end."""

    kind = "gates"

    def __init__(self, count: int) -> None:
        super().__init__("gates")
        self.gates = [asyncio.Event() for _ in range(count)]
        self.started = asyncio.Event()

    async def batches(
        self, request: ChatRequest, model: str
    ) -> AsyncGenerator[list[StreamEvent], None]:
        self.started.set()
        for i, gate in enumerate(self.gates):
            await gate.wait()
            yield [Delta(content=f"t{i} ")]
        yield [Delta(finish_reason="stop")]
        yield [Usage(prompt_tokens=1, completion_tokens=2, total_tokens=3)]


def config(server: RedisServer) -> dict[str, Any]:
    return {
        "store": {"kind": "redis", "url": server.url, "prefix": "restart"},
        "streams": {"detach_timeout_s": 30},
    }


def texts(body: bytes) -> str:
    return "".join(
        orjson.loads(e.data)["delta"].get("content") or ""
        for e in parse_sse(body)
        if e.event == "delta"
    )


def resumable(client: TestClient[Any, Any]) -> Any:
    """A resumable stream of the ``gates`` provider, in the nexus format (the request)."""
    return client.post(
        "/v1/chat/completions?stream_format=nexus",
        json=chat(model="gates/m", stream=True),
        headers={"X-Nexus-Resumable": "true"},
    )


async def statuses(client: TestClient[Any, Any], stream_id: str, times: int = 4) -> list[int]:
    """What ``GET /v1/streams/{id}`` answers on ``client``, ``times`` times 0.2 s apart."""
    seen = []
    for _ in range(times):
        resp = await client.get(f"/v1/streams/{stream_id}?stream_format=nexus")
        seen.append(resp.status)
        resp.close()
        await asyncio.sleep(0.2)
    return seen


async def whole(client: TestClient[Any, Any], stream_id: str) -> bytes:
    resp = await client.get(f"/v1/streams/{stream_id}?stream_format=nexus")
    assert resp.status == 200, await resp.text()
    return await asyncio.wait_for(resp.read(), 10)


async def test_a_stream_begun_before_a_restart_is_found_elsewhere_from_its_first_token(
    make_client: MakeClient, redis_server: RedisServer
) -> None:
    """Begun (its info in Redis), then Redis restarted before its first token (a reasoning
    model's long think): the first token's write re-created the log alone, and the stream
    had no info in Redis until it ended (404 elsewhere for its whole run)."""
    gates = Gates(2)
    one = await make_client(config(redis_server), providers=[gates])
    two = await make_client(config(redis_server))
    post = asyncio.ensure_future(resumable(one))
    await asyncio.wait_for(gates.started.wait(), 5)
    (stream_id,) = one.server.app[HUB].live
    assert await statuses(two, stream_id, 1) == [200]
    await asyncio.to_thread(redis_server.stop)
    await asyncio.to_thread(redis_server.start)  # empty
    gates.gates[0].set()
    await asyncio.sleep(0.5)  # the mirror's write, found lost, then the stream begun again
    assert await statuses(two, stream_id) == [200] * 4
    gates.gates[1].set()
    resp = await post
    assert texts(await asyncio.wait_for(resp.read(), 10)) == "t0 t1 "
    assert texts(await whole(two, stream_id)) == "t0 t1 "


async def test_a_quiet_stream_is_found_elsewhere_within_a_beat_of_a_restart(
    make_client: MakeClient, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Quiet between two tokens when Redis came back empty: the beat finds its own key
    gone and the keeper checks the live streams at once (not after a third of
    ``resume_ttl_s``), writing the lost ones again."""
    monkeypatch.setattr(redis_holds, "OWNER_TTL_S", 1.5)  # a beat every 0.5 s
    gates = Gates(2)
    one = await make_client(config(redis_server), providers=[gates])
    two = await make_client(config(redis_server))
    post = asyncio.ensure_future(resumable(one))
    gates.gates[0].set()
    resp = await post
    assert b"t0 " in await asyncio.wait_for(resp.content.readuntil(b"t0 "), 5)
    stream_id = resp.headers["X-Nexus-Stream-Id"]
    await asyncio.sleep(0.2)  # mirrored
    await asyncio.to_thread(redis_server.stop)
    await asyncio.to_thread(redis_server.start)  # empty, and nothing more comes upstream
    await asyncio.sleep(1.5)  # a beat or two, and the keeper's write
    assert await statuses(two, stream_id) == [200] * 4
    replay = asyncio.ensure_future(whole(two, stream_id))  # followed live from elsewhere
    await asyncio.sleep(0.2)
    gates.gates[1].set()
    assert texts(await asyncio.wait_for(resp.read(), 10)) == "t1 "
    assert texts(await replay) == "t0 t1 "


async def test_a_stream_whose_mirror_backed_off_is_found_within_a_beat_of_redis_back(
    make_client: MakeClient, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis down for a while as the stream went on: its mirror's retries backed off (1,
    2, 4... s), and when Redis came back empty, readers elsewhere got 404 for a running
    stream until the next retry, seconds later (an EventSource gives up on a 404). The
    beat that finds the store lost its keys now cuts the wait short."""
    monkeypatch.setattr(redis_holds, "OWNER_TTL_S", 1.5)  # a beat every 0.5 s
    gates = Gates(3)
    one = await make_client(config(redis_server), providers=[gates])
    two = await make_client(config(redis_server))
    post = asyncio.ensure_future(resumable(one))
    gates.gates[0].set()
    resp = await post
    await asyncio.wait_for(resp.content.readuntil(b"t0 "), 5)
    stream_id = resp.headers["X-Nexus-Stream-Id"]
    await asyncio.sleep(0.2)  # mirrored
    await asyncio.to_thread(redis_server.stop)
    gates.gates[1].set()  # a token the mirror cannot write: it backs off
    await asyncio.wait_for(resp.content.readuntil(b"t1 "), 5)
    await asyncio.sleep(3.5)  # its retries: at 1, 3, then 7 s
    await asyncio.to_thread(redis_server.start)  # empty
    await asyncio.sleep(1.2)  # a beat or two, and the keeper's write
    assert await statuses(two, stream_id, 2) == [200] * 2
    gates.gates[2].set()
    assert texts(await asyncio.wait_for(resp.read(), 10)) == "t2 "
    assert texts(await whole(two, stream_id)) == "t0 t1 t2 "


async def test_a_stream_that_ends_while_redis_is_down_is_read_whole_on_its_replica(
    make_client: MakeClient, redis_server: RedisServer
) -> None:
    """Its end could not be written, so the keeper retries it; meanwhile the stream stopped
    counting as running and, until now, was no longer found here either: its own
    replica answered 503 while Redis was down and 404 once it came back empty, until
    the retry (up to 8 s later)."""
    gates = Gates(2)
    one = await make_client(config(redis_server), providers=[gates])
    gates.gates[0].set()
    resp = await resumable(one)
    stream_id = resp.headers["X-Nexus-Stream-Id"]
    await asyncio.wait_for(resp.content.readuntil(b"t0 "), 5)
    resp.close()  # the client leaves; resumable, the stream runs on
    await asyncio.to_thread(redis_server.stop)
    gates.gates[1].set()  # it ends while Redis is down
    hub = one.server.app[HUB]
    for _ in range(50):
        if stream_id not in hub.live:
            break
        await asyncio.sleep(0.05)
    assert stream_id not in hub.live  # it holds no slot while its end is retried
    assert await statuses(one, stream_id, 2) == [200, 200]
    assert texts(await whole(one, stream_id)) == "t0 t1 "
    await asyncio.to_thread(redis_server.start)  # back, empty
    assert await statuses(one, stream_id, 2) == [200, 200]
    assert texts(await whole(one, stream_id)) == "t0 t1 "


async def test_a_stream_whose_end_cannot_be_written_is_not_kept_in_memory(
    redis_server: RedisServer,
) -> None:
    """What the store keeps per live stream (its log's size, its key's count) went only
    when its end was written: a stream ended while Redis was down stayed in memory for
    good, one per stream of every outage."""
    store = RedisStore(redis_server.url, "forget", pool_timeout_s=0.5)
    await store.start()
    try:
        info = StreamInfo(StreamMeta.new("mock/echo"), "text/event-stream", status="failed")
        await store.begin(info, 60)
        assert info.id in store._live
        await asyncio.to_thread(redis_server.stop)
        with pytest.raises(StoreUnavailable):
            await store.end(info, [Delta(content="x")], 0, 60)
        assert info.id not in store._live
        assert info.id not in store.quota.counted
    finally:
        await store.close()
