"""``[server] drain_delay_s``: after SIGTERM the server goes on serving for that long with
``/healthz`` answering 503 (a load balancer's probe sees it and stops sending), then
closes its listener. A real ``nexus serve`` process: the listener used to close at once,
so the 503 could never be seen."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import aiohttp

from nexus_process import start_nexus, stop_nexus

DELAY_S = 2.0


async def test_healthz_answers_503_while_it_still_serves_then_the_listener_closes(
    tmp_path: Path,
) -> None:
    config = tmp_path / "config.toml"
    config.write_text(
        f"[server]\nshutdown_grace_s = 1\ndrain_delay_s = {DELAY_S}\n\n"
        '[providers.mock]\nkind = "mock"\n'
    )
    proc, match = start_nexus(config, tmp_path / "nexus.log")
    url = match.group(1)
    request = {"model": "mock/echo", "messages": [{"role": "user", "content": "hi"}]}
    try:
        sigterm = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.3)
        # New connections each (force_close): the listener still accepts them.
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http:
            async with http.get(url + "/healthz") as resp:
                assert resp.status == 503
                assert (await resp.json())["error"]["code"] == "server_shutting_down"
            async with http.post(url + "/v1/chat/completions", json=request) as resp:
                assert resp.status == 200
            assert time.monotonic() - sigterm < DELAY_S - 0.5  # (all of it within the delay)
            await asyncio.sleep(DELAY_S + 0.5 - (time.monotonic() - sigterm))
            try:
                async with http.get(url + "/healthz") as resp:
                    refused = f"answered {resp.status}"
            except aiohttp.ClientConnectionError:
                refused = "refused"
            assert refused == "refused"
        assert await asyncio.to_thread(proc.wait, 15) == 0
    finally:
        stop_nexus(proc, gently=False)


async def test_a_second_signal_cuts_the_drain_delay_and_the_grace_short(tmp_path: Path) -> None:
    # Ctrl-C twice in a terminal: a long drain delay (sized for a load balancer) and a long
    # grace are for the first signal only; the process used to wait them out whatever came.
    config = tmp_path / "config.toml"
    config.write_text(
        '[server]\nshutdown_grace_s = 60\ndrain_delay_s = 60\n\n[providers.mock]\nkind = "mock"\n'
    )
    proc, match = start_nexus(config, tmp_path / "nexus.log")
    url = match.group(1)
    request = {
        "model": "mock/echo",
        "stream": True,
        "messages": [{"role": "user", "content": "word " * 200}],
        "mock": {"delay_ms": 200},  # 40 s of stream: it would hold the whole grace
    }
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/v1/chat/completions", json=request) as resp:
                await resp.content.readline()
                proc.send_signal(signal.SIGINT)
                await asyncio.sleep(0.5)
                assert proc.poll() is None  # draining: 60 s of it to come
                proc.send_signal(signal.SIGINT)
                rest = await asyncio.wait_for(resp.content.read(), 15)
            assert b"server_shutting_down" in rest
        assert await asyncio.to_thread(proc.wait, 15) == 0
    finally:
        stop_nexus(proc, gently=False)
    assert "cut short" in (tmp_path / "nexus.log").read_text()
