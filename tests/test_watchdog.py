"""One watchdog task for every response: heartbeats and stalls without a task per stream."""

from __future__ import annotations

import asyncio
from typing import Any

from nexus.server import state
from nexus.watchdog import Watchdog
from support import GatedProvider, MakeClient


class Counter:
    def __init__(self) -> None:
        self.checks: list[float] = []

    def check(self, now: float) -> None:
        self.checks.append(now)


def watchdog_tasks() -> list[asyncio.Task[Any]]:
    return [t for t in asyncio.all_tasks() if "Watchdog._run" in repr(t.get_coro())]


async def test_one_task_ticks_for_all_and_ends_when_none_is_left() -> None:
    dog = Watchdog()
    a, b = Counter(), Counter()
    dog.add(a, 0.01)
    dog.add(b, 0.05)  # the shortest tick wins
    await asyncio.sleep(0.1)
    assert len(watchdog_tasks()) == 1
    assert len(a.checks) >= 3 and len(b.checks) >= 3
    dog.discard(a)
    dog.discard(b)
    await asyncio.sleep(0.05)
    assert watchdog_tasks() == [], "it stops once nothing is watched"
    dog.add(a, 0.01)  # and starts again
    seen = len(a.checks)
    await asyncio.sleep(0.05)
    assert len(a.checks) > seen
    dog.discard(a)


async def test_a_check_that_raises_does_not_stop_the_others(caplog: Any) -> None:
    class Broken:
        def check(self, now: float) -> None:
            raise RuntimeError("boom")

    dog = Watchdog()
    good = Counter()
    dog.add(Broken(), 0.01)
    dog.add(good, 0.01)
    await asyncio.sleep(0.06)
    assert len(good.checks) >= 2
    assert "checking the timers of a response failed" in caplog.text
    dog._watched.clear()


async def test_idle_streams_share_one_watchdog_and_all_get_heartbeats(
    make_client: MakeClient,
) -> None:
    gated = GatedProvider(before=1, after=1)
    client = await make_client({"server": {"heartbeat_interval_s": 0.05}}, providers=[gated])
    body = {"model": "gated/m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    responses = [
        await client.post("/v1/chat/completions?stream_format=ndjson", json=body) for _ in range(8)
    ]
    received = [b""] * len(responses)
    for i, resp in enumerate(responses):
        while received[i].count(b'{"type":"heartbeat"}') < 2:
            received[i] += await asyncio.wait_for(resp.content.readany(), 5)
    # Two tickers in all, however many streams: the responses' and the runs' (their
    # max_stream_duration_s).
    assert len(watchdog_tasks()) == 2
    assert len(client.server.app[state.RUNTIME].watchdog) == len(responses)
    assert len(client.server.app[state.HUB].watchdog) == len(responses)
    gated.gate.set()
    for resp in responses:
        assert (await resp.read()).endswith(b'{"type":"done"}\n')
    assert len(client.server.app[state.RUNTIME].watchdog) == 0
