"""The read a background request's ``202`` paid for, across replicas on one Redis: the
``GET`` may land on another replica than the ``POST``, and of reads racing on both, one
is free (the store takes the prepaid read atomically). The key's rate is one request per
100 seconds (a bucket of one token, in Redis): every read that is not free is ``429``."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiohttp import ClientResponse
from aiohttp.test_utils import TestClient

from nexus.auth import hash_key
from nexus.cache.redis import RedisStore
from nexus.config import parse_config
from nexus.encoders.registry import default_registry
from nexus.server.app import create_app
from nexus.server.state import HUB
from redis_support import REDIS_URL
from support import chat

KEY = "nx-first-read-replicas-0123456789"
SECRET = "first-read-across-replicas-secret-0123456789"


async def replica(aiohttp_client: Any, prefix: str) -> TestClient[Any, Any]:
    config = parse_config(
        {
            "store": {"kind": "redis", "url": REDIS_URL, "prefix": prefix},
            "auth": {"keys": [{"name": "alpha", "sha256": hash_key(KEY)}]},
            "limits": {"requests_per_second_per_key": 0.01},
        }
    )
    return await aiohttp_client(create_app(config, registry=default_registry.copy()))


@pytest.fixture
async def replicas(
    aiohttp_client: Any, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> tuple[TestClient[Any, Any], TestClient[Any, Any]]:
    monkeypatch.setenv("NEXUS_TOKEN_SECRET", SECRET)  # the same on both: a token reads on either
    return await replica(aiohttp_client, prefix), await replica(aiohttp_client, prefix)


async def background(client: TestClient[Any, Any]) -> dict[str, Any]:
    resp = await client.post(
        "/v1/chat/completions",
        json=chat(background=True),
        headers={"Authorization": f"Bearer {KEY}"},
    )
    assert resp.status == 202, await resp.text()
    accepted: dict[str, Any] = await resp.json()
    return accepted


async def check(resp: ClientResponse, status: int) -> None:
    assert resp.status == status, await resp.text()
    if status == 200:
        assert (await resp.read()).endswith(b"data: [DONE]\n\n")
    else:
        assert (await resp.json())["error"]["code"] == "rate_limited"


async def test_the_first_read_on_another_replica_is_free_and_only_it(
    replicas: tuple[TestClient[Any, Any], TestClient[Any, Any]],
) -> None:
    one, two = replicas
    assert isinstance(one.app[HUB].store, RedisStore)
    accepted = await background(one)
    await check(await two.get(accepted["url"]), 200)
    await check(await one.get(accepted["url"]), 429)
    await check(await two.get(accepted["url"]), 429)


async def test_of_first_reads_racing_on_two_replicas_one_is_free(
    replicas: tuple[TestClient[Any, Any], TestClient[Any, Any]],
) -> None:
    one, two = replicas
    accepted = await background(one)
    url = accepted["url"]
    first, second = await asyncio.gather(one.get(url), two.get(url))
    assert sorted((first.status, second.status)) == [200, 429]
    for resp in (first, second):
        await check(resp, resp.status)
