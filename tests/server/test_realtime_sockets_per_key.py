"""One key cannot hold every socket: ``[realtime] max_sockets_per_key`` refuses its next
handshake with 429 ``too_many_sockets``, and each handshake takes a token of its rate."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest
import websockets
from websockets.exceptions import InvalidStatus

from nexus.auth import hash_key
from nexus.cache.limits import LocalLimits
from nexus.server.state import HUB
from support import MakeClient

A, B = "nx-sockets-key-a-0001", "nx-sockets-key-b-0001"
KEYS = {"keys": [{"name": "a", "sha256": hash_key(A)}, {"name": "b", "sha256": hash_key(B)}]}


def url(client: Any) -> str:
    return f"ws://{client.server.host}:{client.server.port}/v1/realtime"


def connect(client: Any, key: str) -> Any:
    return websockets.connect(url(client), additional_headers={"Authorization": f"Bearer {key}"})


async def refused(client: Any, key: str) -> tuple[int, dict[str, Any]]:
    with pytest.raises(InvalidStatus) as caught:
        await connect(client, key)
    response = caught.value.response
    return response.status_code, orjson.loads(response.body or b"{}")["error"]


async def test_a_key_at_its_socket_limit_is_refused_and_others_are_not(
    make_client: MakeClient,
) -> None:
    client = await make_client({"auth": KEYS, "realtime": {"max_sockets_per_key": 2}})
    first, second = await connect(client, A), await connect(client, A)
    status, error = await refused(client, A)
    assert status == 429
    assert error["code"] == "too_many_sockets"
    assert "max_sockets_per_key" in error["message"]
    other = await connect(client, B)  # another key is not held back
    await other.close()
    await first.close()
    limits = client.app[HUB].limits
    assert isinstance(limits, LocalLimits)  # (the memory store's)
    for _ in range(1000):  # the server lets the place go once its handler ends
        if limits.held("sockets", "a") < 2:
            break
        await asyncio.sleep(0.01)
    again = await connect(client, A)
    await again.close()
    await second.close()


async def test_a_handshake_takes_a_token_of_the_keys_rate(make_client: MakeClient) -> None:
    # One token, the next in 1000 s.
    client = await make_client({"auth": KEYS, "limits": {"requests_per_second_per_key": 0.001}})
    ws = await connect(client, A)
    status, error = await refused(client, A)
    assert (status, error["code"]) == (429, "rate_limited")
    await ws.close()
