"""A realtime client gone as the gateway answers it (its connection reset) has left, as
one closing does: no 500, no ERROR traceback, ``cancelled:client_disconnect``."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import orjson
import pytest
import websockets

from nexus.protocol.realtime import RealtimeSession
from nexus.server.state import RUNTIME
from support import MakeClient, access_record

USER = [{"role": "user", "content": "x"}]
START_UNKNOWN = orjson.dumps({"type": "start", "request": {"model": "nope/x", "messages": USER}})


@pytest.mark.parametrize(
    ("method", "frame"),
    [
        ("receive_binary", b"\x00"),  # answered with an invalid_envelope frame
        ("start_refused", START_UNKNOWN.decode()),  # answered with a refusal (model_not_found)
    ],
)
async def test_a_client_reset_before_its_answer_is_a_disconnect_not_a_500(
    make_client: MakeClient,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    method: str,
    frame: Any,
) -> None:
    caplog.set_level(logging.INFO)
    client = await make_client()
    sockets = client.app[RUNTIME].sockets
    original = getattr(RealtimeSession, method)

    def reset_first(session: RealtimeSession, *args: Any) -> Any:
        # The connection goes between the frame and its answer, as a reset client's does.
        for conn in sockets:
            conn.request.transport.abort()  # type: ignore[attr-defined]
        return original(session, *args)

    monkeypatch.setattr(RealtimeSession, method, reset_first)
    url = f"ws://{client.server.host}:{client.server.port}/v1/realtime"
    ws = await websockets.connect(url)
    await ws.send(frame)
    with pytest.raises(websockets.ConnectionClosed):
        await asyncio.wait_for(ws.recv(), 10)
    access = (await access_record(caplog)).access  # type: ignore[attr-defined]
    assert access["status"] == 101
    assert access["outcome"] == "cancelled:client_disconnect"
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []
    metrics = await (await client.get("/metrics")).text()
    assert "internal_error" not in metrics
