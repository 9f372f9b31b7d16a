"""An encoder that raises (someone else's code, in every response of its format): the
stream ends in-band once, logged once, and its plugins hear the outcome the access
line tells."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from nexus import Engine, Hooks, MockProvider, Provider
from nexus.config import parse_config
from nexus.encoders.registry import default_registry
from nexus.events import Delta, Error, StreamEvent
from nexus.request import ChatRequest
from nexus.server.app import create_app
from support import GatedProvider, PlainTextEncoder

BODY = {"model": "gated/m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}


class BadHeartbeat(PlainTextEncoder):
    media_type = "text/x-bad-heartbeat"
    aliases = ("badbeat",)

    def heartbeat(self) -> bytes:
        raise RuntimeError("heartbeat bug")


class BadEncode(PlainTextEncoder):
    """Fails on the content ``bad``."""

    media_type = "text/x-bad-encode"
    aliases = ("badencode",)

    def encode(self, event: StreamEvent) -> bytes:
        if isinstance(event, Delta) and event.content == "bad":
            raise RuntimeError("encode bug")
        return super().encode(event)


class BadStart(PlainTextEncoder):
    media_type = "text/x-bad-start"
    aliases = ("badstart",)

    def start(self) -> bytes:
        raise RuntimeError("start bug")


class Steps(Provider):
    """``ok ``, then at ``gate`` ``bad``, then nothing more until it is closed."""

    kind = "steps"

    def __init__(self) -> None:
        super().__init__("steps")
        self.gate = asyncio.Event()
        self.closed = asyncio.Event()

    async def batches(
        self, request: ChatRequest, model: str
    ) -> AsyncGenerator[list[StreamEvent], None]:
        try:
            yield [Delta(content="ok ")]
            await self.gate.wait()
            yield [Delta(content="bad")]
            await asyncio.Event().wait()
        finally:
            self.closed.set()


class Failures:
    def __init__(self) -> None:
        self.codes: list[str | None] = []
        self.ended = asyncio.Event()

    async def on_stream_failed(self, ctx: Any, request_id: str, model: str, error: Error) -> None:
        self.codes.append(error.code)
        self.ended.set()

    async def on_stream_completed(self, *args: Any) -> None:
        self.codes.append("completed")
        self.ended.set()


async def client_for(
    aiohttp_client: Any, gated: Provider, plugin: Failures
) -> TestClient[Any, Any]:
    cfg = parse_config({"server": {"heartbeat_interval_s": 0.05}, "metrics": {"enabled": False}})
    hooks = Hooks()
    hooks.add(plugin)
    engine = Engine([MockProvider("mock"), gated], hooks=hooks)
    registry = default_registry.copy()
    registry.register(BadHeartbeat.media_type, BadHeartbeat)
    registry.register(BadEncode.media_type, BadEncode)
    registry.register(BadStart.media_type, BadStart)
    client: TestClient[Any, Any] = await aiohttp_client(
        create_app(cfg, engine=engine, registry=registry)
    )
    return client


async def outcome_logged(caplog: pytest.LogCaptureFixture, stream_id: str) -> str:
    """The access line's outcome for ``stream_id`` (written once the handler returned)."""
    for _ in range(500):
        for record in caplog.records:
            message = record.getMessage()
            if record.name == "nexus.access" and f"stream_id={stream_id}" in message:
                return message.split("outcome=")[1].split()[0]
        await asyncio.sleep(0.01)
    raise AssertionError("no access line")


async def test_a_raising_heartbeat_ends_the_stream_in_band_logged_once(
    aiohttp_client: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The heartbeat task raised at every watchdog tick: a traceback each time, never
    retrieved, no keepalive, no end for the client."""
    caplog.set_level(logging.INFO)
    gated, plugin = GatedProvider(before=1), Failures()
    client = await client_for(aiohttp_client, gated, plugin)
    resp = await client.post("/v1/chat/completions?stream_format=badbeat", json=BODY)
    body = await asyncio.wait_for(resp.read(), 10)
    assert body == b"before0 \n[error internal_error]\n"
    await asyncio.wait_for(plugin.ended.wait(), 10)
    assert plugin.codes == ["internal_error"]
    stream_id = resp.headers["X-Nexus-Stream-Id"]
    assert await outcome_logged(caplog, stream_id) == "mid_stream_error:internal_error"
    failures = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert [r.getMessage() for r in failures] == [f"the heartbeat of stream {stream_id} failed"]
    await gated.closed.wait()  # the upstream stopped


async def test_plugins_hear_an_encoders_failure_as_the_access_line_tells_it(
    aiohttp_client: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The stream its only client's encoder failed was cancelled as that client's leaving:
    its plugins heard ``client_disconnect``, the access line ``internal_error``."""
    caplog.set_level(logging.INFO)
    steps, plugin = Steps(), Failures()
    client = await client_for(aiohttp_client, steps, plugin)
    body = {**BODY, "model": "steps/m"}
    resp = await client.post("/v1/chat/completions?stream_format=badencode", json=body)
    assert await asyncio.wait_for(resp.content.readany(), 10) == b"ok "
    steps.gate.set()
    assert await asyncio.wait_for(resp.read(), 10) == b"\n[error internal_error]\n"
    await steps.closed.wait()
    await asyncio.wait_for(plugin.ended.wait(), 10)
    assert plugin.codes == ["internal_error"]
    outcome = await outcome_logged(caplog, resp.headers["X-Nexus-Stream-Id"])
    assert outcome == "mid_stream_error:internal_error"


async def test_plugins_hear_an_encoders_failure_before_the_headers_as_the_500_tells_it(
    aiohttp_client: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    steps, plugin = Steps(), Failures()
    client = await client_for(aiohttp_client, steps, plugin)
    body = {**BODY, "model": "steps/m"}
    resp = await client.post("/v1/chat/completions?stream_format=badstart", json=body)
    assert resp.status == 500
    assert (await resp.json())["error"]["code"] == "internal_error"
    await asyncio.wait_for(plugin.ended.wait(), 10)
    assert plugin.codes == ["internal_error"]
