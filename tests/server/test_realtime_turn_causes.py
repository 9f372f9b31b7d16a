"""A realtime turn ended early says why in its spend line: ``aborted``, ``shutdown``,
``ping_timeout`` or ``client_disconnect``, not ``client_disconnect`` for all of them."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import orjson
import pytest
import websockets

from nexus.server.state import RUNTIME
from support import MakeClient, masked, raw_socket, read_frame

PRICED = {"models": {"mock/echo": {"input_usd_per_mtok": 1, "output_usd_per_mtok": 1}}}
SLOW = {"content": " ".join(["word"] * 200), "delay_ms": 50}  # ten seconds: cut early
START = orjson.dumps(
    {
        "type": "start",
        "request": {"model": "mock/echo", "messages": [{"role": "user", "content": "x"}]}
        | {"mock": SLOW},
    }
).decode()


async def spend_line(caplog: pytest.LogCaptureFixture) -> dict[str, Any]:
    for _ in range(1000):
        for record in caplog.records:
            if record.name == "nexus.spend":
                return record.access  # type: ignore[attr-defined,no-any-return]
        await asyncio.sleep(0.01)
    raise AssertionError("no spend line")


async def first_delta(ws: Any) -> None:
    assert orjson.loads(await asyncio.wait_for(ws.recv(), 10))["type"] == "delta"


@pytest.mark.parametrize("cause", ["aborted", "shutdown", "client_disconnect"])
async def test_the_spend_line_of_a_turn_ended_early_names_its_cause(
    make_client: MakeClient, caplog: pytest.LogCaptureFixture, cause: str
) -> None:
    caplog.set_level(logging.INFO, logger="nexus")
    client = await make_client(PRICED)
    url = f"ws://{client.server.host}:{client.server.port}/v1/realtime"
    ws = await websockets.connect(url)
    await ws.send(START)
    await first_delta(ws)
    if cause == "aborted":
        await ws.send('{"type":"abort"}')
    elif cause == "shutdown":
        for conn in list(client.app[RUNTIME].sockets):  # as the app's shutdown does: a task
            await asyncio.create_task(conn.shutdown())
    else:
        await ws.close()
    line = await spend_line(caplog)
    await ws.close()
    assert (line["endpoint"], line["model"]) == ("/v1/realtime", "mock/echo")
    assert line["outcome"] == f"cancelled:{cause}"


async def test_a_turn_whose_peer_ignores_pings_ends_as_a_ping_timeout(
    make_client: MakeClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="nexus")
    client = await make_client({**PRICED, "server": {"heartbeat_interval_s": 0.2}})
    reader, writer = await raw_socket(client)
    writer.write(masked(0x1, START.encode()))
    assert (await read_frame(reader))[0] == 0x1
    line = await spend_line(caplog)  # never a pong: the heartbeat gives up on us
    writer.close()
    assert line["outcome"] == "cancelled:ping_timeout"
    access = [r.access for r in caplog.records if r.name == "nexus.access"]  # type: ignore[attr-defined]
    for _ in range(1000):
        if access:
            break
        await asyncio.sleep(0.01)
        access = [r.access for r in caplog.records if r.name == "nexus.access"]  # type: ignore[attr-defined]
    assert access[0]["outcome"] == "cancelled:ping_timeout"
