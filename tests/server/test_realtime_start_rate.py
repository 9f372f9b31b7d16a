"""Every realtime ``start`` takes a token of its key's rate before it is walked or
validated, as an HTTP request takes it before its body is read: a start that fails
validation, or comes while a turn runs, costs a token too; other envelopes do not. The
first ``start`` of a socket uses the token its handshake took."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import orjson
import pytest
import websockets

from nexus.auth import hash_key
from support import GatedProvider, MakeClient, turn

KEY = "nx-start-rate-key-0001"
# Three tokens (a second's worth): the handshake's (the first start's too) and two more;
# none come back while the clock the limits read stands still.
CONFIG = {
    "auth": {"keys": [{"name": "a", "sha256": hash_key(KEY)}]},
    "limits": {"requests_per_second_per_key": 3},
}


@pytest.fixture(autouse=True)
def still_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        "nexus.cache.limits.time", SimpleNamespace(monotonic=lambda: 0.0, time=time.time)
    )


async def connect(client: Any) -> Any:
    url = f"ws://{client.server.host}:{client.server.port}/v1/realtime"
    headers = {"Authorization": f"Bearer {KEY}"}
    return await websockets.connect(url, additional_headers=headers, max_size=None)


def start(model: str = "mock/echo", **extra: Any) -> str:
    request = {"model": model, "messages": [{"role": "user", "content": "x" * 100_000}]}
    return orjson.dumps({"type": "start", "request": {**request, **extra}}).decode()


async def error_code(ws: Any) -> str:
    frames = await turn(ws)
    assert frames[-1]["type"] == "error", frames
    return str(frames[-1]["error"]["code"])


async def test_a_start_that_fails_validation_takes_a_rate_token(make_client: MakeClient) -> None:
    client = await make_client(CONFIG)
    async with await connect(client) as ws:
        for _ in range(3):  # the first on the handshake's token
            await ws.send(start(temperature="hot"))
            assert await error_code(ws) == "invalid_request"
        for _ in range(3):  # the key's tokens are spent: not validated again
            await ws.send(start(temperature="hot"))
            assert await error_code(ws) == "rate_limited"


async def test_a_start_while_a_turn_runs_takes_a_token_and_other_envelopes_none(
    make_client: MakeClient,
) -> None:
    gated = GatedProvider(before=1, after=1)
    client = await make_client(CONFIG, providers=[gated])
    async with await connect(client) as ws:
        for _ in range(5):  # other envelopes take no token
            await ws.send('{"type":"abort"}')
            assert orjson.loads(await ws.recv())["error"]["code"] == "nothing_to_abort"
        await ws.send(start("gated/m"))
        assert orjson.loads(await ws.recv())["type"] == "delta"  # the handshake's token
        for _ in range(2):  # the last two tokens
            await ws.send(start("gated/m"))
            assert orjson.loads(await ws.recv())["error"]["code"] == "stream_in_progress"
        await ws.send(start("gated/m"))
        assert orjson.loads(await ws.recv())["error"]["code"] == "rate_limited"
        gated.gate.set()
        assert (await turn(ws))[-1]["type"] == "done"


async def test_a_key_allowed_one_request_a_second_may_open_a_socket_and_start(
    make_client: MakeClient,
) -> None:
    # As web/app.js does: the start at once on open, on the handshake's token.
    one = {**CONFIG, "limits": {"requests_per_second_per_key": 1}}
    client = await make_client(one)
    async with await connect(client) as ws:
        await ws.send(start())
        assert (await turn(ws))[-1] == {"type": "done"}
        await ws.send(start())  # the second start takes a token of its own: none is left
        assert await error_code(ws) == "rate_limited"
