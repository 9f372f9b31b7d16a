"""A stream given up as the store fails to claim it still ends, for the plugins told of its
start: each gets its one ``on_stream_failed``, as every stream's end is told."""

from __future__ import annotations

import asyncio
from typing import Any

from nexus import Engine
from nexus.cache.memory import MemoryStore
from nexus.cache.store import StreamInfo
from nexus.config import parse_config
from nexus.encoders.registry import default_registry
from nexus.errors import StoreUnavailable
from nexus.events import Error
from nexus.hooks import Hooks
from nexus.providers.mock import MockProvider
from nexus.server import create_app
from nexus.types import StreamMeta


class Unclaimable(MemoryStore):
    """A store whose claims fail (a Redis that went away as the request came)."""

    async def claim(self, key: str, stream_id: str, ttl_s: float) -> str | None:
        raise StoreUnavailable("down")


class Ledger:
    """Streams in flight: +1 on a start, -1 on an end."""

    def __init__(self) -> None:
        self.ends: list[str] = []
        self.running = 0

    async def on_stream_started(self, ctx: Any, request_id: str, model: str, provider: str) -> None:
        self.running += 1

    async def on_stream_completed(self, *args: Any) -> None:
        self.running -= 1
        self.ends.append("completed")

    async def on_stream_failed(self, ctx: Any, request_id: str, model: str, error: Error) -> None:
        self.running -= 1
        self.ends.append(error.code or "")


async def test_a_stream_the_store_cannot_claim_ends_for_its_plugins(aiohttp_client: Any) -> None:
    ledger = Ledger()
    hooks = Hooks()
    hooks.add(ledger)
    engine = Engine([MockProvider("mock")], hooks=hooks)
    config = parse_config({"cache": {"enabled": True}})
    app = create_app(config, engine=engine, registry=default_registry.copy(), store=Unclaimable())
    client = await aiohttp_client(app)
    body = {"model": "mock/echo", "messages": [{"role": "user", "content": "hi"}]}
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status == 503
    assert (await resp.json())["error"]["code"] == "store_unavailable"
    assert ledger.ends == ["store_unavailable"]
    assert ledger.running == 0  # it was 1: a start told, its end never


class JoinDown(MemoryStore):
    """A shared store whose claim is held by a stream of another replica, and which fails
    as a request joins it (Redis went away between the claim and the join's hold)."""

    shared = True

    async def claim(self, key: str, stream_id: str, ttl_s: float) -> str | None:
        return "chatcmpl-elsewhere"

    async def info(self, stream_id: str) -> StreamInfo | None:
        if stream_id != "chatcmpl-elsewhere":
            return await super().info(stream_id)
        return StreamInfo(StreamMeta(id=stream_id, model="mock/echo", created=1), "x")

    async def alive(self, stream_id: str) -> bool:
        return True

    async def hold_for_join(self, stream_id: str, hold_s: float) -> bool:
        raise StoreUnavailable("down")


async def test_a_join_the_store_fails_is_answered_without_it_when_not_required(
    aiohttp_client: Any,
) -> None:
    """``[store] required = false``: new requests still work while the store is down; a
    join whose hold failed was a 503 all the same."""
    config = parse_config(
        {"cache": {"enabled": True}, "store": {"kind": "redis", "required": False}}
    )
    app = create_app(config, registry=default_registry.copy(), store=JoinDown())
    client = await aiohttp_client(app)
    body = {"model": "mock/echo", "messages": [{"role": "user", "content": "hi"}]}
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status == 200
    assert resp.headers["X-Nexus-Store"] == "unavailable"
    assert (await resp.json())["choices"][0]["message"]["content"] == "hi"


class ClaimReplyLost(MemoryStore):
    """A shared store (Redis) that stalled as a claim went: the claim is taken (Redis runs
    what it was sent as it resumes), its reply lost; the next round trip fails too (the
    store's failing-fast second), then it answers again."""

    shared = True

    def __init__(self) -> None:
        super().__init__()
        self.failures = 2  # the claim's reply, then the first try to undo it

    async def claim(self, key: str, stream_id: str, ttl_s: float) -> str | None:
        await super().claim(key, stream_id, ttl_s)
        if self.failures:
            self.failures -= 1
            raise StoreUnavailable("down")
        return None

    async def release(self, key: str, stream_id: str) -> None:
        if self.failures:
            self.failures -= 1
            raise StoreUnavailable("down")
        await super().release(key, stream_id)


async def test_a_claim_the_store_took_as_its_reply_was_lost_is_undone(
    aiohttp_client: Any,
) -> None:
    """The claim stayed, naming a stream that never ran: identical requests joined it and
    waited, without a byte, for as long as its replica lived (up to resume_ttl_s)."""
    store = ClaimReplyLost()
    config = parse_config({"cache": {"enabled": True}, "store": {"kind": "redis"}})
    app = create_app(config, registry=default_registry.copy(), store=store)
    client = await aiohttp_client(app)
    body = {"model": "mock/echo", "messages": [{"role": "user", "content": "hi"}]}
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status == 503
    for _ in range(200):  # undone in the background, tried again as it fails
        if not store._claims:
            break
        await asyncio.sleep(0.02)
    assert store._claims == {}
    resp = await asyncio.wait_for(client.post("/v1/chat/completions", json=body), 5)
    assert resp.status == 200
    assert (await resp.json())["choices"][0]["message"]["content"] == "hi"


class Unrecordable(MemoryStore):
    """A shared store that refuses the recording's write (Redis out of memory, read-only)."""

    shared = True

    async def put_recording(self, *args: Any, **kwargs: Any) -> None:
        raise StoreUnavailable("down")


async def test_a_recording_the_store_refuses_is_no_traceback_and_its_claim_goes(
    aiohttp_client: Any, caplog: Any
) -> None:
    """A traceback per stream (the store warns of its own failures, a line per cause and
    10 s), and the claim was left."""
    store = Unrecordable()
    config = parse_config({"cache": {"enabled": True}, "store": {"kind": "redis"}})
    app = create_app(config, registry=default_registry.copy(), store=store)
    client = await aiohttp_client(app)
    body = {"model": "mock/echo", "messages": [{"role": "user", "content": "hi"}]}
    with caplog.at_level("ERROR", logger="nexus"):
        for _ in range(3):
            assert (await client.post("/v1/chat/completions", json=body)).status == 200
        for _ in range(200):
            if not store._claims:
                break
            await asyncio.sleep(0.02)
    assert store._claims == {}
    assert "Traceback" not in caplog.text and "recording stream" not in caplog.text
