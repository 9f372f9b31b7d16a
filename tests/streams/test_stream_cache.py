"""Record-and-replay: the stream cache, its replay modes and limits, joining in-flight streams."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

import orjson
import pytest
import websockets

from nexus import Provider
from nexus.cache.recording import cache_key
from nexus.events import Delta, StreamEvent, Usage
from nexus.request import ChatRequest
from support import GatedProvider, MakeClient, chat, parse_sse

WORDS = ["alpha ", "beta ", "gamma ", "delta ", "epsilon"]


class CountingProvider(Provider):
    """Deterministic words with a gap between them; counts its calls."""

    kind = "counting"

    def __init__(self, name: str = "count", gap_s: float = 0.0, fail_at: int | None = None):
        super().__init__(name)
        self.calls = 0
        self.gap_s = gap_s
        self.fail_at = fail_at

    async def batches(
        self, request: ChatRequest, model: str
    ) -> AsyncGenerator[list[StreamEvent], None]:
        self.calls += 1
        for index, word in enumerate(WORDS):
            if index == self.fail_at:
                from nexus.errors import UpstreamError

                raise UpstreamError("upstream broke mid-stream")
            if index and self.gap_s:
                await asyncio.sleep(self.gap_s)
            yield [Delta(content=word)]
        yield [Delta(finish_reason="stop")]
        yield [Usage(prompt_tokens=3, completion_tokens=5, total_tokens=8)]


class CountingGate(GatedProvider):
    def __init__(self) -> None:
        super().__init__(before=2, after=2)
        self.calls = 0

    async def batches(
        self, request: ChatRequest, model: str
    ) -> AsyncGenerator[list[StreamEvent], None]:
        self.calls += 1
        async for batch in super().batches(request, model):
            yield batch


def ndjson(body: bytes) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in body.splitlines() if line]


def text_of(lines: list[dict[str, Any]]) -> str:
    return "".join(line["delta"].get("content") or "" for line in lines if line["type"] == "delta")


def cached(**cache: Any) -> dict[str, Any]:
    return {"cache": {"enabled": True, **cache}}


async def post(client: Any, fmt: str = "ndjson", **body: Any) -> tuple[str, bytes]:
    resp = await client.post(
        f"/v1/chat/completions?stream_format={fmt}",
        json=chat(model="count/m", stream=True, **body),
    )
    assert resp.status == 200, await resp.text()
    return resp.headers.get("X-Nexus-Cache", ""), await resp.read()


async def test_a_second_identical_request_replays_without_calling_the_provider(
    make_client: MakeClient,
) -> None:
    counting = CountingProvider()
    client = await make_client(cached(), providers=[counting])
    status, first = await post(client)
    assert status == "miss"
    await asyncio.sleep(0.05)  # the recording is kept when the stream's log is
    status, second = await post(client)
    assert status == "hit"
    assert counting.calls == 1
    assert text_of(ndjson(second)) == text_of(ndjson(first)) == "".join(WORDS)
    assert ndjson(second)[-2]["usage"]["total_tokens"] == 8


async def test_a_recording_replays_in_any_format(make_client: MakeClient) -> None:
    counting = CountingProvider()
    client = await make_client(cached(), providers=[counting])
    await post(client, "ndjson")
    await asyncio.sleep(0.05)
    status, body = await post(client, "sse")
    assert status == "hit"
    chunks = [orjson.loads(e.data) for e in parse_sse(body) if e.data.startswith("{")]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == "".join(WORDS)
    messages = await client.post(
        "/v1/messages",
        json={**chat(model="count/m", stream=True), "max_tokens": 10},
    )
    assert messages.headers["X-Nexus-Cache"] == "miss"  # max_tokens makes it another request
    await messages.read()
    # Non-streaming requests are served from the recording too.
    plain = await client.post("/v1/chat/completions", json=chat(model="count/m"))
    assert plain.headers["X-Nexus-Cache"] == "hit"
    assert (await plain.json())["choices"][0]["message"]["content"] == "".join(WORDS)
    # And the WebSocket.
    url = f"ws://{client.server.host}:{client.server.port}/v1/realtime"
    async with websockets.connect(url) as ws:
        await ws.send(orjson.dumps({"type": "start", "request": chat(model="count/m")}).decode())
        frames = []
        while not frames or frames[-1]["type"] != "done":
            frames.append(orjson.loads(await asyncio.wait_for(ws.recv(), 5)))
    assert text_of(frames) == "".join(WORDS)
    assert counting.calls == 2  # the first request, and the Messages one


async def test_the_key_is_the_canonical_request_not_the_wire() -> None:
    base = ChatRequest.model_validate(chat(model="m/x", stream=True))
    same = ChatRequest.model_validate(
        {**chat(model="m/x"), "stream_options": {"include_usage": True}, "background": True}
    )
    other = ChatRequest.model_validate(chat(model="m/x", temperature=0.5))
    assert cache_key(base) == cache_key(same)
    assert cache_key(base) != cache_key(other)
    reordered = ChatRequest.model_validate(
        {"messages": base.model_dump()["messages"], "model": "m/x"}
    )
    assert cache_key(reordered) == cache_key(base)
    # Each listener's own options are rendered for it; an option passed upstream (an
    # OpenAI-compatible server's own) changes the stream: it is in the key.
    ours = {"include_usage": True, "include_cost": True, "include_obfuscation": False}
    mine = ChatRequest.model_validate({**chat(model="m/x"), "stream_options": ours})
    assert cache_key(mine) == cache_key(base)
    keys = {
        cache_key(ChatRequest.model_validate({**chat(model="m/x"), "stream_options": options}))
        for options in ({"continuous_usage_stats": True}, {"continuous_usage_stats": False})
    }
    assert len(keys) == 2 and cache_key(base) not in keys


async def test_the_cache_is_off_by_default(make_client: MakeClient) -> None:
    counting = CountingProvider()
    client = await make_client(providers=[counting])
    assert (await post(client))[0] == ""
    await asyncio.sleep(0.05)
    assert (await post(client))[0] == ""
    assert counting.calls == 2


@pytest.mark.parametrize(
    ("cache", "recorded"),
    [
        ({"max_frames": 3}, False),
        ({"max_frames": 7}, True),  # five words, the finish and the usage
        ({"max_bytes": 100}, False),
        ({"max_bytes": 100_000}, True),
    ],
)
async def test_recordings_past_a_limit_are_abandoned(
    make_client: MakeClient, cache: dict[str, Any], recorded: bool
) -> None:
    counting = CountingProvider()
    client = await make_client(cached(**cache), providers=[counting])
    await post(client)
    await asyncio.sleep(0.05)
    status, body = await post(client)
    assert status == ("hit" if recorded else "miss")
    assert text_of(ndjson(body)) == "".join(WORDS)  # never truncated


async def test_only_streams_that_ended_well_are_kept(make_client: MakeClient) -> None:
    failing = CountingProvider(fail_at=2)
    client = await make_client(cached(), providers=[failing])
    _, body = await post(client)
    assert ndjson(body)[-2]["type"] == "error"
    await asyncio.sleep(0.05)
    status, _ = await post(client)
    assert status == "miss"
    assert failing.calls == 2


async def test_recordings_expire(make_client: MakeClient) -> None:
    counting = CountingProvider()
    client = await make_client(cached(ttl_s=0.2), providers=[counting])
    await post(client)
    await asyncio.sleep(0.3)
    assert (await post(client))[0] == "miss"


@pytest.mark.parametrize(("mode", "fraction"), [("paced", 1.0), ("fast_forward", 0.25)])
async def test_replay_modes_keep_the_original_gaps_or_a_fraction(
    make_client: MakeClient, mode: str, fraction: float
) -> None:
    gap = 0.08
    counting = CountingProvider(gap_s=gap)
    client = await make_client(cached(mode=mode), providers=[counting])
    await post(client)
    await asyncio.sleep(0.05)
    loop = asyncio.get_running_loop()
    started = loop.time()
    resp = await client.post(
        "/v1/chat/completions?stream_format=ndjson", json=chat(model="count/m", stream=True)
    )
    assert resp.headers["X-Nexus-Cache"] == "hit"
    arrivals = []
    while line := await resp.content.readline():
        arrivals.append(loop.time() - started)
        if b'"done"' in line:
            break
    # Lower bounds only (sleeps cannot end early): the last word came after the gaps.
    expected = gap * (len(WORDS) - 1) * fraction
    assert arrivals[len(WORDS) - 1] >= expected * 0.9


async def test_burst_replays_without_waiting(make_client: MakeClient) -> None:
    counting = CountingProvider(gap_s=0.2)
    client = await make_client(cached(), providers=[counting])
    await post(client)
    await asyncio.sleep(0.05)
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert (await post(client))[0] == "hit"
    assert loop.time() - started < 0.2 * (len(WORDS) - 1)  # the original took 0.8 s


async def test_identical_requests_in_flight_share_one_upstream_call(
    make_client: MakeClient,
) -> None:
    gated = CountingGate()
    client = await make_client(cached(), providers=[gated])
    body = chat(model="gated/m", stream=True)
    first = await client.post("/v1/chat/completions?stream_format=ndjson", json=body)
    assert first.headers["X-Nexus-Cache"] == "miss"
    await asyncio.wait_for(first.content.readline(), 5)
    joiners = [
        await client.post(f"/v1/chat/completions?stream_format={fmt}", json=body)
        for fmt in ("ndjson", "sse")
    ]
    assert [j.headers["X-Nexus-Cache"] for j in joiners] == ["hit", "hit"]
    gated.gate.set()
    bodies = [await r.read() for r in (first, *joiners)]
    expected = "before0 before1 after0 after1 "
    assert text_of(ndjson(bodies[0])) == expected[len("before0 ") :]  # after its first line
    assert text_of(ndjson(bodies[1])) == expected
    chunks = [orjson.loads(e.data) for e in parse_sse(bodies[2]) if e.data.startswith("{")]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == expected
    assert gated.calls == 1
