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
