"""A joined request is not cut short, silently, by the request it joined.

With ``[cache] enabled``, an identical request joins the in-flight stream. When
the origin leaves it (a WebSocket ``abort``, the socket closing), the stream
lives on for the joiners; a ``DELETE`` ends it with an error, never with a
``done`` that would make a truncated answer look complete.
"""

from __future__ import annotations

import asyncio

import orjson
import pytest
import websockets

from nexus.auth import hash_key
from support import GatedProvider, MakeClient, chat, parse_sse


async def test_a_joined_request_is_not_silently_truncated_by_the_origins_abort(
    make_client: MakeClient,
) -> None:
    gated = GatedProvider(before=1, after=3)
    client = await make_client({"cache": {"enabled": True}}, providers=[gated])
    url = f"ws://{client.server.host}:{client.server.port}/v1/realtime"
    async with websockets.connect(url) as ws:
        await ws.send(orjson.dumps({"type": "start", "request": chat(model="gated/m")}).decode())
        await asyncio.wait_for(ws.recv(), 5)  # the origin's first delta
        streaming = asyncio.create_task(
            client.post("/v1/chat/completions", json=chat(model="gated/m", stream=True))
        )
        plain = asyncio.create_task(client.post("/v1/chat/completions", json=chat(model="gated/m")))
        await asyncio.sleep(0.2)
        await ws.send('{"type":"abort"}')
        assert orjson.loads(await asyncio.wait_for(ws.recv(), 5))["aborted"] is True
        gated.gate.set()  # the stream lives on for the requests that joined it
        sse, json_resp = await asyncio.wait_for(asyncio.gather(streaming, plain), 10)
        assert sse.headers["X-Nexus-Cache"] == json_resp.headers["X-Nexus-Cache"] == "hit"
        events = parse_sse(await sse.read())
        body = await json_resp.json()
    # Either the joiners get the whole answer (the stream lives on for them), or they are
    # told it was cut short; never a partial answer that looks complete.
    text = "".join(
        (orjson.loads(e.data)["choices"] or [{"delta": {}}])[0]["delta"].get("content") or ""
        for e in events
        if e.data.startswith("{") and e.event != "error"
    )
    complete = "before0 after0 after1 after2 "
    assert text == complete or any(e.event == "error" for e in events), text
    assert json_resp.status != 200 or (body["choices"][0]["message"]["content"] == complete), body


async def test_an_origin_leaving_while_a_joiner_is_being_joined_does_not_cut_it_short(
    make_client: MakeClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between the join and the joiner's first read the hub waits (its own upstream stream
    closed unread; with Redis a round trip): the joiner reads the stream from the moment
    it joined, so the origin's client leaving then ends nothing. Widened here to 0.3 s."""
    from nexus.stream import Stream

    closing = Stream.close

    async def slow_close(self: Stream) -> None:
        await asyncio.sleep(0.3)  # the join's wait, made long
        await closing(self)

    gated = GatedProvider(before=1, after=3)
    client = await make_client({"cache": {"enabled": True}}, providers=[gated])
    origin = asyncio.create_task(client.post("/v1/chat/completions", json=chat(model="gated/m")))
    await asyncio.wait_for(gated.started.wait(), 5)
    await asyncio.sleep(0.05)
    monkeypatch.setattr(Stream, "close", slow_close)
    streaming = asyncio.create_task(
        client.post("/v1/chat/completions", json=chat(model="gated/m", stream=True))
    )
    plain = asyncio.create_task(client.post("/v1/chat/completions", json=chat(model="gated/m")))
    await asyncio.sleep(0.1)  # both joined, in the wait
    origin.cancel()  # the origin's client goes away
    await asyncio.sleep(0.05)
    gated.gate.set()
    sse, json_resp = await asyncio.wait_for(asyncio.gather(streaming, plain), 10)
    assert sse.headers["X-Nexus-Cache"] == json_resp.headers["X-Nexus-Cache"] == "hit"
    events = parse_sse(await sse.read())
    text = "".join(
        (orjson.loads(e.data)["choices"] or [{"delta": {}}])[0]["delta"].get("content") or ""
        for e in events
        if e.data.startswith("{")
    )
    complete = "before0 after0 after1 after2 "
    assert text == complete
    assert json_resp.status == 200
    assert (await json_resp.json())["choices"][0]["message"]["content"] == complete


async def test_an_identical_request_joins_a_stream_that_outlived_its_claims_first_ttl(
    make_client: MakeClient,
) -> None:
    """The claim lasted resume_ttl_s (300 s) while a stream may run 900: an identical
    request past it called the upstream again instead of joining."""
    gated = GatedProvider(before=1, after=1)
    config = {"cache": {"enabled": True}, "streams": {"resume_ttl_s": 0.3}}
    client = await make_client(config, providers=[gated])
    first = asyncio.create_task(client.post("/v1/chat/completions", json=chat(model="gated/m")))
    await asyncio.wait_for(gated.started.wait(), 5)
    await asyncio.sleep(0.6)  # past resume_ttl_s, the stream still running
    second = asyncio.create_task(client.post("/v1/chat/completions", json=chat(model="gated/m")))
    await asyncio.sleep(0.1)
    gated.gate.set()
    one, two = await asyncio.wait_for(asyncio.gather(first, second), 10)
    assert (one.headers["X-Nexus-Cache"], two.headers["X-Nexus-Cache"]) == ("miss", "hit")
    assert (await one.json())["choices"] == (await two.json())["choices"]


async def test_a_joined_request_is_shown_the_cost_it_was_charged_nothing(
    make_client: MakeClient,
) -> None:
    """A request that joins a stream in flight is charged nothing (the stream's spend is its
    origin's), so the cost it is shown is 0.0, as a replay's: it was shown the origin's whole
    cost, which a client adding up `usage.cost` counted twice, and, with the cache shared
    across keys, which told another tenant what the first one spent."""
    config = {
        "cache": {"enabled": True},
        "models": {"mock/echo": {"input_usd_per_mtok": 1e6, "output_usd_per_mtok": 1e6}},
    }
    client = await make_client(config)
    script = {"delay_ms": 150, "usage": {"prompt_tokens": 1, "completion_tokens": 2}}
    costly = {"include_usage": True, "include_cost": True}
    ask = chat(model="mock/echo", stream=True, stream_options=costly, mock=script)
    origin = asyncio.create_task(client.post("/v1/chat/completions", json=ask))
    await asyncio.sleep(0.1)
    joiner = asyncio.create_task(client.post("/v1/chat/completions", json=ask))
    as_json = chat(model="mock/echo", stream_options=costly, mock=script)
    plain = asyncio.create_task(client.post("/v1/chat/completions", json=as_json))
    first, second, answer = await asyncio.wait_for(asyncio.gather(origin, joiner, plain), 10)
    assert second.headers["X-Nexus-Cache"] == answer.headers["X-Nexus-Cache"] == "hit"

    def cost(response_body: bytes) -> float:
        (usage,) = [
            orjson.loads(e.data)["usage"]
            for e in parse_sse(response_body)
            if e.data.startswith("{") and orjson.loads(e.data).get("usage")
        ]
        return usage["cost"]  # type: ignore[no-any-return]

    assert cost(await first.read()) == 3.0  # 1 + 2 tokens at $1 each
    assert cost(await second.read()) == 0.0
    assert (await answer.json())["usage"]["cost"] == 0.0


@pytest.mark.parametrize("owner", ["json", "streaming"])
async def test_a_background_request_that_joined_outlives_the_owners_client(
    make_client: MakeClient, owner: str
) -> None:
    """A background request joined a stream (its 202 says resumable): the owner's client
    leaving (a JSON answer's, or a stream's before its headers) cancelled it, its read
    token finding only ``client_disconnect``."""
    gated = GatedProvider(before=0, after=2)
    config = {"cache": {"enabled": True}, "streams": {"detach_timeout_s": 30}}
    client = await make_client(config, providers=[gated])
    body = chat(model="gated/m", stream=owner == "streaming")
    asking = asyncio.ensure_future(client.post("/v1/chat/completions", json=body))
    await asyncio.wait_for(gated.started.wait(), 5)
    joined = await client.post("/v1/chat/completions", json=chat(model="gated/m", background=True))
    assert joined.status == 202 and joined.headers["X-Nexus-Cache"] == "hit"
    url = (await joined.json())["url"]
    asking.cancel()
    await asyncio.sleep(0.3)
    assert not gated.closed.is_set()
    gated.gate.set()
    read = await client.get(url, params={"stream_format": "ndjson"})
    lines = [orjson.loads(line) for line in (await read.read()).splitlines()]
    assert lines[-1] == {"type": "done"}


async def test_a_replay_read_later_carries_the_cost_asked_for(make_client: MakeClient) -> None:
    """A hit's stream (a background request's, read with its token) left out the usage
    that ``include_cost`` alone asks for, as a miss's carries it."""
    prices = {"mock/echo": {"input_usd_per_mtok": 1, "output_usd_per_mtok": 1}}
    client = await make_client({"cache": {"enabled": True}, "models": prices})
    body = chat(background=True, stream_options={"include_cost": True})
    costs = []
    for _ in range(2):
        created = await client.post("/v1/chat/completions", json=body)
        await asyncio.sleep(0.2)
        read = await client.get((await created.json())["url"])
        chunks = [orjson.loads(e.data) for e in parse_sse(await read.read()) if e.data[:1] == "{"]
        costs.append([c["usage"]["cost"] for c in chunks if c.get("usage")])
        costs[-1].append(created.headers.get("X-Nexus-Cache"))
    assert costs[0][0] > 0 and costs[0][1] == "miss"
    assert costs[1] == [0.0, "hit"]  # a hit costs nothing, and says so


async def test_another_keys_background_join_reads_the_cost_it_was_charged(
    make_client: MakeClient,
) -> None:
    """With a shared cache, a background request of key B joined key A's stream: charged
    nothing, it read A's cost (a dollar figure of another tenant) with its own token."""
    keys = {"alpha": "nx-alpha-join-0123456789", "beta": "nx-beta-join-0123456789"}
    config = {
        "cache": {"enabled": True, "share_across_keys": True},
        "auth": {"keys": [{"name": n, "sha256": hash_key(k)} for n, k in keys.items()]},
        "models": {"mock/echo": {"input_usd_per_mtok": 1, "output_usd_per_mtok": 1}},
    }
    client = await make_client(config)
    options = {"include_usage": True, "include_cost": True}
    body = chat(stream=True, stream_options=options, mock={"content": "a b c d", "delay_ms": 60})
    alpha = {"Authorization": f"Bearer {keys['alpha']}"}
    beta = {"Authorization": f"Bearer {keys['beta']}"}
    first = asyncio.ensure_future(client.post("/v1/chat/completions", json=body, headers=alpha))
    await asyncio.sleep(0.1)
    joined = await client.post(
        "/v1/chat/completions", json={**body, "background": True}, headers=beta
    )
    assert joined.headers["X-Nexus-Cache"] == "hit"
    await (await first).read()
    read = await client.get((await joined.json())["url"])
    chunks = [orjson.loads(e.data) for e in parse_sse(await read.read()) if e.data[:1] == "{"]
    assert [c["usage"]["cost"] for c in chunks if c.get("usage")] == [0.0]
