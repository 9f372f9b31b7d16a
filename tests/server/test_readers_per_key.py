"""One key cannot hold every connection, nor the event loop, with readers that hold no
stream slot: ``[limits] max_readers_per_key`` refuses its next follower, resume or join
with 429 ``too_many_readers`` (before any lookup), another key is not held back, and every
way a reader leaves gives its place back. Also: a DELETE that finds nothing of the caller's
takes a token of its rate."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import websockets
from aiohttp import ClientResponse
from aiohttp.test_utils import TestClient

from nexus.auth import hash_key
from nexus.cache.limits import LocalLimits
from nexus.server.state import HUB
from support import GatedProvider, MakeClient, chat, parse_sse, turn

A, B = "nx-readers-key-a-0001", "nx-readers-key-b-0001"
KEYS = {"keys": [{"name": "a", "sha256": hash_key(A)}, {"name": "b", "sha256": hash_key(B)}]}
SSE = "/v1/chat/completions?stream_format=sse"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def local(client: TestClient[Any, Any]) -> LocalLimits:
    limits = client.app[HUB].limits
    assert isinstance(limits, LocalLimits)  # (the memory store's)
    return limits


def held(client: TestClient[Any, Any], name: str) -> int:
    return local(client).held("readers", name)


async def settled(client: TestClient[Any, Any], name: str, count: int) -> None:
    """Wait (by steps, not by a deadline that matters) for the server to let places go."""
    for _ in range(1000):
        if held(client, name) == count:
            return
        await asyncio.sleep(0.01)
    assert held(client, name) == count


async def too_many(resp: ClientResponse) -> None:
    assert resp.status == 429, await resp.text()
    assert resp.headers["Retry-After"] == "1"
    error = (await resp.json())["error"]
    assert error["code"] == "too_many_readers"
    assert "max_readers_per_key" in error["message"]


async def background(client: TestClient[Any, Any]) -> dict[str, Any]:
    resp = await client.post(
        "/v1/chat/completions",
        json=chat(model="gated/m", stream=True, background=True),
        headers=bearer(A),
    )
    assert resp.status == 202
    described: dict[str, Any] = await resp.json()
    return described


async def test_followers_past_the_cap_are_refused_and_another_key_is_not(
    make_client: MakeClient,
) -> None:
    gated = GatedProvider(before=1, after=1)
    client = await make_client(
        {"auth": KEYS, "limits": {"max_readers_per_key": 2}}, providers=[gated]
    )
    stream = await background(client)
    url = f"/v1/streams/{stream['id']}"
    first = await client.get(url, headers=bearer(A))
    second = await client.get(url, headers=bearer(A))  # a read token is A's too
    assert (first.status, second.status) == (200, 200)
    assert held(client, "a") == 2
    await too_many(await client.get(url, headers=bearer(A)))
    await too_many(await client.get(stream["url"]))  # a read token counts for its owner
    # Refused before the lookup: an id that does not exist is refused the same.
    await too_many(await client.get("/v1/streams/nope", headers=bearer(A)))
    resume = await client.post(
        SSE, json=chat(), headers=bearer(A) | {"Last-Event-ID": f"{stream['id']}.0"}
    )
    await too_many(resume)
    # Another key streams, and reads, as before.
    other = await client.post(SSE, json=chat(stream=True), headers=bearer(B))
    assert other.status == 200
    assert parse_sse(await other.read())[-1].data == "[DONE]"
    gated.gate.set()
    for resp in (first, second):
        assert parse_sse(await resp.read())[-1].data == "[DONE]"
    await settled(client, "a", 0)


async def test_joins_past_the_cap_are_refused_while_the_origin_streams(
    make_client: MakeClient,
) -> None:
    gated = GatedProvider(before=1, after=1)
    client = await make_client(
        {"auth": KEYS, "cache": {"enabled": True}, "limits": {"max_readers_per_key": 1}},
        providers=[gated],
    )
    body = chat(model="gated/m", stream=True)
    origin = await client.post(SSE, json=body, headers=bearer(A))
    assert origin.status == 200
    assert held(client, "a") == 0  # the origin holds a stream slot, not a reader's place
    joined = await client.post(SSE, json=body, headers=bearer(A))
    assert joined.status == 200
    assert joined.headers["X-Nexus-Cache"] == "hit"
    assert held(client, "a") == 1
    await too_many(await client.post(SSE, json=body, headers=bearer(A)))
    other = await client.post(SSE, json=chat(stream=True), headers=bearer(B))
    assert other.status == 200
    await other.read()
    gated.gate.set()
    for resp in (origin, joined):
        assert parse_sse(await resp.read())[-1].data == "[DONE]"
    await settled(client, "a", 0)


async def test_every_way_a_reader_leaves_gives_its_place_back(make_client: MakeClient) -> None:
    gated = GatedProvider(before=1, after=1)
    client = await make_client(
        {"auth": KEYS, "cache": {"enabled": True}, "limits": {"max_readers_per_key": 8}},
        providers=[gated],
    )
    # Refused lookups: not found, another key's stream, a bad Last-Event-ID.
    assert (await client.get("/v1/streams/nope", headers=bearer(A))).status == 404
    stream = await background(client)
    url = f"/v1/streams/{stream['id']}"
    assert (await client.get(url, headers=bearer(B))).status == 404
    bad = await client.get(url, headers=bearer(A) | {"Last-Event-ID": "other.3"})
    assert bad.status == 400
    assert held(client, "a") == 0
    # A client reset mid-read.
    gone = await client.get(url, headers=bearer(A))
    assert gone.status == 200
    await settled(client, "a", 1)
    gone.close()  # the connection drops, the stream still runs
    await settled(client, "a", 0)
    # Readers of a stream that is cancelled (an error ends them), a follower and a join.
    body = chat(model="gated/m", stream=True, content="joined")
    origin = await client.post(SSE, json=body, headers=bearer(A))
    joiner = await client.post(SSE, json=body, headers=bearer(A))
    follower = await client.get(url, headers=bearer(A))
    await settled(client, "a", 2)
    joined_id = (
        origin.headers.get("X-Nexus-Stream-Id")
        or parse_sse(await origin.content.readuntil(b"\n\n"))[0].id.split(".")[0]
    )
    assert (await client.delete(f"/v1/streams/{joined_id}", headers=bearer(A))).status == 200
    assert (await client.delete(url, headers=bearer(A))).status == 200
    for resp in (joiner, follower, origin):
        await resp.read()
    await settled(client, "a", 0)
    # Readers that read to the end (a resume by POST, and one after its end).
    done = await background(client)
    resumed = await client.post(
        SSE, json=chat(), headers=bearer(A) | {"Last-Event-ID": f"{done['id']}.0"}
    )
    assert resumed.status == 200
    gated.gate.set()
    assert parse_sse(await resumed.read())[-1].data == "[DONE]"
    after = await client.get(f"/v1/streams/{done['id']}", headers=bearer(A))
    await after.read()
    await settled(client, "a", 0)
    assert not local(client)._places  # none left behind, not even empty


async def test_a_delete_that_finds_nothing_takes_a_rate_token(make_client: MakeClient) -> None:
    gated = GatedProvider(before=1, after=1)
    # One token a key, the next in 1000 s.
    client = await make_client(
        {"auth": KEYS, "limits": {"requests_per_second_per_key": 0.001}}, providers=[gated]
    )
    stream = await background(client)  # A's token
    assert (await client.delete("/v1/streams/nope", headers=bearer(B))).status == 404
    for url in ("/v1/streams/nope", f"/v1/streams/{stream['id']}"):  # none, or not B's
        refused = await client.delete(url, headers=bearer(B))
        assert refused.status == 429
        assert (await refused.json())["error"]["code"] == "rate_limited"
    assert (await client.delete("/v1/streams/nope", headers=bearer(A))).status == 429
    # Past its rate, A still stops its own running stream.
    cancelled = await client.delete(f"/v1/streams/{stream['id']}", headers=bearer(A))
    assert cancelled.status == 200


async def test_a_realtime_turn_that_joins_a_stream_takes_a_readers_place(
    make_client: MakeClient,
) -> None:
    """A WebSocket ``start`` identical to a stream in flight joins it, as an HTTP request
    does, and reads it holding no stream slot: it took no reader's place either, so a key
    at its cap read on past it, one more per socket."""
    gated = GatedProvider(before=1, after=1)
    client = await make_client(
        {"auth": KEYS, "cache": {"enabled": True}, "limits": {"max_readers_per_key": 1}},
        providers=[gated],
    )
    body = chat(model="gated/m", stream=True)
    origin = await client.post(SSE, json=body, headers=bearer(A))
    assert origin.status == 200
    url = f"ws://{client.server.host}:{client.server.port}/v1/realtime"
    start = orjson.dumps({"type": "start", "request": chat(model="gated/m")}).decode()
    async with websockets.connect(url, subprotocols=["nexus.v1", f"nexus-key.{A}"]) as ws:  # type: ignore[list-item]
        await ws.send(start)
        assert orjson.loads(await asyncio.wait_for(ws.recv(), 5))["type"] == "delta"
        assert held(client, "a") == 1  # the turn's place
        await too_many(await client.post(SSE, json=body, headers=bearer(A)))
        async with websockets.connect(url, subprotocols=["nexus.v1", f"nexus-key.{A}"]) as two:  # type: ignore[list-item]
            await two.send(start)
            refused = orjson.loads(await asyncio.wait_for(two.recv(), 5))
            assert refused["type"] == "error", refused
            assert refused["error"]["code"] == "too_many_readers"
        gated.gate.set()
        assert (await turn(ws))[-1] == {"type": "done"}
        await settled(client, "a", 0)  # the turn's place back as it ended
    assert parse_sse(await origin.read())[-1].data == "[DONE]"
