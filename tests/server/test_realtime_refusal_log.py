"""A client retrying refused starts in a loop: one warning per refusal code per socket,
every refusal counted in the socket's access line (``refused``)."""

from __future__ import annotations

import asyncio
import logging
import time
from types import SimpleNamespace

import orjson
import pytest
import websockets

from nexus.auth import hash_key
from support import MakeClient, access_record, turn

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
        for _ in range(10):  # (fewer than max_invalid_frames: a refusal is a strike)
            await ws.send(start("nope/x"))
            assert (await turn(ws))[-1]["error"]["code"] == "model_not_found"
        await ws.send(start("mock/echo"))
        assert (await turn(ws))[-1]["type"] == "done"
    line = await access_record(caplog)
    warnings = [r for r in caplog.records if r.name == "nexus.realtime"]
    assert len(warnings) == 1
    assert "start refused: model_not_found" in warnings[0].getMessage()
    assert line.access["refused"] == 10  # type: ignore[attr-defined]
    assert "refused=10" in line.getMessage()


async def test_starts_the_session_refuses_are_counted_too(
    make_client: MakeClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    client = await make_client()
    url = f"ws://{client.server.host}:{client.server.port}/v1/realtime"
    invalid = orjson.dumps(
        {"type": "start", "request": {"model": "mock/echo", "messages": "x"}}
    ).decode()
    async with websockets.connect(url) as ws:
        for _ in range(2):
            await ws.send(invalid)
            assert (await turn(ws))[-1]["error"]["code"] == "invalid_request"
        await ws.send(start("mock/echo"))
        assert (await turn(ws))[-1]["type"] == "done"
    line = await access_record(caplog)
    assert line.access["refused"] == 2  # type: ignore[attr-defined]


async def one_token_only(
    make_client: MakeClient, monkeypatch: pytest.MonkeyPatch, *, max_invalid_frames: int
) -> tuple[str, dict[str, str]]:
    """A gateway whose one key's bucket never refills (a still clock): its one token (the
    handshake's, which the first start uses) never comes back. Its socket URL and headers."""
    monkeypatch.setattr(
        "nexus.cache.limits.time", SimpleNamespace(monotonic=lambda: 0.0, time=time.time)
    )
    key = "nx-refusal-strike-key-01"
    client = await make_client(
        {
            "auth": {"keys": [{"name": "a", "sha256": hash_key(key)}]},
            "limits": {"requests_per_second_per_key": 1},
            "realtime": {"max_invalid_frames": max_invalid_frames},
        }
    )
    url = f"ws://{client.server.host}:{client.server.port}/v1/realtime"
    return url, {"Authorization": f"Bearer {key}"}


async def test_rate_limited_starts_count_towards_max_invalid_frames(
    make_client: MakeClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every start after the first is rate_limited, and the fifth (the fourth sent before
    # the last refusal's retry_after_s) closes the socket.
    url, headers = await one_token_only(make_client, monkeypatch, max_invalid_frames=4)
    codes = []
    async with websockets.connect(url, additional_headers=headers) as ws:
        await ws.send(start("mock/echo"))
        assert (await turn(ws))[-1]["type"] == "done"
        for _ in range(50):
            await ws.send(start("mock/echo"))
        with pytest.raises(websockets.ConnectionClosed) as closed:
            while True:
                frame = orjson.loads(await asyncio.wait_for(ws.recv(), 10))
                assert frame["refused"] == "start"
                codes.append(frame["error"]["code"])
    assert codes == ["rate_limited"] * 5  # the first refusal is no strike: nothing was early
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008
    assert closed.value.rcvd.reason == "4 invalid frames in a row"


async def test_a_client_that_waits_as_told_is_never_closed_for_its_refused_starts(
    make_client: MakeClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every start after the first is rate_limited with retry_after_s 1. A client that waits
    # that long before each retry gets its refusal each time, however many (a polite client
    # waiting for a slot used to be closed 1008 after max_invalid_frames of them); the same
    # client retrying at once is closed.
    url, headers = await one_token_only(make_client, monkeypatch, max_invalid_frames=2)
    async with websockets.connect(url, additional_headers=headers) as ws:
        await ws.send(start("mock/echo"))  # the handshake's token
        assert (await turn(ws))[-1]["type"] == "done"
        for _ in range(3):
            await ws.send(start("mock/echo"))
            error = orjson.loads(await asyncio.wait_for(ws.recv(), 10))["error"]
            assert error["code"] == "rate_limited"
            await asyncio.sleep(error["retry_after_s"] + 0.05)
        for _ in range(3):  # now at once: the first waited, the two after it did not
            await ws.send(start("mock/echo"))
        with pytest.raises(websockets.ConnectionClosed) as closed:
            while True:
                await asyncio.wait_for(ws.recv(), 10)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008


async def test_a_client_that_waits_out_a_budget_held_by_running_streams_is_not_closed(
    make_client: MakeClient,
) -> None:
    # budget_exceeded is not retryable, yet while the key's running streams hold the rest
    # of its budget it comes with retry_after_s 1: a client waiting that long each time is
    # no flooder (it used to be closed after max_invalid_frames waits).
    key = "nx-budget-polite-key-0001"
    client = await make_client(
        {
            "auth": {
                "keys": [
                    {"name": "a", "sha256": hash_key(key), "budget_usd": 1.0},
                ]
            },
            "models": {"mock/echo": {"input_usd_per_mtok": 0, "output_usd_per_mtok": 600_000}},
            "realtime": {"max_invalid_frames": 2},
        }
    )
    headers = {"Authorization": f"Bearer {key}"}
    hold = {
        "model": "mock/echo",
        "stream": True,
        "max_tokens": 1,
        "messages": [{"role": "user", "content": "hold"}],
        "mock": {"content": "a b", "delay_ms": 30000},
    }
    holder = await client.post("/v1/chat/completions", json=hold, headers=headers)
    await holder.content.readline()  # running: $0.6 of the $1 held
    request = {"model": "mock/echo", "max_tokens": 1, "messages": USER}
    url = f"ws://{client.server.host}:{client.server.port}/v1/realtime"
    try:
        async with websockets.connect(url, additional_headers=headers) as ws:
            for _ in range(3):
                await ws.send(orjson.dumps({"type": "start", "request": request}).decode())
                error = orjson.loads(await asyncio.wait_for(ws.recv(), 10))["error"]
                assert (error["code"], error["retry_after_s"]) == ("budget_exceeded", 1)
                await asyncio.sleep(error["retry_after_s"] + 0.05)
            await ws.ping()  # still open
    finally:
        holder.close()
