"""One user action, one rate token: a background request's token also pays for the first
read of its stream by its key (a browser's ``EventSource`` on the ``202``'s ``url``, or the
key itself) within ``FIRST_READ_WINDOW_S``; every other read takes one, and the read's
place among the key's readers is taken as always.

Most tests run at a rate of one request per 100 seconds (a bucket of one token): the
``POST`` spends it, so every read that is not free is ``429`` however slowly the test runs.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiohttp import ClientResponse
from aiohttp.test_utils import TestClient

from nexus.auth import hash_key
from nexus.cache import MemoryStore
from nexus.config import parse_config
from nexus.encoders.registry import default_registry
from nexus.errors import StoreUnavailable
from nexus.server.app import create_app
from nexus.server.routes import stream_access
from support import GatedProvider, MakeClient, chat

A, B = "nx-first-read-a-0123456789", "nx-first-read-b-0123456789"
KEYS = {"keys": [{"name": "a", "sha256": hash_key(A)}, {"name": "b", "sha256": hash_key(B)}]}
CHAT = "/v1/chat/completions"
SLOW = 0.01
"""Requests per second: the bucket's one token comes back after 100 s."""


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def keyed(make_client: MakeClient, rate: float = SLOW, **tables: Any) -> TestClient[Any, Any]:
    limits = {"requests_per_second_per_key": rate} | tables.pop("limits", {})
    return await make_client({"auth": KEYS, "limits": limits, **tables})


async def background(client: TestClient[Any, Any], key: str = A, **extra: Any) -> dict[str, Any]:
    resp = await client.post(CHAT, json=chat(background=True, **extra), headers=bearer(key))
    assert resp.status == 202, await resp.text()
    accepted: dict[str, Any] = await resp.json()
    return accepted


async def read_whole(resp: ClientResponse) -> None:
    assert resp.status == 200, await resp.text()
    assert (await resp.read()).endswith(b"data: [DONE]\n\n")


async def rate_limited(resp: ClientResponse) -> None:
    assert resp.status == 429, await resp.text()
    assert (await resp.json())["error"]["code"] == "rate_limited"


async def test_at_one_request_a_second_a_browser_reads_its_background_stream_at_once(
    make_client: MakeClient,
) -> None:
    """The console's pattern: POST background, then EventSource(url) milliseconds later."""
    client = await keyed(make_client, rate=1)
    accepted = await background(client)
    await read_whole(await client.get(accepted["url"]))


async def test_only_the_first_read_is_free(make_client: MakeClient) -> None:
    client = await keyed(make_client)
    accepted = await background(client)
    await read_whole(await client.get(accepted["url"]))
    await rate_limited(await client.get(accepted["url"]))
    await rate_limited(await client.get(f"/v1/streams/{accepted['id']}", headers=bearer(A)))


async def test_the_first_read_with_the_key_is_free_too(make_client: MakeClient) -> None:
    client = await keyed(make_client)
    accepted = await background(client)
    await read_whole(await client.get(f"/v1/streams/{accepted['id']}", headers=bearer(A)))
    await rate_limited(await client.get(accepted["url"]))


async def test_of_two_concurrent_first_reads_exactly_one_is_free(make_client: MakeClient) -> None:
    client = await keyed(make_client)
    accepted = await background(client)
    url = accepted["url"]
    first, second = await asyncio.gather(client.get(url), client.get(url))
    assert sorted((first.status, second.status)) == [200, 429]
    for resp in (first, second):
        await (read_whole(resp) if resp.status == 200 else rate_limited(resp))


async def test_a_read_after_the_window_takes_a_token(
    make_client: MakeClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(stream_access, "FIRST_READ_WINDOW_S", 0.001)
    client = await keyed(make_client)
    accepted = await background(client)
    await asyncio.sleep(0.05)  # the window (1 ms) is over
    await rate_limited(await client.get(accepted["url"]))


async def test_a_stream_without_a_202_gets_no_free_read(make_client: MakeClient) -> None:
    """A streaming request is its own reader: a later read of its stream is another one."""
    client = await keyed(make_client)
    resp = await client.post(
        CHAT, json=chat(stream=True), headers=bearer(A) | {"X-Nexus-Resumable": "true"}
    )
    await read_whole(resp)
    stream_id = resp.headers["X-Nexus-Stream-Id"]
    await rate_limited(await client.get(f"/v1/streams/{stream_id}", headers=bearer(A)))


async def test_the_free_read_still_takes_a_reader_place(make_client: MakeClient) -> None:
    gated = GatedProvider(before=1, after=1)
    client = await make_client(
        {"auth": KEYS, "limits": {"requests_per_second_per_key": SLOW, "max_readers_per_key": 1}},
        providers=[gated],
    )
    accepted = await background(client, model="gated/m")
    try:
        holding = await client.get(accepted["url"])  # the free read, in a's one place
        assert holding.status == 200
        await asyncio.wait_for(holding.content.readuntil(b"\n\n"), 5)
        refused = await client.get(accepted["url"])
        assert refused.status == 429
        assert (await refused.json())["error"]["code"] == "too_many_readers"
    finally:
        gated.gate.set()
    await read_whole(holding)


async def test_a_join_of_another_keys_stream_pays_for_its_own_keys_read_only(
    make_client: MakeClient,
) -> None:
    gated = GatedProvider(before=1, after=1)
    client = await make_client(
        {
            "auth": KEYS,
            "limits": {"requests_per_second_per_key": SLOW},
            "cache": {"enabled": True, "share_across_keys": True},
        },
        providers=[gated],
    )
    body = chat(model="gated/m", stream=True)
    first = await client.post(CHAT, json=body, headers=bearer(A))
    await asyncio.wait_for(first.content.readuntil(b"\n\n"), 5)
    try:
        joined = await client.post(CHAT, json=body | {"background": True}, headers=bearer(B))
        assert joined.status == 202
        accepted = await joined.json()
        # B's 202 paid for one read of B's; A's token went on its own stream, A's read pays.
        await rate_limited(await client.get(f"/v1/streams/{accepted['id']}", headers=bearer(A)))
        follower = await client.get(accepted["url"])
        assert follower.status == 200
        await rate_limited(await client.get(accepted["url"]))
    finally:
        gated.gate.set()
    await read_whole(first)
    await read_whole(follower)


class Unreachable(MemoryStore):
    """A store that cannot be reached for prepaid reads."""

    async def prepay_read(self, stream_id: str, key: str, ttl_s: float) -> None:
        raise StoreUnavailable("down")


async def test_a_store_that_cannot_keep_the_prepaid_read_fails_no_202(
    aiohttp_client: Any,
) -> None:
    """The 202 is answered; its first read takes a token, as any other."""
    config = parse_config({"auth": KEYS, "limits": {"requests_per_second_per_key": SLOW}})
    app = create_app(config, registry=default_registry.copy(), store=Unreachable())
    client = await aiohttp_client(app)
    accepted = await background(client)
    await rate_limited(await client.get(accepted["url"]))
