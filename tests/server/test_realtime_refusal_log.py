"""A client retrying refused starts in a loop: one warning per refusal code per socket,
every refusal counted in the socket's access line (``refused``)."""

from __future__ import annotations

import asyncio
import logging

import orjson
import pytest
import websockets

from support import MakeClient, turn

USER = [{"role": "user", "content": "x"}]


def start(model: str) -> str:
    return orjson.dumps({"type": "start", "request": {"model": model, "messages": USER}}).decode()


async def test_refused_starts_are_logged_once_per_code_and_counted(
    make_client: MakeClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    client = await make_client()
    url = f"ws://{client.server.host}:{client.server.port}/v1/realtime"
    async with websockets.connect(url) as ws:
        for _ in range(40):
            await ws.send(start("nope/x"))
            assert (await turn(ws))[-1]["error"]["code"] == "model_not_found"
        await ws.send(start("mock/echo"))
        assert (await turn(ws))[-1]["type"] == "done"
    for _ in range(1000):
        lines = [r for r in caplog.records if r.name == "nexus.access"]
        if lines:
            break
        await asyncio.sleep(0.01)
    warnings = [r for r in caplog.records if r.name == "nexus.realtime"]
    assert len(warnings) == 1
    assert "start refused: model_not_found" in warnings[0].getMessage()
    assert lines[0].access["refused"] == 40  # type: ignore[attr-defined]
    assert "refused=40" in lines[0].getMessage()
