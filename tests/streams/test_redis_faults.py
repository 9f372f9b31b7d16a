"""The Redis store under faults, against a ``redis-server`` the test starts, stops and
starts again on its own port (no persistence: a restart loses every key).

A stream running while Redis goes away streams on to its client; a new request meets
503 ``store_unavailable`` (``[store] required = true``, the default) or runs on its
replica alone (``required = false``, ``X-Nexus-Store: unavailable``); once Redis is
back, another replica resumes the stream whole: the keeper caught its log up.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Any

import orjson
import pytest
from aiohttp import ClientResponse
from aiohttp.test_utils import TestClient

from nexus.auth import ApiKey, hash_key
from nexus.cache.redis import RedisStore
from nexus.server.state import HUB
from redis_server import RedisServer
from support import GatedProvider, MakeClient, chat, parse_sse


def config(server: RedisServer, **store: Any) -> dict[str, Any]:
    return {
        "store": {"kind": "redis", "url": server.url, "prefix": "faults", **store},
        "streams": {"detach_timeout_s": 5},
    }


def texts(body: bytes) -> str:
    return "".join(
        orjson.loads(e.data)["delta"].get("content") or ""
        for e in parse_sse(body)
        if e.event == "delta"
    )


async def read_with_redis_paused(resp: ClientResponse, process: Any) -> tuple[bytes, list[float]]:
    """The nexus-format stream ``resp`` from its first event to its done, read with Redis
    paused (SIGSTOP: it takes the bytes and answers nothing) after that first event; the
    body, and the time between each event and the one before."""
    seen = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5)
    loop = asyncio.get_running_loop()
    gaps = []
    process.send_signal(signal.SIGSTOP)
    try:
        last = loop.time()
        while not seen.endswith(b'event: done\ndata: {"type":"done"}\n\n'):
            seen += await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 10)
            now = loop.time()
            gaps.append(now - last)
            last = now
    finally:
        process.send_signal(signal.SIGCONT)
    return seen, gaps


async def resume(client: TestClient[Any, Any], stream_id: str) -> ClientResponse:
    """``GET /v1/streams/{id}`` on ``client`` until its store has the stream (15 s at most)."""
    deadline = asyncio.get_running_loop().time() + 15
    while True:
        resp = await client.get(f"/v1/streams/{stream_id}?stream_format=nexus")
        if resp.status == 200:
            return resp
        assert resp.status in (404, 503), await resp.text()
        assert asyncio.get_running_loop().time() < deadline, "the log never caught up"
        await asyncio.sleep(0.2)


async def test_a_stream_outlives_a_redis_restart_and_resumes_whole_elsewhere(
    make_client: MakeClient, redis_server: RedisServer
) -> None:
    gated = GatedProvider(before=2, after=3)
    one = await make_client(config(redis_server), providers=[gated])
    two = await make_client(config(redis_server), providers=[GatedProvider()])
    lenient = await make_client(config(redis_server, required=False))
    resp = await one.post(
        "/v1/chat/completions?stream_format=nexus",
        json=chat(model="gated/m", stream=True),
        headers={"X-Nexus-Resumable": "true"},
    )
    assert resp.status == 200
    stream_id = resp.headers["X-Nexus-Stream-Id"]
    seen = b""
    while seen.count(b"event: delta") < 2:
        seen += await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5)

    redis_server.stop()  # mid-stream: the mirror cannot follow
    gated.gate.set()
    seen += await asyncio.wait_for(resp.read(), 10)
    assert texts(seen) == "before0 before1 after0 after1 after2 "
    assert seen.endswith(b'event: done\ndata: {"type":"done"}\n\n')

    # A new request meanwhile: refused by default...
    refused = await one.post("/v1/chat/completions", json=chat(stream=True))
    assert refused.status == 503
    assert (await refused.json())["error"]["code"] == "store_unavailable"
    # ...served on its replica alone with [store] required = false, which says so.
    local = await lenient.post("/v1/chat/completions?stream_format=nexus", json=chat(stream=True))
    assert local.status == 200
    assert local.headers["X-Nexus-Store"] == "unavailable"
    body = await asyncio.wait_for(local.read(), 10)
    assert texts(body) == "Hello there world"
    assert body.endswith(b'event: done\ndata: {"type":"done"}\n\n')

    redis_server.start()  # empty: the log was lost with the restart
    # The keeper catches up (the whole log again, from entry 0): another replica gets all
    # of it, never a part.
    resumed = await resume(two, stream_id)
    replay = await asyncio.wait_for(resumed.read(), 10)
    assert texts(replay) == "before0 before1 after0 after1 after2 "
    assert replay.endswith(b'event: done\ndata: {"type":"done"}\n\n')
    metrics = await (await one.get("/metrics")).text()
    assert 'nexus_store_mirror_total{state="behind"} 1.0' in metrics
    assert 'nexus_store_mirror_total{state="caught_up"} 1.0' in metrics
    # Redis down is not the pool busy: the refused begin counted as unreachable.
    assert 'nexus_store_errors_total{cause="unreachable",op="begin"} 1.0' in metrics
    assert 'cause="busy"' not in metrics


async def test_a_local_only_stream_is_mirrored_whole_once_redis_is_back(
    make_client: MakeClient, redis_server: RedisServer
) -> None:
    gated = GatedProvider(before=2, after=2)
    lenient = await make_client(config(redis_server, required=False), providers=[gated])
    two = await make_client(config(redis_server), providers=[GatedProvider()])
    redis_server.stop()
    resp = await lenient.post(
        "/v1/chat/completions?stream_format=nexus",
        json=chat(model="gated/m", stream=True),
        headers={"X-Nexus-Resumable": "true"},
    )
    assert resp.status == 200
    assert resp.headers["X-Nexus-Store"] == "unavailable"
    stream_id = resp.headers["X-Nexus-Stream-Id"]
    seen = b""
    while seen.count(b"event: delta") < 2:
        seen += await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5)
    redis_server.start()
    # The keeper's next try (a second or two): begun, then written from entry 0.
    follower = await resume(two, stream_id)
    gated.gate.set()
    seen += await asyncio.wait_for(resp.read(), 10)
    followed = await asyncio.wait_for(follower.read(), 10)
    assert texts(seen) == texts(followed) == "before0 before1 after0 after1 "
    assert followed.endswith(b'event: done\ndata: {"type":"done"}\n\n')


async def test_a_json_request_does_not_need_redis_when_nothing_is_cached(
    make_client: MakeClient, redis_server: RedisServer
) -> None:
    """A non-streaming request with the cache off has nothing to share: nobody can learn
    its stream's id, join it or resume it. It was served without the store; a Redis
    outage must not turn it into 503 store_unavailable."""
    client = await make_client(config(redis_server))
    ok = await client.post("/v1/chat/completions", json=chat())
    assert ok.status == 200, await ok.text()
    redis_server.stop()
    resp = await client.post("/v1/chat/completions", json=chat())
    assert resp.status == 200, await resp.text()
    assert (await resp.json())["choices"][0]["message"]["content"] == "Hello there world"


async def test_the_first_command_after_a_redis_restart_finds_a_live_connection(
    redis_server: RedisServer,
) -> None:
    """redis-py's pool skipped its check that an idle connection is still open (its
    maintenance notifications left at "auto"): the first command on each connection after
    a restart failed, and an admission fell back to the process's own count."""
    store = RedisStore(redis_server.url, prefix="restart", max_connections=1)
    await store.start()
    try:
        await store.call("probe", ("SET", b"restart:k", b"1"))
        await asyncio.to_thread(redis_server.stop)  # the loop runs: the close arrives
        await asyncio.to_thread(redis_server.start)
        assert await store.call("probe", ("GET", b"restart:k")) == [None]  # a new Redis
    finally:
        await store.close()


async def test_a_redis_that_hangs_mid_stream_never_holds_the_clients_bytes(
    make_client: MakeClient, redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis paused (SIGSTOP: it takes the bytes and answers nothing), not gone: the client's
    chunks keep coming as the upstream makes them while the mirror's round trip waits out
    its deadline. The lapse is logged once for the stream and counted (``behind``); once
    Redis answers again the log is caught up, and another replica resumes it whole."""
    one = await make_client(config(redis_server))
    two = await make_client(config(redis_server))
    one.app[HUB].store.socket_timeout_s = 1.0  # the round trip's deadline (5 s by default)
    words = " ".join(f"w{i}" for i in range(50))
    process = redis_server.process
    assert process is not None
    resp = await one.post(
        "/v1/chat/completions?stream_format=nexus",
        json=chat(stream=True, mock={"content": words, "delay_ms": 50}),
        headers={"X-Nexus-Resumable": "true"},
    )
    assert resp.status == 200
    stream_id = resp.headers["X-Nexus-Stream-Id"]
    with caplog.at_level(logging.WARNING, logger="nexus.streams"):
        seen, gaps = await read_with_redis_paused(resp, process)
    assert texts(seen).split() == words.split()
    # 50 ms a chunk upstream: no chunk waited for the mirror's 1 s deadline, let alone for
    # Redis (paused for the whole stream, ~2.5 s).
    assert max(gaps) < 0.8, gaps
    lapses = [r for r in caplog.records if "cannot be reached" in r.getMessage()]
    assert len(lapses) == 1 and stream_id in lapses[0].getMessage()
    resumed = await resume(two, stream_id)
    replay = await asyncio.wait_for(resumed.read(), 10)
    assert texts(replay).split() == words.split()
    metrics = await (await one.get("/metrics")).text()
    assert 'nexus_store_mirror_total{state="behind"} 1.0' in metrics
    assert 'nexus_store_mirror_total{state="caught_up"} 1.0' in metrics


async def test_a_redis_that_hangs_as_a_budgeted_stream_ends_delays_its_end_two_seconds_at_most(
    make_client: MakeClient, redis_server: RedisServer
) -> None:
    """A key with a budget: the stream's cost is charged before its end is published (a
    client that saw the end finds its spend charged), and its slot leaves Redis. With
    Redis paused, the end waited on the charge's round trip (5 s) and the slot's (1 s);
    now on each for 1 s at most, the charge sent again once Redis answers."""
    price = {"input_usd_per_mtok": 0, "output_usd_per_mtok": 1_000_000}  # $1 a token
    key = "nx-faults-0123456789-secret"
    entry = {"name": "alpha", "sha256": hash_key(key), "budget_usd": 100, "budget_period": "total"}
    one = await make_client(
        {
            **config(redis_server),
            "auth": {"keys": [entry]},
            "models": {"mock/echo": price},
            "limits": {"budget_max_output_tokens": 30},  # $30 held while it runs
        }
    )
    words = " ".join(f"w{i}" for i in range(20))
    process = redis_server.process
    assert process is not None
    resp = await one.post(
        "/v1/chat/completions?stream_format=nexus",
        json=chat(stream=True, mock={"content": words, "delay_ms": 50}),
        headers={"Authorization": f"Bearer {key}"},
    )
    assert resp.status == 200, await resp.text()
    seen, gaps = await read_with_redis_paused(resp, process)
    assert texts(seen).split() == words.split()
    assert max(gaps) < 2.6, gaps  # the charge's second, the slot's second, and slack
    limits = one.app[HUB].limits
    alpha = ApiKey("alpha", budget_usd=100, budget_period="total")
    for _ in range(100):  # charged once Redis answers again (the next tick's retry)
        if await limits.spent(alpha) == pytest.approx(20):
            break
        await asyncio.sleep(0.1)
    assert await limits.spent(alpha) == pytest.approx(20)
