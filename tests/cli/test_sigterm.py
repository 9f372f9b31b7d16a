"""SIGTERM on a real ``nexus serve`` process while streams run in several formats at once.

``tests/cli/test_cli.py`` already checks, one at a time, that a lone OpenAI SSE stream
ends with ``server_shutting_down`` and ``[DONE]``, that a lone WebSocket turn is
closed with 1001 and that the process exits 0. This file checks what happens to
all of them together, and what those tests do not look at: that the listener
closes at once (a new connection is refused; an idle keep-alive connection serves
no new stream), that running streams keep streaming through
``[server] shutdown_grace_s`` and are ended only when it is over, that a stream
which finishes within the grace period ends normally, the NDJSON terminator, a
background stream followed through ``GET /v1/streams/{id}`` (in the native SSE
format here), and that the process exits 0 within grace + a few seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import websockets

from nexus_process import start_nexus, stop_nexus

CURL = shutil.which("curl")
GRACE_S = 2.0

pytestmark = pytest.mark.skipif(CURL is None, reason="needs curl")


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    config = tmp_path / "config.toml"
    config.write_text(
        f"[server]\nshutdown_grace_s = {GRACE_S}\nheartbeat_interval_s = 15\n\n"
        '[providers.mock]\nkind = "mock"\n'
    )
    log = tmp_path / "nexus.log"
    proc, match = start_nexus(config, log)
    try:
        yield Server(proc, match.group(1), log)
    finally:
        stop_nexus(proc, gently=False)


def chat(words: int, **extra: Any) -> dict[str, Any]:
    """A streaming mock request: ``words`` words, one every 100 ms."""
    return {
        "model": "mock/echo",
        "stream": True,
        "messages": [{"role": "user", "content": "word " * words}],
        "mock": {"delay_ms": 100},
        **extra,
    }


@dataclass
class Curl:
    """``curl -sN`` in the background; its output lines with their arrival times."""

    proc: asyncio.subprocess.Process
    lines: list[tuple[float, bytes]] = field(default_factory=list)
    task: asyncio.Task[None] | None = None

    @classmethod
    async def start(cls, url: str, body: dict[str, Any] | None = None) -> Curl:
        assert CURL is not None
        args = [CURL, "-sN", url]
        if body is not None:
            args += ["-H", "Content-Type: application/json", "-d", orjson.dumps(body).decode()]
        proc = await asyncio.create_subprocess_exec(*args, stdout=asyncio.subprocess.PIPE)
        curl = cls(proc)
        curl.task = asyncio.create_task(curl._read())
        return curl

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        while line := await self.proc.stdout.readline():
            self.lines.append((time.monotonic(), line))
        await self.proc.wait()

    @property
    def body(self) -> bytes:
        return b"".join(line for _, line in self.lines)

    async def running(self) -> None:
        """Until the first content arrived."""
        async with asyncio.timeout(10):
            while not any(b"word" in line for _, line in self.lines):
                await asyncio.sleep(0.02)

    async def finish(self) -> int:
        assert self.task is not None
        async with asyncio.timeout(15):
            await self.task
        assert self.proc.returncode is not None
        return self.proc.returncode

    def content_times(self) -> list[float]:
        return [t for t, line in self.lines if b'"content":"' in line or b'"content": "' in line]

    def time_of(self, needle: bytes) -> float:
        return next(t for t, line in self.lines if needle in line)


@dataclass
class Turn:
    """A realtime WebSocket turn: its frames with their arrival times, and how it closed."""

    frames: list[tuple[float, dict[str, Any]]] = field(default_factory=list)
    close_code: int | None = None
    closed_at: float | None = None


async def realtime_turn(url: str, words: int, turn: Turn, started: asyncio.Event) -> None:
    async with websockets.connect(url.replace("http", "ws", 1) + "/v1/realtime") as ws:
        request = chat(words)
        del request["stream"]
        await ws.send(orjson.dumps({"type": "start", "request": request}).decode())
        try:
            while True:
                frame = orjson.loads(await ws.recv())
                turn.frames.append((time.monotonic(), frame))
                started.set()
        except websockets.ConnectionClosed:
            turn.closed_at = time.monotonic()
            turn.close_code = ws.close_code


async def new_stream_is_refused(url: str) -> str:
    """Try a new connection and a streaming request on it; how it was refused."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    try:
        reader, writer = await asyncio.open_connection(host, int(port))
    except ConnectionRefusedError:
        return "connection refused"
    try:
        return await _request_on(reader, writer)
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def _request_on(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> str:
    body = orjson.dumps(chat(3))
    try:
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body
        )
        await writer.drain()
        async with asyncio.timeout(5):
            answer = await reader.read()
    except ConnectionError:
        return "connection reset"
    if not answer:
        return "connection closed"
    status = answer.split(b"\r\n", 1)[0]
    assert status.startswith(b"HTTP/1.1 503"), answer[:500]
    assert b"server_shutting_down" in answer, answer[:500]
    return "503 server_shutting_down"


def sse_error(body: bytes) -> dict[str, Any]:
    frame = next(f for f in body.split(b"\n\n") if b"event: error\n" in f)
    return orjson.loads(frame.split(b"data: ", 1)[1])  # type: ignore[no-any-return]


async def test_sigterm_drains_every_format_then_ends_the_rest_and_exits_0(
    server: Server,
) -> None:
    url = server.url
    # An idle keep-alive connection, opened before the signal.
    host, port = url.removeprefix("http://").rsplit(":", 1)
    idle_reader, idle_writer = await asyncio.open_connection(host, int(port))
    idle_writer.write(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n")
    await idle_writer.drain()
    head = await idle_reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    length = int(re.search(rb"Content-Length: (\d+)", head, re.IGNORECASE)[1])  # type: ignore[index]
    await idle_reader.readexactly(length)

    # Streams of 200 words at 10 words/s (20 s): still running when the grace period ends.
    long_sse = await Curl.start(url + "/v1/chat/completions", chat(200))
    long_ndjson = await Curl.start(url + "/v1/chat/completions?stream_format=ndjson", chat(200))
    background = chat(200, background=True)
    async with (
        aiohttp.ClientSession() as http,
        http.post(url + "/v1/chat/completions", json=background) as r,
    ):
        assert r.status == 202
        stream_id = (await r.json())["id"]
    follower = await Curl.start(url + f"/v1/streams/{stream_id}?stream_format=nexus")
    turn = Turn()
    turn_started = asyncio.Event()
    socket_task = asyncio.create_task(realtime_turn(url, 200, turn, turn_started))
    for curl in (long_sse, long_ndjson, follower):
        await curl.running()
    async with asyncio.timeout(10):
        await turn_started.wait()
    # 12 words (1.2 s): ends by itself within the grace period.
    short_sse = await Curl.start(url + "/v1/chat/completions", chat(12))
    await short_sse.running()

    sigterm = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)

    # No new streams from now on: the listener closes at once, idle connections too.
    await asyncio.sleep(0.2)
    assert await new_stream_is_refused(url) == "connection refused"
    try:
        refused_idle = await _request_on(idle_reader, idle_writer)
    finally:
        idle_writer.close()
        with contextlib.suppress(ConnectionError):
            await idle_writer.wait_closed()
    assert refused_idle in ("connection closed", "connection reset", "503 server_shutting_down")

    codes = {
        name: await curl.finish()
        for name, curl in [
            ("short", short_sse),
            ("sse", long_sse),
            ("ndjson", long_ndjson),
            ("follower", follower),
        ]
    }
    async with asyncio.timeout(15):
        await socket_task
    exit_code = await asyncio.to_thread(server.proc.wait, 15)
    exited = time.monotonic()

    # Every client saw a complete, well-terminated body (curl: no transfer error).
    assert codes == {"short": 0, "sse": 0, "ndjson": 0, "follower": 0}
    assert exit_code == 0
    assert exited - sigterm <= GRACE_S + 3
    assert "stopped" in server.log.read_text()

    # The short stream finished normally within the grace period.
    short = short_sse.body
    assert b"event: error" not in short
    assert b'"finish_reason":"stop"' in short
    assert short.endswith(b"data: [DONE]\n\n")
    assert short.count(b"word") == 12
    assert short_sse.time_of(b"[DONE]") < sigterm + GRACE_S

    # The long ones kept streaming through the grace period, then were ended by it.
    for curl in (long_sse, long_ndjson, follower):
        during_grace = [t for t in curl.content_times() if sigterm + 0.5 < t < sigterm + GRACE_S]
        assert len(during_grace) >= 5, curl.body[-500:]
        assert curl.body.count(b"word") < 200
    for curl, marker in (
        (long_sse, b"event: error"),
        (long_ndjson, b'"type":"error"'),
        (follower, b"event: error"),
    ):
        ended = curl.time_of(marker)
        assert sigterm + GRACE_S - 0.2 <= ended <= sigterm + GRACE_S + 2

    # OpenAI SSE: the error frame (OpenAI's shape has no retryable flag), then [DONE].
    body = long_sse.body
    assert sse_error(body)["error"]["code"] == "server_shutting_down"
    assert body.endswith(b"data: [DONE]\n\n")

    # NDJSON: a retryable error line, then the done line, and nothing after it.
    lines = [orjson.loads(line) for _, line in long_ndjson.lines]
    assert lines[-2]["type"] == "error"
    assert lines[-2]["error"]["code"] == "server_shutting_down"
    assert lines[-2]["error"]["retryable"] is True
    assert lines[-1] == {"type": "done"}

    # The background stream's follower (native SSE): event: error, then event: done.
    frames = [f for f in follower.body.split(b"\n\n") if f.strip()]
    error = sse_error(follower.body)
    assert error["type"] == "error"
    assert error["error"]["code"] == "server_shutting_down"
    assert error["error"]["retryable"] is True
    assert b"event: done\n" in frames[-1]
    assert frames[-1].endswith(b'data: {"type":"done"}')

    # The WebSocket turn streamed through the grace period, then the socket closed 1001.
    assert turn.close_code == 1001
    assert turn.closed_at is not None
    assert sigterm + GRACE_S - 0.2 <= turn.closed_at <= sigterm + GRACE_S + 2
    deltas = [t for t, frame in turn.frames if frame["type"] == "delta"]
    assert len([t for t in deltas if sigterm + 0.5 < t < sigterm + GRACE_S]) >= 5
