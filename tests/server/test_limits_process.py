"""Limits with no way around them, on a real ``nexus serve`` process with API keys.

* Every WebSocket ``start`` takes a token of the key's rate, as an HTTP request does:
  twenty starts on one socket under a limit of 2/s are mostly refused with a
  ``rate_limited`` frame (``retry_after_s``), and the socket stays usable.
* Non-streaming requests hold a place among the streams running
  (``max_concurrent_streams``, ``max_concurrent_streams_per_key``) while they run,
  with the cache off (no run of their own) and on (their run), never twice, and
  give it back when they end, the client gone included.
* A realtime client that never reads but pings every half second is dropped after
  ``[server] write_timeout_s``; its turn is cancelled, counted as ``write_timeout``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import re
import socket
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import websockets

from nexus.auth import hash_key
from nexus_process import start_nexus, stop_nexus
from support import METRICS_TOKEN_ENV, SCRAPER

_SERVING = re.compile(r"Nexus serving on http://([\d.]+):(\d+)")

KEY_A = "nx-alpha-0123456789-secret"
KEY_B = "nx-beta-9876543210-secret"
WRITE_TIMEOUT_S = 1.0

pytestmark = pytest.mark.usefixtures("metrics_token")


def config(
    *,
    rate: float = 0,
    streams: int = 100,
    per_key: int = 100,
    cache: bool = False,
    heartbeat_s: float = 15,
) -> str:
    return f"""\
[server]
write_timeout_s = {WRITE_TIMEOUT_S}
heartbeat_interval_s = {heartbeat_s}
shutdown_grace_s = 0

[limits]
requests_per_second_per_key = {rate}
max_concurrent_streams = {streams}
max_concurrent_streams_per_key = {per_key}

[cache]
enabled = {"true" if cache else "false"}

[streams]
detach_timeout_s = 30

[metrics]
token_env = "{METRICS_TOKEN_ENV}"

[[auth.keys]]
name = "alpha"
sha256 = "{hash_key(KEY_A)}"

[[auth.keys]]
name = "beta"
sha256 = "{hash_key(KEY_B)}"

[providers.mock]
kind = "mock"
"""


@dataclass
class Server:
    host: str
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def health(self) -> dict[str, Any]:
        async with aiohttp.ClientSession() as http, http.get(self.url + "/healthz") as resp:
            return await resp.json()  # type: ignore[no-any-return]

    async def metrics(self) -> str:
        async with (
            aiohttp.ClientSession() as http,
            http.get(self.url + "/metrics", headers=SCRAPER) as resp,
        ):
            return await resp.text()


@contextlib.contextmanager
def serve(tmp_path: Path, text: str) -> Iterator[Server]:
    path = tmp_path / "config.toml"
    path.write_text(text)
    log = tmp_path / "nexus.log"
    proc, match = start_nexus(path, log, ready=_SERVING)
    try:
        yield Server(match.group(1), int(match.group(2)), log)
    finally:
        stop_nexus(proc)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def start_frame(text: str = "hello there", mock: dict[str, Any] | None = None) -> str:
    request: dict[str, Any] = {
        "model": "mock/echo",
        "messages": [{"role": "user", "content": text}],
    }
    if mock is not None:
        request["mock"] = mock
    return orjson.dumps({"type": "start", "request": request}).decode()


async def turn_end(ws: Any) -> dict[str, Any]:
    """The frame that ends a turn (done), or refuses it (error)."""
    while True:
        frame: dict[str, Any] = orjson.loads(await asyncio.wait_for(ws.recv(), 5))
        if frame["type"] in ("done", "error"):
            return frame


# --- WebSocket starts and the rate ------------------------------------------------------------


async def test_every_websocket_start_takes_a_token_of_the_keys_rate(tmp_path: Path) -> None:
    with serve(tmp_path, config(rate=2)) as server:
        url = f"ws://{server.host}:{server.port}/v1/realtime"
        async with websockets.connect(url, additional_headers=bearer(KEY_A)) as ws:
            began = time.monotonic()
            ends = []
            # Twelve: a client that ignores the hint sixteen times in a row is closed
            # (max_invalid_frames), as a flood of refused starts would be.
            for n in range(12):
                await ws.send(start_frame(f"turn {n}"))
                ends.append(await turn_end(ws))
            elapsed = time.monotonic() - began
            done = [f for f in ends if f["type"] == "done"]
            limited = [f for f in ends if f["type"] == "error"]
            assert all(f["error"]["code"] == "rate_limited" for f in limited), limited
            # A bucket of two, one of them the handshake's; a token more every half
            # second of the run (and of the handshake before it).
            assert 1 <= len(done) <= 2 + int(elapsed * 2), (len(done), elapsed)
            assert len(limited) >= 12 - len(done)
            hint = limited[0]["error"]
            assert hint["retryable"] is True
            assert isinstance(hint["retry_after_s"], int) and hint["retry_after_s"] >= 1
            assert "2 requests per second" in hint["message"]
            # The socket stays open and usable: after the hint, a start runs.
            await asyncio.sleep(hint["retry_after_s"])
            await ws.send(start_frame("after the wait"))
            assert await turn_end(ws) == {"type": "done"}
        # The HTTP requests of the key share its bucket with the socket's starts.
        async with aiohttp.ClientSession() as http:
            statuses = []
            for _ in range(4):
                async with http.post(
                    server.url + "/v1/chat/completions",
                    json={"model": "mock/echo", "messages": [{"role": "user", "content": "x"}]},
                    headers=bearer(KEY_A),
                ) as resp:
                    statuses.append(resp.status)
            assert 429 in statuses


# --- non-streaming requests and the concurrency limits ----------------------------------------

SLOW = {"content": "one two three four", "delay_ms": 250}  # about 1 s


async def post_slow(
    http: aiohttp.ClientSession, server: Server, key: str, tag: str
) -> tuple[int, dict[str, Any]]:
    body = {
        "model": "mock/echo",
        "messages": [{"role": "user", "content": f"slow {tag}"}],
        "mock": SLOW,
    }
    async with http.post(
        server.url + "/v1/chat/completions", json=body, headers=bearer(key)
    ) as resp:
        return resp.status, await resp.json()


async def staggered(*calls: Any) -> list[tuple[int, dict[str, Any]]]:
    """Run the calls together, each started 0.1 s after the one before."""
    tasks = []
    for call in calls:
        tasks.append(asyncio.ensure_future(call))
        await asyncio.sleep(0.1)
    return list(await asyncio.gather(*tasks))


def outcome(results: list[tuple[int, dict[str, Any]]]) -> tuple[int, list[str]]:
    """How many succeeded, and the messages of those refused with 429 too_many_streams
    (any other answer fails the test). Order-free: on a busy machine requests sent 0.1 s
    apart may still be admitted in another order."""
    refused = []
    for status, body in results:
        if status != 200:
            assert (status, body["error"]["code"]) == (429, "too_many_streams"), body
            refused.append(body["error"]["message"])
    return len(results) - len(refused), refused


@pytest.mark.parametrize("cache", [False, True], ids=["cache-off", "cache-on"])
async def test_non_streaming_requests_count_toward_the_stream_limits(
    tmp_path: Path, cache: bool
) -> None:
    with serve(tmp_path, config(streams=3, per_key=2, cache=cache)) as server:
        async with aiohttp.ClientSession() as http:
            # Per key: alpha's two run together (counted once each, not as opening and
            # as live); its third is refused while they run.
            results = await staggered(*(post_slow(http, server, KEY_A, f"a{n}") for n in range(3)))
            ok, refused = outcome(results)
            assert ok == 2, refused
            assert "'alpha'" in refused[0]
            assert "max_concurrent_streams_per_key" in refused[0]
            # Global: three run, the fourth (another key, under its own limit) is refused.
            results = await staggered(
                post_slow(http, server, KEY_A, "g0"),
                post_slow(http, server, KEY_B, "g1"),
                post_slow(http, server, KEY_B, "g2"),
                post_slow(http, server, KEY_A, "g3"),
            )
            ok, refused = outcome(results)
            assert ok == 3, refused
            assert "[limits] max_concurrent_streams)" in refused[0]
            # Clients that leave give their places back at once (the request is cancelled,
            # with the cache its run too): alpha may run two again straight away.
            leaving = [
                asyncio.ensure_future(post_slow(http, server, KEY_A, f"gone{n}")) for n in range(2)
            ]
            await asyncio.sleep(0.4)
            for task in leaving:
                task.cancel()
            await asyncio.gather(*leaving, return_exceptions=True)
            await asyncio.sleep(0.2)
            results = await staggered(
                *(post_slow(http, server, KEY_A, f"back{n}") for n in range(2))
            )
            assert outcome(results) == (2, [])
            assert (await server.health())["streams"] == 0
        log = server.log.read_text()
        assert log.count("status=429") == 2, log


# --- a realtime client that pings but never reads ---------------------------------------------


def masked(opcode: int, payload: bytes) -> bytes:
    """A client frame (FIN, masked), any length."""
    mask = os.urandom(4)
    size = len(payload)
    if size < 126:
        head = bytes([0x80 | opcode, 0x80 | size])
    elif size < 1 << 16:
        head = bytes([0x80 | opcode, 0x80 | 126]) + size.to_bytes(2, "big")
    else:
        head = bytes([0x80 | opcode, 0x80 | 127]) + size.to_bytes(8, "big")
    keys = (mask * (size // 4 + 1))[:size]
    body = (int.from_bytes(payload, "big") ^ int.from_bytes(keys, "big")).to_bytes(size, "big")
    return head + mask + body


@contextlib.asynccontextmanager
async def silent_websocket(server: Server) -> AsyncIterator[asyncio.StreamWriter]:
    """A raw WebSocket client with tiny receive buffers, past its handshake; it never
    reads another byte."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 1000)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (server.host, server.port))
    reader, writer = await asyncio.open_connection(sock=sock, limit=1024)
    key = base64.b64encode(os.urandom(16)).decode()
    writer.write(
        (
            f"GET /v1/realtime HTTP/1.1\r\nHost: {server.host}:{server.port}\r\n"
            "Upgrade: websocket\r\n"
            f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
            f"Sec-WebSocket-Version: 13\r\nAuthorization: Bearer {KEY_A}\r\n\r\n"
        ).encode()
    )
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert head.startswith(b"HTTP/1.1 101"), head
    try:
        yield writer
    finally:
        writer.transport.abort()


KEEPALIVES = {
    "pings": masked(0x9, b"ping"),
    # Each answered with an invalid_envelope error frame, queued behind the turn's.
    "bad-envelopes": masked(0x1, b'{"type":"nope"}'),
}


async def keep_alive_without_reading(server: Server, keepalive: bytes) -> float:
    """Start a long turn, then send ``keepalive`` every 0.5 s and read nothing; the
    seconds until the gateway dropped this client."""
    async with silent_websocket(server) as writer:
        # One tool call of 256 KiB in 8-character fragments: ~3 MB of frames, far
        # more than the kernel and aiohttp buffer for a client that reads nothing.
        script = {"content": "", "tool_calls": [{"name": "f", "arguments": "a" * 262_144}]}
        writer.write(masked(0x1, start_frame("go", script).encode()))
        began = time.monotonic()
        while time.monotonic() - began < WRITE_TIMEOUT_S + 5:
            try:
                writer.write(keepalive)  # alive, as far as frames go
                await writer.drain()
            except ConnectionError:
                break
            await asyncio.sleep(0.5)
        else:
            raise AssertionError("the client that reads nothing was never dropped")
        return time.monotonic() - began


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses TCP_MAXSEG")
async def test_a_realtime_client_that_pings_but_never_reads_is_dropped(tmp_path: Path) -> None:
    # Heartbeats as short as the write timeout: the clients' frames are what keeps them
    # from being dropped as gone, so only the write timeout can drop them.
    with serve(tmp_path, config(heartbeat_s=WRITE_TIMEOUT_S)) as server:
        dropped = await asyncio.gather(
            keep_alive_without_reading(server, masked(0x9, b"ping")),
            # Each answered with an invalid_envelope error frame, queued behind the turn's.
            keep_alive_without_reading(server, masked(0x1, b'{"type":"nope"}')),
        )
        assert all(WRITE_TIMEOUT_S <= after < WRITE_TIMEOUT_S + 3 for after in dropped), dropped
        for _ in range(50):
            health = await server.health()
            if health["streams"] == 0 and health["clients"] == 0:
                break
            await asyncio.sleep(0.1)
        assert health == health | {"streams": 0, "clients": 0}, "the turns' streams were cancelled"
        metrics = await server.metrics()
        assert 'nexus_cancellations_total{cause="write_timeout"} 2.0' in metrics, metrics
        log = server.log.read_text()
        assert len(re.findall(r"endpoint=/v1/realtime .*cancelled=write_timeout", log)) == 2, log
        assert "Traceback" not in log, log


async def test_a_websocket_session_is_logged_with_its_101(tmp_path: Path) -> None:
    """The access line of a realtime session has the status the client got (101), also
    when the client vanishes mid-turn (the handler is cancelled), never a 499 "left before
    any answer"; a session the client closed is ok."""
    with serve(tmp_path, config()) as server:
        url = f"ws://{server.host}:{server.port}/v1/realtime"
        headers = {**bearer(KEY_A), "X-Client-Request-Id": "ws-closed"}
        async with websockets.connect(url, additional_headers=headers) as ws:
            await ws.send(start_frame())
            assert await turn_end(ws) == {"type": "done"}
        headers = {**bearer(KEY_A), "X-Client-Request-Id": "ws-vanished"}
        ws = await websockets.connect(url, additional_headers=headers)
        await ws.send(start_frame(" ".join(["w"] * 50), mock={"delay_ms": 100}))
        await asyncio.wait_for(ws.recv(), 5)
        ws.transport.abort()  # gone without a close frame
        lines: dict[str, str] = {}
        for _ in range(100):
            log = server.log.read_text()
            lines = {
                rid: line
                for line in log.splitlines()
                for rid in ("ws-closed", "ws-vanished")
                if "nexus.access: req_" in line and f" client_request_id={rid} " in line
            }
            if len(lines) == 2:
                break
            await asyncio.sleep(0.05)
        assert "status=101 outcome=ok" in lines["ws-closed"], lines
        assert "status=101 outcome=cancelled:client_disconnect" in lines["ws-vanished"], lines
