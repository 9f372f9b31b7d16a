"""A barge-in: ``abort`` a turn, read its aborted done, ``start`` again at once. The done
went out as soon as the turn stopped, before its stream had ended (its end hooks: the
budget's charge, a plugin), so a key allowed one stream at a time found its aborted turn
still running and was refused ``too_many_streams``."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import websockets

from nexus.auth import hash_key
from nexus.config import parse_config
from nexus.encoders.registry import default_registry
from nexus.engine import Engine
from nexus.hooks import Hooks
from nexus.providers.mock import MockProvider
from nexus.server.app import create_app
from support import turn

KEY = "nx-bargein-0123456789-secret"
MESSAGES = [{"role": "user", "content": "barge in"}]


class SlowEnd:
    """A plugin whose end hook takes a while (a database write, a webhook)."""

    async def on_stream_failed(self, *args: Any, **kwargs: Any) -> None:
        await asyncio.sleep(0.15)

    async def on_stream_completed(self, *args: Any, **kwargs: Any) -> None:
        await asyncio.sleep(0.15)


async def test_a_start_right_after_an_aborted_done_finds_the_key_free(
    aiohttp_client: Any,
) -> None:
    config = parse_config(
        {
            "limits": {"max_concurrent_streams_per_key": 1, "requests_per_second_per_key": 0},
            "auth": {"keys": [{"name": "alpha", "sha256": hash_key(KEY)}]},
        }
    )
    hooks = Hooks()
    hooks.add(SlowEnd())
    engine = Engine([MockProvider("mock")], hooks=hooks)
    client = await aiohttp_client(
        create_app(config, engine=engine, registry=default_registry.copy())
    )
    url = f"ws://{client.server.host}:{client.server.port}/v1/realtime"
    slow = {"model": "mock/echo", "messages": MESSAGES, "mock": {"delay_ms": 200}}
    fast = {"model": "mock/echo", "messages": MESSAGES}
    ends = []
    async with websockets.connect(url, subprotocols=["nexus.v1", f"nexus-key.{KEY}"]) as ws:  # type: ignore[list-item]
        for _ in range(3):
            await ws.send(orjson.dumps({"type": "start", "request": slow}).decode())
            assert orjson.loads(await asyncio.wait_for(ws.recv(), 5))["type"] == "delta"
            await ws.send('{"type":"abort"}')
            assert (await turn(ws))[-1] == {"type": "done", "aborted": True}
            await ws.send(orjson.dumps({"type": "start", "request": fast}).decode())
            ends.append((await turn(ws))[-1])
    assert ends == [{"type": "done"}] * 3
