"""A ``start`` during the shutdown's grace (a voice client's barge-in: ``abort`` then
``start``) starts no turn: a retryable ``server_shutting_down``, then close 1001."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import orjson
import pytest
import websockets

from nexus.config import parse_config
from nexus.encoders.registry import default_registry
from nexus.server.app import create_app
from nexus.server.state import RUNTIME
from support import MakeClient

SLOW = {"content": " ".join(["word"] * 200), "delay_ms": 50}  # ten seconds: cut early
START = orjson.dumps(
    {
        "type": "start",
        "request": {"model": "mock/echo", "messages": [{"role": "user", "content": "x"}]}
        | {"mock": SLOW},
    }
).decode()


async def test_a_barge_in_during_the_grace_is_refused_and_the_socket_closes_1001(
    make_client: MakeClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="nexus")
    client = await make_client(
        {"models": {"mock/echo": {"input_usd_per_mtok": 1, "output_usd_per_mtok": 1}}}
    )
    url = f"ws://{client.server.host}:{client.server.port}/v1/realtime"
    async with websockets.connect(url) as ws:
        await ws.send(START)
        assert orjson.loads(await asyncio.wait_for(ws.recv(), 10))["type"] == "delta"
        client.app[RUNTIME].shutting_down = True  # the grace has begun (the turn may finish)
        await ws.send('{"type":"abort"}')
        await ws.send(START)
        frames = []
        with pytest.raises(websockets.ConnectionClosed) as closed:
            while True:
                frames.append(orjson.loads(await asyncio.wait_for(ws.recv(), 10)))
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1001
    ends = [f for f in frames if f["type"] != "delta"]
    assert ends[0] == {"type": "done", "aborted": True}
    assert [e["error"]["code"] for e in ends[1:]] == ["server_shutting_down"]
    assert ends[1]["error"]["retryable"] is True
    assert ends[1]["refused"] == "start"  # the start's answer, not a turn's end
    for _ in range(500):  # the socket's access line: after its handler ends
        names = {r.name for r in caplog.records}
        if {"nexus.access", "nexus.spend"} <= names:
            break
        await asyncio.sleep(0.01)
    spends = [r for r in caplog.records if r.name == "nexus.spend"]
    assert len(spends) == 1  # the aborted turn's only: no second turn was started
    access = [r.access for r in caplog.records if r.name == "nexus.access"]  # type: ignore[attr-defined]
    assert access[0]["outcome"] == "cancelled:shutdown"


async def test_a_socket_the_shutdown_closes_is_logged_as_shutdown(
    aiohttp_client: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # As `nexus serve` runs: the peer's close cancels the handler while it waits for the
    # shutdown's close, which must not make the socket's line a client_disconnect.
    caplog.set_level(logging.INFO, logger="nexus")
    app = create_app(parse_config({}), registry=default_registry.copy())
    client = await aiohttp_client(app, server_kwargs={"handler_cancellation": True})
    url = f"ws://{client.server.host}:{client.server.port}/v1/realtime"
    async with websockets.connect(url) as ws:
        await ws.send('{"type":"abort"}')  # the socket is up
        assert orjson.loads(await ws.recv())["error"]["code"] == "nothing_to_abort"
        for conn in list(app[RUNTIME].sockets):  # as the app's shutdown does: a task
            await asyncio.create_task(conn.shutdown())
        with pytest.raises(websockets.ConnectionClosed):
            await asyncio.wait_for(ws.recv(), 10)
    for _ in range(500):
        access = [r.access for r in caplog.records if r.name == "nexus.access"]  # type: ignore[attr-defined]
        if access:
            break
        await asyncio.sleep(0.01)
    assert access[0]["outcome"] == "cancelled:shutdown"
