"""SIGTERM on a real ``nexus serve`` process with a realtime turn running past the grace.

The turn (a 30 s mock stream) outlives ``[server] shutdown_grace_s`` (2 s) while two
HTTP streams run beside it: its client gets the turn's error frame (a retryable
``server_shutting_down``), then a close frame with 1001, not a dropped connection
(1006). Twice, on two processes: the ending must not depend on timing luck.
"""

from __future__ import annotations

import asyncio
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
import websockets

from nexus_process import start_nexus, stop_nexus

CURL = shutil.which("curl")
GRACE_S = 2.0

pytestmark = pytest.mark.skipif(CURL is None, reason="needs curl")


def chat(words: int) -> dict[str, Any]:
    """A mock request: ``words`` words, one every 100 ms."""
    return {
        "model": "mock/echo",
        "messages": [{"role": "user", "content": "word " * words}],
        "mock": {"delay_ms": 100},
    }


async def run_once(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text(
        f"[server]\nshutdown_grace_s = {GRACE_S}\nheartbeat_interval_s = 15\n\n"
        '[providers.mock]\nkind = "mock"\n'
    )
    proc, match = start_nexus(config, tmp_path / "nexus.log")
    url = match.group(1)
    try:
        assert CURL is not None
        curls = [
            await asyncio.create_subprocess_exec(
                CURL,
                "-sN",
                url + path,
                "-H",
                "Content-Type: application/json",
                "-d",
                orjson.dumps({**chat(300), "stream": True}).decode(),
                stdout=asyncio.subprocess.PIPE,
            )
            for path in ("/v1/chat/completions", "/v1/chat/completions?stream_format=ndjson")
        ]
        heads = []
        for curl in curls:  # streaming before the signal
            assert curl.stdout is not None
            heads.append(await asyncio.wait_for(curl.stdout.readline(), 10))
        frames: list[dict[str, Any]] = []
        async with websockets.connect(url.replace("http", "ws", 1) + "/v1/realtime") as ws:
            await ws.send(orjson.dumps({"type": "start", "request": chat(300)}).decode())
            async with asyncio.timeout(10):
                frames.append(orjson.loads(await ws.recv()))
            sigterm = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            with pytest.raises(websockets.ConnectionClosed):
                async with asyncio.timeout(GRACE_S + 10):
                    while True:
                        frames.append(orjson.loads(await ws.recv()))
            closed = time.monotonic()
            assert ws.close_code == 1001, (ws.close_code, frames[-2:])
            assert ws.close_reason == "server shutting down"
        assert closed - sigterm >= GRACE_S - 0.2, "the turn ran through the grace period"
        error = frames[-1]
        assert error["type"] == "error", frames[-3:]
        assert error["error"]["code"] == "server_shutting_down"
        assert error["error"]["retryable"] is True
        assert error["error"]["request_id"].startswith("req_")
        assert sum(1 for frame in frames if frame["type"] == "delta") >= 10
        for curl, head in zip(curls, heads, strict=True):
            out, _ = await asyncio.wait_for(curl.communicate(), 15)
            assert b"word" in head + out
            assert b"server_shutting_down" in out
        assert await asyncio.to_thread(proc.wait, 15) == 0
    finally:
        stop_nexus(proc, gently=False)


async def test_a_turn_past_the_grace_gets_its_error_frame_then_1001_twice(
    tmp_path: Path,
) -> None:
    for attempt in range(2):
        here = tmp_path / f"run{attempt}"
        here.mkdir()
        await run_once(here)
