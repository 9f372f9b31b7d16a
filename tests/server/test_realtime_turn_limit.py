"""A turn that runs past ``[limits] max_stream_duration_s`` ends with its error frame,
and the socket stays open for the next turn (it was closed 1011 "provider error")."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import websockets

from support import MakeClient, turn

USER = [{"role": "user", "content": "again"}]
SLOW = {"content": " ".join(["word"] * 400), "delay_ms": 50}  # twenty seconds


def start(**extra: Any) -> str:
    request = {"model": "mock/echo", "messages": USER, **extra}
    return orjson.dumps({"type": "start", "request": request}).decode()


async def test_the_time_limit_ends_the_turn_not_the_socket(make_client: MakeClient) -> None:
    client = await make_client({"limits": {"max_stream_duration_s": 0.3}})
    url = f"ws://{client.server.host}:{client.server.port}/v1/realtime"
    async with websockets.connect(url) as ws:
        await ws.send(start(mock=SLOW))
        end = (await asyncio.wait_for(turn(ws), 30))[-1]
        assert end["type"] == "error" and end["error"]["code"] == "max_stream_duration"
        await ws.send(start())
        assert (await turn(ws))[-1] == {"type": "done"}
        assert ws.close_code is None
