"""Helpers shared by the tests: request bodies, hand-steered providers, SSE parsing, raw
WebSocket clients."""

from __future__ import annotations

import asyncio
import base64
import logging
import os
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

import orjson
import pytest
from aiohttp.test_utils import TestClient

from nexus import Encoder, Provider
from nexus.events import Delta, Error, StreamEvent, Usage
from nexus.protocol.sse import ServerSentEvent, SSEDecoder
from nexus.request import ChatRequest

MakeClient = Callable[..., Awaitable[TestClient[Any, Any]]]

METRICS_TOKEN_ENV = "NEXUS_TEST_METRICS_TOKEN"
METRICS_TOKEN = "scrape-me-0123456789"
SCRAPER = {"Authorization": f"Bearer {METRICS_TOKEN}"}
"""A scraper's headers, for a gateway with ``[metrics] token_env = METRICS_TOKEN_ENV``
and the ``metrics_token`` fixture: with keys, ``/metrics`` answers its token only."""


def chat(content: str = "Hello there world", **extra: Any) -> dict[str, Any]:
    """A chat-completions body for the mock provider."""
    body: dict[str, Any] = {
        "model": "mock/echo",
        "messages": [{"role": "user", "content": content}],
    }
    body.update(extra)
    return body


class GatedProvider(Provider):
    """Yields ``before`` deltas, then waits for ``gate`` before the rest; records its cleanup."""

    kind = "gated"

    def __init__(self, name: str = "gated", before: int = 1, after: int = 1) -> None:
        super().__init__(name)
        self.before = before
        self.after = after
        self.gate = asyncio.Event()
        self.started = asyncio.Event()
        self.closed = asyncio.Event()
        self.closed_at: float | None = None

    async def batches(
        self, request: ChatRequest, model: str
    ) -> AsyncGenerator[list[StreamEvent], None]:
        self.started.set()
        try:
            for i in range(self.before):
                yield [Delta(content=f"before{i} ")]
            await self.gate.wait()
            for i in range(self.after):
                yield [Delta(content=f"after{i} ")]
            yield [Delta(finish_reason="stop")]
            yield [Usage(prompt_tokens=1, completion_tokens=2, total_tokens=3)]
        finally:
            self.closed_at = asyncio.get_running_loop().time()
            self.closed.set()


class EndlessProvider(Provider):
    """Yields big deltas until closed; records when it was closed."""

    kind = "endless"

    def __init__(self, name: str = "endless", size: int = 65536) -> None:
        super().__init__(name)
        self.size = size
        self.produced = 0
        self.closed = asyncio.Event()

    async def batches(
        self, request: ChatRequest, model: str
    ) -> AsyncGenerator[list[StreamEvent], None]:
        try:
            while True:
                self.produced += 1
                yield [Delta(content="x" * self.size)]
                await asyncio.sleep(0)
        finally:
            self.closed.set()


def parse_sse(body: bytes) -> list[ServerSentEvent]:
    """Every event of a complete SSE body (WHATWG rules)."""
    decoder = SSEDecoder()
    events = decoder.decode(body)
    decoder.flush()
    return events


class PlainTextEncoder(Encoder):
    """A custom format for the registry tests: content as plain text."""

    media_type = "text/plain"
    aliases = ("plain",)

    def encode(self, event: StreamEvent) -> bytes:
        if isinstance(event, Delta) and event.content:
            return event.content.encode()
        return b""

    def error(self, event: Error) -> bytes:
        return b"\n[error " + (event.code or "").encode() + b"]"

    def heartbeat(self) -> bytes:
        return b""

    def end(self) -> bytes:
        return b"\n"


async def turn(ws: Any) -> list[dict[str, Any]]:
    """A realtime WebSocket's frames until (and including) the turn's done or error."""
    frames = []
    while True:
        frame = orjson.loads(await asyncio.wait_for(ws.recv(), 5))
        frames.append(frame)
        if frame["type"] in ("done", "error"):
            return frames


# --- raw WebSocket clients: peers that misbehave in ways a client library will not ---


def masked(opcode: int, payload: bytes) -> bytes:
    """One client frame (FIN set, masked), as a raw socket sends it."""
    mask = os.urandom(4)
    size = len(payload)
    if size < 126:
        head = bytes([0x80 | opcode, 0x80 | size])
    else:
        head = bytes([0x80 | opcode, 0x80 | 126]) + size.to_bytes(2, "big")
    return head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


async def raw_socket(client: Any) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection(client.server.host, client.server.port)
    key = base64.b64encode(os.urandom(16)).decode()
    writer.write(
        (
            "GET /v1/realtime HTTP/1.1\r\nHost: localhost\r\n"
            "Upgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
        ).encode()
    )
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 101")
    return reader, writer


async def read_frame(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """One server frame: its opcode and payload."""
    head = await asyncio.wait_for(reader.readexactly(2), 10)
    size = head[1] & 0x7F
    if size >= 126:
        size = int.from_bytes(await reader.readexactly(2 if size == 126 else 8), "big")
    return head[0] & 0x0F, await reader.readexactly(size)


async def access_record(caplog: pytest.LogCaptureFixture) -> logging.LogRecord:
    """The first access line, once a handler that ends on its own has written it (polled,
    10 s at most): a WebSocket's comes when its socket's handler returns."""
    for _ in range(1000):
        for record in caplog.records:
            if record.name == "nexus.access":
                return record
        await asyncio.sleep(0.01)
    raise AssertionError("no access line")
