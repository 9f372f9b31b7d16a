"""SIGTERM while Redis does not answer (a real ``nexus serve``; Redis stopped with SIGSTOP).

Every wait on the store after the signal is bounded by one deadline: the streams end
at the grace's end (1 s) with their error, as with Redis up, and the process exits
within the grace and ``CLOSE_BOUND_S``. It used to ask Redis, one stream at a time,
whether another replica followed each of the streams nobody read here, each question
waiting out Redis's timeouts before the grace was checked: a client streaming through
the grace got the natural end of its stream instead, half a minute later, and the
process took longer still (charges, leases and the store's close waited again).

The spend of the streams ended by the shutdown cannot be charged: each is logged at
ERROR with its key's name and dollars (it used to be a warning that it would be retried
on the next tick, which never came).
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis

from nexus.auth import hash_key
from nexus.server.shutdown import CLOSE_BOUND_S
from nexus_process import start_nexus, stop_nexus
from redis_server import RedisServer

GRACE_S = 1.0
LOST = re.compile(
    r"ERROR nexus.limits: spend not charged \(Redis failed at shutdown\): key 'tenant', "
    r"(\S+) USD; add it once with: EVAL (\"[^\"]+\") 2 (\S+) (\S+) (\S+) (\d+)"
)
KEY = "nx-shutdown-0123456789-secret"
HEADERS = {"Authorization": f"Bearer {KEY}"}


def config(redis_url: str) -> str:
    return f"""\
[server]
shutdown_grace_s = {GRACE_S}
heartbeat_interval_s = 1

[limits]
stream_lease_s = 3

[[auth.keys]]
name = "tenant"
sha256 = "{hash_key(KEY)}"
budget_usd = 1000.0

[store]
kind = "redis"
url = "{redis_url}"
prefix = "shutdown"

[providers.mock]
kind = "mock"
models = ["echo"]

[models."mock/echo"]
input_usd_per_mtok = 1000
output_usd_per_mtok = 1000
"""


def chat(**extra: Any) -> dict[str, Any]:
    """30 s of mock stream (300 words, one every 100 ms)."""
    return {
        "model": "mock/echo",
        "stream": True,
        "max_tokens": 300,
        "messages": [{"role": "user", "content": "word " * 300}],
        "mock": {"delay_ms": 100},
        **extra,
    }


async def test_redis_not_answering_does_not_stretch_the_shutdown(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    path = tmp_path / "config.toml"
    path.write_text(config(redis_server.url))
    log = tmp_path / "nexus.log"
    proc, match = start_nexus(path, log)
    url = match.group(1) + "/v1/chat/completions"
    try:
        async with aiohttp.ClientSession(headers=HEADERS) as http:
            for _ in range(4):  # nobody reads them: a lease check each, in the old drain
                async with http.post(url, json=chat(background=True)) as resp:
                    assert resp.status == 202
            reading = await http.post(url, json=chat())
            assert reading.status == 200
            await reading.content.readline()
            assert redis_server.process is not None
            redis_server.process.send_signal(signal.SIGSTOP)
            sigterm = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            async with asyncio.timeout(15):
                rest = await reading.content.read()
            ended = time.monotonic() - sigterm
            reading.release()
        assert b"server_shutting_down" in rest, rest[-300:]
        assert ended < GRACE_S + 1.5
        exit_code = await asyncio.to_thread(proc.wait, 30)
        exited = time.monotonic() - sigterm
        assert exit_code == 0, log.read_text()[-3000:]
        assert exited < GRACE_S + CLOSE_BOUND_S + 2.5, log.read_text()[-3000:]
        # The streams' spend could not be charged: a line each, to add it by hand.
        lost = LOST.findall(log.read_text())
        assert len(lost) == 5, log.read_text()[-3000:]
        for usd, _, key, marker, again, _ in lost:
            assert key.startswith("shutdown:spend:tenant:") and usd == again
            assert marker.startswith("shutdown:charged:") and float(usd) > 0
        # Redis back (a charge sent before it stopped may land now): each line's command
        # adds its charge once, however often it is run, so the key's spend is exactly
        # what the streams cost (nothing was charged before the signal: they all ran).
        redis_server.process.send_signal(signal.SIGCONT)
        client = aioredis.from_url(redis_server.url)
        try:
            for _ in range(2):
                for _usd, script, key, marker, usd, expires in lost:
                    await client.eval(json.loads(script), 2, key, marker, usd, expires)
            spent = float(await client.get(lost[0][2]) or 0)
            # (a key the command made expires with its period, as a charged one does)
            assert await client.pttl(lost[0][2]) > 0
        finally:
            await client.aclose()
        assert spent == pytest.approx(sum(float(line[0]) for line in lost))
    finally:
        stop_nexus(proc, gently=False)


async def test_a_second_signal_ends_a_long_grace_at_once_with_redis_not_answering(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    # The second signal must cut the grace's bounds too, not only its wait: with Redis not
    # answering, the closing would otherwise run to the long grace's own deadline.
    path = tmp_path / "config.toml"
    path.write_text(config(redis_server.url).replace(f"= {GRACE_S}", "= 120", 1))
    log = tmp_path / "nexus.log"
    proc, match = start_nexus(path, log)
    url = match.group(1) + "/v1/chat/completions"
    try:
        async with aiohttp.ClientSession(headers=HEADERS) as http:
            reading = await http.post(url, json=chat())
            assert reading.status == 200
            await reading.content.readline()
            assert redis_server.process is not None
            redis_server.process.send_signal(signal.SIGSTOP)
            proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.5)
            again = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            async with asyncio.timeout(15):
                rest = await reading.content.read()
            reading.release()
        assert b"server_shutting_down" in rest, rest[-300:]
        assert await asyncio.to_thread(proc.wait, 30) == 0
        assert time.monotonic() - again < CLOSE_BOUND_S + 6, log.read_text()[-3000:]
    finally:
        stop_nexus(proc, gently=False)
