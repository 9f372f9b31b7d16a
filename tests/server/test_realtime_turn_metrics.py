"""Each realtime turn counts in ``nexus_requests_total`` under its model and outcome, and
in the time-to-first-token and duration histograms, as an HTTP stream request does."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import websockets

from support import MakeClient, turn

USER = [{"role": "user", "content": "x"}]
SLOW = {"content": " ".join(["word"] * 200), "delay_ms": 50}  # ten seconds: aborted


def start(model: str = "mock/echo", **extra: Any) -> str:
    return orjson.dumps(
        {"type": "start", "request": {"model": model, "messages": USER, **extra}}
    ).decode()


def sample(page: str, name: str) -> float:
    for line in page.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_each_turn_is_counted_by_model_and_outcome(make_client: MakeClient) -> None:
    client = await make_client()
    url = f"ws://{client.server.host}:{client.server.port}/v1/realtime"
    async with websockets.connect(url) as ws:
        for _ in range(2):
            await ws.send(start())
            assert (await turn(ws))[-1] == {"type": "done"}
        await ws.send(start(mock=SLOW))
        assert orjson.loads(await ws.recv())["type"] == "delta"
        await ws.send('{"type":"abort"}')
        assert (await turn(ws))[-1] == {"type": "done", "aborted": True}
        await ws.send(start("nope/x"))
        assert (await turn(ws))[-1]["error"]["code"] == "model_not_found"
        page = ""
        name = 'nexus_requests_total{endpoint="/v1/realtime",model="mock/echo",outcome="%s"}'
        for _ in range(1000):  # the aborted turn is counted as its task ends
            page = await (await client.get("/metrics")).text()
            if sample(page, name % "cancelled:aborted"):
                break
            await asyncio.sleep(0.01)
    assert sample(page, name % "ok") == 2
    assert sample(page, name % "cancelled:aborted") == 1
    refused = 'nexus_requests_total{endpoint="/v1/realtime",model="unknown",outcome="%s"}'
    assert sample(page, refused % "error:model_not_found") == 1
    ttft = 'nexus_time_to_first_token_seconds_count{model="mock/echo"}'
    duration = 'nexus_stream_duration_seconds_count{model="mock/echo"}'
    assert sample(page, ttft) == 3 and sample(page, duration) == 3
