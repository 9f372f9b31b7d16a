"""A key offered as ``nexus-key.<key>`` never comes back in ``Sec-WebSocket-Protocol``."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
import websockets
from websockets.exceptions import InvalidStatus

from nexus.auth import hash_key
from support import MakeClient

KEY = "nx-subprotocol-key-0001"
CONFIG = {"auth": {"keys": [{"name": "a", "sha256": hash_key(KEY)}]}}


def url(client: Any) -> str:
    return f"ws://{client.server.host}:{client.server.port}/v1/realtime"


async def test_only_the_key_subprotocol_is_refused_400_without_echoing_it(
    make_client: MakeClient,
) -> None:
    client = await make_client(CONFIG)
    offered: Any = [f"nexus-key.{KEY}"]
    with pytest.raises(InvalidStatus) as refused:
        await websockets.connect(url(client), subprotocols=offered)
    response = refused.value.response
    assert response.status_code == 400
    assert "Sec-WebSocket-Protocol" not in response.headers
    assert KEY not in str(response.headers) and KEY.encode() not in (response.body or b"")
    error = orjson.loads(response.body or b"{}")["error"]
    assert (error["code"], error["param"]) == ("invalid_request", "Sec-WebSocket-Protocol")


async def test_nexus_v1_beside_the_key_is_the_one_answered(make_client: MakeClient) -> None:
    client = await make_client(CONFIG)
    offered: Any = [f"nexus-key.{KEY}", "nexus.v1"]
    async with websockets.connect(url(client), subprotocols=offered) as ws:
        assert ws.subprotocol == "nexus.v1"
        assert ws.response is not None
        assert ws.response.headers["Sec-WebSocket-Protocol"] == "nexus.v1"
