"""A realtime socket's byte budget lets a quiet client send at once all the input it may
hold pending (a few images back to back), and counts a frame's bytes, not its characters."""

from __future__ import annotations

import asyncio
import base64
import os

import orjson
import pytest
import websockets

from support import MakeClient, turn


def url_of(client: object) -> str:
    server = client.server  # type: ignore[attr-defined]
    return f"ws://{server.host}:{server.port}/v1/realtime"


async def test_images_up_to_the_pending_limit_may_be_sent_back_to_back(
    make_client: MakeClient,
) -> None:
    # Each image is close to max_message_bytes and four of them far over a second's
    # worth of bytes; all four fit max_pending_input_bytes, so they fit the budget too.
    client = await make_client(
        {
            "realtime": {
                "max_bytes_per_second": 1000,
                "max_message_bytes": 4000,
                "max_pending_input_bytes": 30_000,
            }
        }
    )
    image = base64.b64encode(os.urandom(2900)).decode()
    envelope = orjson.dumps({"type": "image", "mime_type": "image/png", "b64": image}).decode()
    assert 3800 < len(envelope) < 4000
    async with websockets.connect(url_of(client), max_size=None) as ws:
        for _ in range(4):
            await ws.send(envelope)
        request = {"model": "mock/echo", "messages": [{"role": "user", "content": "compare"}]}
        await ws.send(orjson.dumps({"type": "start", "request": request}).decode())
        frames = await turn(ws)
    assert frames[-1] == {"type": "done"}


async def test_the_byte_budget_counts_utf8_bytes_not_characters(make_client: MakeClient) -> None:
    # Three frames of 300 emoji: 900 characters, 3600 bytes; the burst (2000 bytes) is
    # passed by the bytes, never by the characters (and 100 bytes a second refill little).
    client = await make_client(
        {
            "realtime": {
                "max_bytes_per_second": 100,
                "max_message_bytes": 2000,
                "max_pending_input_bytes": 2000,
            }
        }
    )
    frame = orjson.dumps({"type": "abort", "x": "\U0001f600" * 300}).decode()
    assert len(frame) < 400 and len(frame.encode()) > 1200
    async with websockets.connect(url_of(client), max_size=None) as ws:
        for _ in range(3):
            await ws.send(frame)
        with pytest.raises(websockets.ConnectionClosed) as closed:
            while True:
                await asyncio.wait_for(ws.recv(), 5)
    assert closed.value.rcvd is not None
    assert closed.value.rcvd.code == 1008
    assert closed.value.rcvd.reason == "over 100 bytes per second"
