"""A client that waits for each request to end is never refused for a stream still running.

With the Redis store, a key's place among its concurrent streams lives in Redis. Its
release was sent in the background once the keeper had written the finished log to
Redis, later than the client could read the stream's end: a client sending one request
after another at ``max_concurrent_streams_per_key = 1`` was refused ``too_many_streams``
most of the time, streaming or not, on every endpoint. The place must be gone by the time
the client can see the end.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import orjson
import pytest
import websockets

from nexus.auth import hash_key
from redis_support import REDIS_URL
from support import MakeClient, turn

KEY = "nx-sequential-0123456789-secret"
BEARER = {"Authorization": f"Bearer {KEY}"}
ROUNDS = 25


def config(prefix: str) -> dict[str, Any]:
    return {
        "store": {"kind": "redis", "url": REDIS_URL, "prefix": prefix},
        "limits": {"max_concurrent_streams_per_key": 1, "requests_per_second_per_key": 0},
        "auth": {"keys": [{"name": "alpha", "sha256": hash_key(KEY)}]},
    }


MESSAGES = [{"role": "user", "content": "one after another"}]
BODIES = {
    "/v1/chat/completions": {"model": "mock/echo", "messages": MESSAGES},
    "/v1/messages": {"model": "mock/echo", "max_tokens": 50, "messages": MESSAGES},
    "/v1/responses": {"model": "mock/echo", "input": "one after another"},
}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_requests_one_after_another_are_never_too_many(
    make_client: MakeClient, prefix: str, stream: bool
) -> None:
    client = await make_client(config(prefix))
    refused: Counter[str] = Counter()
    for path, body in BODIES.items():
        for _ in range(ROUNDS):
            resp = await client.post(path, json={**body, "stream": stream}, headers=BEARER)
            answer = await resp.read()  # to its end, as the client sees it
            if resp.status != 200:
                error = orjson.loads(answer)["error"]  # (Anthropic's shape has no code)
                refused[f"{path} {error.get('code') or error['message']}"] += 1
    assert not refused, f"refused, of {ROUNDS} each: {dict(refused)}"


async def test_realtime_turns_one_after_another_are_never_too_many(
    make_client: MakeClient, prefix: str
) -> None:
    client = await make_client(config(prefix))
    url = f"ws://{client.server.host}:{client.server.port}/v1/realtime"
    start = orjson.dumps({"type": "start", "request": {"model": "mock/echo", "messages": MESSAGES}})
    ends = []
    async with websockets.connect(url, subprotocols=["nexus.v1", f"nexus-key.{KEY}"]) as ws:  # type: ignore[list-item]
        for _ in range(ROUNDS):
            await ws.send(start.decode())
            ends.append((await turn(ws))[-1])
    errors = [end for end in ends if end["type"] != "done"]
    assert not errors, f"{len(errors)} of {ROUNDS} turns refused: {errors[0]}"
