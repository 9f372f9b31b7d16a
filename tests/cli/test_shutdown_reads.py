"""Every open connection is still read while ``nexus serve`` drains (a real process).

aiohttp's ``runner.cleanup()`` stops reading every connection before the app's shutdown
hooks run; the grace used to run there, so during it a WebSocket's pongs were dropped
(the socket then cut as "did not answer a ping": 1006, not the turn's error frame and
1001), an ``abort`` was ignored (the turn streamed and was billed on), a request on an
idle keep-alive connection hung until the end and got no answer, and an upload under way
never finished. Here the grace (3 s) runs before the cleanup:

* a realtime client that answers pings keeps its socket through the grace (pings every
  0.3 s) and gets the error frame, then 1001, at its end; another client's ``abort``
  during the grace is answered at once, and its socket, now idle, closes 1001;
* an idle keep-alive connection is closed at once; a request sent on a connection
  opened before the signal gets 503 ``server_shutting_down`` with ``Connection: close``
  (and has its access line); an upload begun before the signal finishes and is answered.
"""

from __future__ import annotations

import asyncio
import re
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import websockets

from nexus_process import start_nexus, stop_nexus

GRACE_S = 3.0


@dataclass
class Served:
    proc: Any
    url: str
    host: str
    port: int
    log: Path


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[Served]:
    config = tmp_path / "config.toml"
    config.write_text(
        f"[server]\nshutdown_grace_s = {GRACE_S}\nheartbeat_interval_s = 0.3\n\n"
        '[providers.mock]\nkind = "mock"\n'
    )
    log = tmp_path / "nexus.log"
    proc, match = start_nexus(config, log)
    url = match.group(1)
    host, port = url.removeprefix("http://").rsplit(":", 1)
    try:
        yield Served(proc, url, host, int(port), log)
    finally:
        stop_nexus(proc, gently=False)


def chat(words: int) -> dict[str, Any]:
    """A mock request: ``words`` words, one every 100 ms."""
    return {
        "model": "mock/echo",
        "messages": [{"role": "user", "content": "word " * words}],
        "mock": {"delay_ms": 100},
    }


async def frames_until_closed(ws: Any, frames: list[tuple[float, dict[str, Any]]]) -> float:
    """Every frame with its arrival time, until the socket closes; when it closed."""
    try:
        while True:
            frames.append((time.monotonic(), orjson.loads(await ws.recv())))
    except websockets.ConnectionClosed:
        return time.monotonic()


async def test_websockets_are_read_during_the_grace(served: Served) -> None:
    ws_url = served.url.replace("http", "ws", 1) + "/v1/realtime"
    async with (
        websockets.connect(ws_url, ping_interval=None) as pinged,
        websockets.connect(ws_url, ping_interval=None) as aborting,
    ):
        for ws in (pinged, aborting):
            await ws.send(orjson.dumps({"type": "start", "request": chat(300)}).decode())
            async with asyncio.timeout(10):
                await ws.recv()
        sigterm = time.monotonic()
        served.proc.send_signal(signal.SIGTERM)
        pinged_frames: list[tuple[float, dict[str, Any]]] = []
        aborted_frames: list[tuple[float, dict[str, Any]]] = []
        async with asyncio.timeout(GRACE_S + 10):
            pinged_end = asyncio.create_task(frames_until_closed(pinged, pinged_frames))
            aborted_end = asyncio.create_task(frames_until_closed(aborting, aborted_frames))
            await asyncio.sleep(0.5)
            abort_sent = time.monotonic()
            await aborting.send(orjson.dumps({"type": "abort"}).decode())
            aborted_closed = await aborted_end
            pinged_closed = await pinged_end

    # The abort was read: answered at once, the socket (idle now) closed 1001.
    done = [(t, f) for t, f in aborted_frames if f["type"] == "done"]
    assert done and done[0][1].get("aborted") is True, aborted_frames[-3:]
    assert done[0][0] - abort_sent < 2.0
    late = [t for t, f in aborted_frames if f["type"] == "delta" and t > abort_sent + 1.0]
    assert late == []
    assert aborting.close_code == 1001
    assert aborted_closed - sigterm < GRACE_S - 0.5

    # Its pongs were read: the socket lived through the grace, then the turn's error, 1001.
    assert pinged.close_code == 1001, (pinged.close_code, pinged_frames[-2:])
    assert pinged_closed - sigterm >= GRACE_S - 0.2
    assert pinged_frames[-1][1]["type"] == "error"
    assert pinged_frames[-1][1]["error"]["code"] == "server_shutting_down"
    assert await asyncio.to_thread(served.proc.wait, 15) == 0
    assert "did not answer a ping" not in served.log.read_text()


async def read_answer(reader: asyncio.StreamReader) -> bytes:
    """One HTTP response (its head, and its body by Content-Length)."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = re.search(rb"content-length: (\d+)", head, re.IGNORECASE)
    body = await reader.readexactly(int(length[1])) if length else b""
    return head + body


async def test_connections_are_read_during_the_grace(served: Served) -> None:
    body = orjson.dumps({**chat(8), "stream": True})
    # An idle keep-alive connection; one connected but yet to send; an upload half sent.
    idle_r, idle_w = await asyncio.open_connection(served.host, served.port)
    idle_w.write(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n")
    assert (await read_answer(idle_r)).startswith(b"HTTP/1.1 200")
    later_r, later_w = await asyncio.open_connection(served.host, served.port)
    up_r, up_w = await asyncio.open_connection(served.host, served.port)
    up_w.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body[:10]
    )
    await up_w.drain()
    async with aiohttp.ClientSession() as http:
        # A stream running through the grace: the drain lasts it.
        running = await http.post(
            served.url + "/v1/chat/completions", json={**chat(300), "stream": True}
        )
        await running.content.readline()
        await asyncio.sleep(0.2)  # the upload's head is read: its request has begun
        sigterm = time.monotonic()
        served.proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.5)

        # Closed at once, well before the grace's end.
        async with asyncio.timeout(1):
            assert await idle_r.read() == b""
        # Answered: 503, and the connection closed after it.
        later_w.write(b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n\r\n")
        async with asyncio.timeout(2):
            answer = await later_r.read()
        assert answer.startswith(b"HTTP/1.1 503"), answer[:300]
        assert b"server_shutting_down" in answer
        assert re.search(rb"\r\nconnection: close\r\n", answer, re.IGNORECASE)
        # The upload's rest arrives during the grace, and it is answered.
        up_w.write(body[10:])
        async with asyncio.timeout(GRACE_S + 3):
            uploaded = await up_r.read()
        assert uploaded.split(b"\r\n", 1)[0] in (
            b"HTTP/1.1 200 OK",
            b"HTTP/1.1 503 Service Unavailable",
        )
        assert time.monotonic() - sigterm < GRACE_S + 3
        async with asyncio.timeout(GRACE_S + 5):
            rest = await running.content.read()
        assert b"server_shutting_down" in rest
        running.release()
    for writer in (idle_w, later_w, up_w):
        writer.close()
    assert await asyncio.to_thread(served.proc.wait, 15) == 0
    log = served.log.read_text()
    assert re.search(r"method=GET path=/v1/models .*status=503", log), log[-2000:]
    # The stream running when the signal came, counted once (its run and its pump), and
    # the upload's request, not streaming yet.
    assert "waiting up to 3.0s for 2 streams and requests to finish" in log
