"""Failures, cancellation and shutdown at the edges of a stream: each test is named for
what it keeps from breaking."""

from __future__ import annotations

import asyncio
import base64
import os
import struct
from collections.abc import AsyncGenerator
from typing import Any

import orjson
import websockets

from nexus import Provider
from nexus.events import StreamEvent
from nexus.request import ChatRequest
from nexus.server.state import RUNTIME
from support import GatedProvider, MakeClient, chat, parse_sse
from upstreams import FakeUpstream, Reply, openai_chunk


class BoomProvider(Provider):
    """Raises a non-gateway exception before its first event, after ``delay`` seconds."""

    kind = "boom"

    def __init__(self, name: str = "boom", delay: float = 0.0, exc: type[Exception] = RuntimeError):
        super().__init__(name)
        self.delay = delay
        self.exc = exc

    async def batches(
        self, request: ChatRequest, model: str
    ) -> AsyncGenerator[list[StreamEvent], None]:
        await asyncio.sleep(self.delay)
        raise self.exc("provider bug")
        yield []  # pragma: no cover - makes this an async generator


async def test_failure_after_headers_stays_in_band(make_client: MakeClient) -> None:
    """A non-gateway exception after a heartbeat went out used to append a whole 500 response."""
    client = await make_client(
        {"server": {"heartbeat_interval_s": 0.05}}, providers=[BoomProvider(delay=0.2)]
    )
    resp = await client.post("/v1/chat/completions", json=chat(model="boom/x", stream=True))
    assert resp.status == 200
    body = await resp.read()
    assert b"HTTP/1.1" not in body
    events = parse_sse(body)
    assert events[-2].event == "error"
    assert orjson.loads(events[-2].data)["error"]["code"] == "internal_error"
    assert events[-1].data == "[DONE]"


async def test_connection_error_from_provider_before_headers_is_a_500(
    make_client: MakeClient,
) -> None:
    """A provider's ConnectionError before output used to hit an assertion in the pump."""
    client = await make_client(providers=[BoomProvider(exc=ConnectionResetError)])
    resp = await client.post("/v1/chat/completions", json=chat(model="boom/x", stream=True))
    assert resp.status == 500
    assert (await resp.json())["error"]["code"] == "internal_error"


async def test_shutdown_ends_the_chunked_body_cleanly(make_client: MakeClient) -> None:
    """After the shutdown error frame the body used to stop without its last chunk."""
    gated = GatedProvider(before=1, after=1)
    client = await make_client({"streams": {"detach_timeout_s": 0}}, providers=[gated])
    resp = await client.post(
        "/v1/chat/completions?stream_format=ndjson", json=chat(model="gated/m", stream=True)
    )
    await asyncio.wait_for(resp.content.readline(), 5)
    for pump in list(client.app[RUNTIME].active):
        pump.shutdown()
    body = await asyncio.wait_for(resp.read(), 5)  # raises ClientPayloadError if unterminated
    lines = [orjson.loads(line) for line in body.splitlines()]
    assert lines[-2]["error"]["code"] == "server_shutting_down"
    assert lines[-2]["error"]["retryable"] is True
    assert lines[-1] == {"type": "done"}
    await asyncio.wait_for(gated.closed.wait(), 5)


# --- realtime -----------------------------------------------------------------------------


def _masked(payload: bytes) -> bytes:
    mask = os.urandom(4)
    body = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    if len(payload) < 126:
        header = bytes([0x81, 0x80 | len(payload)])
    else:
        header = bytes([0x81, 0x80 | 126]) + struct.pack("!H", len(payload))
    return header + mask + body


async def _read_frame(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    first, second = await reader.readexactly(2)
    length = second & 0x7F
    if length == 126:
        (length,) = struct.unpack("!H", await reader.readexactly(2))
    elif length == 127:
        (length,) = struct.unpack("!Q", await reader.readexactly(8))
    return first & 0x0F, await reader.readexactly(length)


def _start(**request: Any) -> bytes:
    body = {"model": "mock/echo", "messages": [{"role": "user", "content": "hi"}], **request}
    return orjson.dumps({"type": "start", "request": body})


async def test_start_and_abort_in_one_read_do_not_lock_the_connection(
    make_client: MakeClient,
) -> None:
    """An abort right behind its start, in one read, used to leave the session streaming
    (processed before the turn first ran). The loop now turns between the two frames, so
    the turn may send its first delta before the abort's answer."""
    gated = GatedProvider(before=1, after=1)
    client = await make_client(providers=[gated])
    reader, writer = await asyncio.open_connection(client.server.host, client.server.port)
    key = base64.b64encode(os.urandom(16)).decode()
    writer.write(
        (
            "GET /v1/realtime HTTP/1.1\r\nHost: localhost\r\n"
            "Upgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
        ).encode()
    )
    await reader.readuntil(b"\r\n\r\n")
    writer.write(_masked(_start(model="gated/m")) + _masked(b'{"type":"abort"}'))  # one write
    while True:
        opcode, payload = await asyncio.wait_for(_read_frame(reader), 5)
        frame = orjson.loads(payload)
        if frame["type"] != "delta":
            break
    assert (opcode, frame) == (1, {"type": "done", "aborted": True})
    writer.write(_masked(_start()))
    frames = []
    while not frames or frames[-1]["type"] not in ("done", "error"):
        _, payload = await asyncio.wait_for(_read_frame(reader), 5)
        frames.append(orjson.loads(payload))
    assert frames[-1] == {"type": "done"}
    writer.close()


async def test_unexpected_provider_exception_before_output_refuses_the_start(
    make_client: MakeClient,
) -> None:
    """A non-gateway exception used to end the turn silently: no frame, no close. Before
    any output it refuses the start, as HTTP answers a 500, and the socket goes on."""
    client = await make_client(providers=[BoomProvider()])
    url = f"ws://{client.server.host}:{client.server.port}/v1/realtime"
    async with websockets.connect(url) as ws:
        for _ in range(2):
            await ws.send(_start(model="boom/x").decode())
            error = orjson.loads(await asyncio.wait_for(ws.recv(), 5))
            assert (error["error"]["code"], error["refused"]) == ("internal_error", "start")
    assert ws.close_code == 1000


async def test_pending_input_survives_a_refused_start(make_client: MakeClient) -> None:
    """Pending audio and images used to be dropped when the engine refused the start."""
    client = await make_client()
    url = f"ws://{client.server.host}:{client.server.port}/v1/realtime"
    async with websockets.connect(url) as ws:
        png = base64.b64encode(b"12345678").decode()
        await ws.send(
            orjson.dumps({"type": "image", "mime_type": "image/png", "b64": png}).decode()
        )
        await ws.send(_start(model="nobody/x").decode())
        error = orjson.loads(await asyncio.wait_for(ws.recv(), 5))
        assert error["error"]["code"] == "model_not_found"
        await ws.send(_start().decode())
        text = ""
        while True:
            frame = orjson.loads(await asyncio.wait_for(ws.recv(), 5))
            if frame["type"] == "done":
                break
            text += frame.get("delta", {}).get("content", "") if frame["type"] == "delta" else ""
        assert text == "hi [image image/png 8 bytes]"


# --- the consumer API ---------------------------------------------------------------------


async def _slow_events() -> AsyncGenerator[StreamEvent, None]:
    from nexus.events import Delta

    yield Delta(content="one")
    await asyncio.sleep(30)
    yield Delta(content="never")  # pragma: no cover


def _stream() -> Any:
    from nexus import Stream, StreamMeta

    return Stream(_slow_events(), StreamMeta.new("m"))


async def test_channel_close_wakes_a_blocked_reader() -> None:
    """Channel.close() from another task used to leave the reader blocked for good."""
    from nexus import EndOfStream

    channel = _stream().channel(buffer=4)
    first = await channel.next()
    assert first.content == "one"
    reader = asyncio.create_task(channel.next())
    await asyncio.sleep(0.05)
    await channel.close()
    try:
        await asyncio.wait_for(reader, 1)
    except EndOfStream:
        pass
    else:  # pragma: no cover - the assertion below reports it
        raise AssertionError("the blocked reader got an event instead of the end")


async def test_stream_close_keeps_an_outside_cancellation() -> None:
    """close() used to withdraw a cancellation that came from somewhere else as well."""
    stream = _stream()
    await stream.next()

    async def read() -> str:
        await stream.next()
        return "read"

    reader = asyncio.create_task(read())
    await asyncio.sleep(0.05)
    reader.cancel()  # from outside
    await stream.close()  # and close() cancels the same read
    await asyncio.wait((reader,), timeout=1)
    assert reader.cancelled()


_SPIN_SCRIPT = """
import asyncio, time
from nexus import Stream, StreamMeta
from nexus.events import Delta

async def main():
    async def events():
        try:
            yield Delta(content="one")
            await asyncio.sleep(30)
        finally:
            await asyncio.sleep(0.3)  # slow async cleanup

    stream = Stream(events(), StreamMeta.new("m"))
    await stream.next()
    reader = asyncio.create_task(stream.next())
    await asyncio.sleep(0.05)
    cpu, wall = time.process_time(), time.monotonic()
    await stream.close()
    print(time.process_time() - cpu, time.monotonic() - wall)
    await asyncio.wait((reader,), timeout=1)

asyncio.run(main())
"""


def test_stream_close_does_not_spin_while_the_provider_cleans_up() -> None:
    """close() used to busy-wait at 100% CPU during the provider's cleanup.

    Run in its own interpreter: this path trips a CPython 3.11 bug in the ``ast``
    module's recursion bookkeeping, which would break pytest's later imports.
    """
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _SPIN_SCRIPT], capture_output=True, text=True, check=True
    ).stdout
    cpu, wall = map(float, out.split())
    assert wall >= 0.25  # close() waited for the cleanup...
    assert cpu < 0.15  # ...without burning the CPU meanwhile


async def test_a_json_answers_upstream_failure_after_output_is_a_502_as_before_it(
    make_client: MakeClient,
) -> None:
    """The same upstream error was a 502 before the first token and a 500 (with
    ``x-should-retry``, which docs reserve for the gateway's own failures) after it."""
    fail = b'data: {"error":{"message":"overloaded","type":"server_error"}}\n\n'
    first = openai_chunk(role="assistant", content="Hel")
    async with FakeUpstream(Reply.stream([fail]), Reply.stream([first, fail])) as fake:
        config = {"providers": {"up": {"kind": "openai", "base_url": fake.url + "/v1"}}}
        client = await make_client(config)
        statuses = []
        for _ in range(2):
            resp = await client.post(
                "/v1/chat/completions",
                json={"model": "up/m", "messages": [{"role": "user", "content": "hi"}]},
            )
            statuses.append((resp.status, (await resp.json())["error"]["message"]))
    assert [status for status, _ in statuses] == [502, 502]
    assert all("overloaded" in message for _, message in statuses)
