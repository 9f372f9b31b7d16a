"""1,000 concurrent streams with random client disconnects and aborts: afterwards no leaked
tasks, streams, pumps, sockets, connections, descriptors or memory.

One gateway app, one client session with no connection limit, and a thousand clients at once
in every format and surface: readers that read to the end (and check every word arrived once,
then the terminator), readers that leave after a random number of frames, clients whose reads
are cut short by a timeout, hard aborts of the TCP connection, WebSocket turns aborted mid-turn
or left by closing the socket, and (when streams outlive their clients) background requests
read through ``GET /v1/streams/{id}``, resumes with ``Last-Event-ID`` and ``DELETE``.

Each test runs a warm-up round and a measured round of the same mix, then counts: the tasks of
the event loop, the hub's live streams, the app's pumps and sockets, the server's connections,
this process's file descriptors, and its resident memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import random
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from nexus.cache.readers import RunReader
from nexus.cache.run import StreamRun
from nexus.protocol.sse import SSEDecoder
from nexus.server.routes.realtime import RealtimeConnection
from nexus.server.state import HUB, RUNTIME
from nexus.server.streaming import StreamPump
from support import MakeClient

STREAMS = 1000
WORDS = 30
CONTENT = " ".join(f"w{i}" for i in range(WORDS))
ROUND_TIMEOUT_S = 60.0
SETTLE_S = 10.0
TASK_SLACK = 2
"""Tasks of the test machinery that may come and go (the client's cleanup)."""
FD_SLACK = 8
RSS_GROWTH_BOUND = 50 * 1024 * 1024
STORE_BYTES = 8 * 1024 * 1024
"""The memory store keeps finished logs for resume; bounded here so that retention by
design (a few MB per round) is told apart from a leak."""

SSE = "text/event-stream"
NATIVE = "application/vnd.nexus.events+sse"
NDJSON = "application/x-ndjson"
ANTHROPIC = "application/vnd.nexus.anthropic-messages+sse"
RESPONSES = "application/vnd.nexus.openai-responses+sse"
# (endpoint, stream_format): every format of the chat endpoint, and each endpoint's own.
ROUTES = [
    ("/v1/chat/completions", "sse"),
    ("/v1/chat/completions", "nexus"),
    ("/v1/chat/completions", "ndjson"),
    ("/v1/messages", None),
    ("/v1/responses", None),
]


def body(path: str, rng: random.Random, **extra: Any) -> dict[str, Any]:
    """A streaming request of endpoint ``path`` whose answer is CONTENT, word by word."""
    mock = {"content": CONTENT, "delay_ms": rng.randint(5, 20)}
    request: dict[str, Any]
    if path == "/v1/messages":
        request = {"max_tokens": 1000, "messages": [{"role": "user", "content": "go"}]}
    elif path == "/v1/responses":
        request = {"input": "go"}
    else:
        request = {"messages": [{"role": "user", "content": "go"}]}
    return {"model": "mock/echo", "stream": True, "mock": mock, **request, **extra}


# --- reading any format -------------------------------------------------------------------


@dataclass
class Transcript:
    """What a client saw: the text, and how the stream ended (None: not seen to end)."""

    text: str = ""
    end: str | None = None
    last_id: str = ""


def transcript(media_type: str, data: bytes) -> Transcript:
    """Parse the complete frames of ``data`` (a whole body, or what came before a cut)."""
    out = Transcript()
    if media_type == NDJSON:
        for line in data.split(b"\n")[:-1]:  # the part after the last newline is incomplete
            event = orjson.loads(line)
            _event(out, event.get("type"), event)
        return out
    decoder = SSEDecoder()
    for sse in decoder.decode(data):
        out.last_id = sse.id
        payload: Any = orjson.loads(sse.data) if sse.data.startswith("{") else {}
        if media_type == SSE:
            if sse.data == "[DONE]":
                out.end = out.end or "done"
            elif sse.event == "error":
                out.end = payload["error"]["code"]
            else:
                for choice in payload.get("choices", []):
                    out.text += choice["delta"].get("content") or ""
        elif media_type == NATIVE:
            _event(out, sse.event, payload)
        elif media_type == ANTHROPIC:
            if sse.event == "content_block_delta" and payload["delta"]["type"] == "text_delta":
                out.text += payload["delta"]["text"]
            elif sse.event == "message_stop":
                out.end = "done"
            elif sse.event == "error":  # the Anthropic stream ends at its error
                out.end = "error:" + payload["error"]["type"]
        elif media_type == RESPONSES:
            if sse.event == "response.output_text.delta":
                out.text += payload["delta"]
            elif sse.event == "error":
                out.end = payload["code"]
            elif sse.event in ("response.completed", "response.incomplete"):
                out.end = out.end or "done"
    return out


def _event(out: Transcript, kind: str | None, event: dict[str, Any]) -> None:
    if kind == "delta":
        out.text += event["delta"].get("content") or ""
    elif kind == "error":
        out.end = event["error"]["code"]
    elif kind == "done":
        out.end = out.end or ("aborted" if event.get("aborted") else "done")


def check_prefix(seen: Transcript, *, complete: bool) -> str:
    """Every word that arrived arrived once and in order; ``complete``: all of them, then the end.

    Returns the outcome, for the tally.
    """
    assert CONTENT.startswith(seen.text), seen.text
    if complete:
        assert seen.text == CONTENT and seen.end == "done", seen
        return "complete"
    if seen.end == "done":
        assert seen.text == CONTENT, seen
        return "complete"
    return seen.end or "cut"


# --- the clients ---------------------------------------------------------------------------

Client = Callable[[aiohttp.ClientSession, str, random.Random], Awaitable[str]]


async def read_to_end(session: aiohttp.ClientSession, base: str, rng: random.Random) -> str:
    path, fmt = rng.choice(ROUTES)
    params = {"stream_format": fmt} if fmt else {}
    async with session.post(base + path, json=body(path, rng), params=params) as resp:
        assert resp.status == 200, await resp.text()
        seen = transcript(resp.headers["X-Nexus-Stream-Format"], await resp.read())
    return "read_to_end " + check_prefix(seen, complete=True)


async def leave_after_frames(session: aiohttp.ClientSession, base: str, rng: random.Random) -> str:
    """Reads a random number of frames, then closes the response (and its connection)."""
    path, fmt = rng.choice(ROUTES)
    params = {"stream_format": fmt} if fmt else {}
    resp = await session.post(base + path, json=body(path, rng), params=params)
    try:
        assert resp.status == 200, await resp.text()
        media_type = resp.headers["X-Nexus-Stream-Format"]
        end_of_frame = b"\n" if media_type == NDJSON else b"\n\n"
        data = b""
        for _ in range(rng.randint(0, WORDS + 10)):
            frame = await resp.content.readuntil(end_of_frame)
            if not frame:
                break
            data += frame
        seen = transcript(media_type, data)
    finally:
        resp.close()
    return "leave " + check_prefix(seen, complete=False)


async def cut_by_timeout(session: aiohttp.ClientSession, base: str, rng: random.Random) -> str:
    """A read cancelled by a client-side timeout, or the TCP connection aborted outright."""
    path, fmt = rng.choice(ROUTES)
    params = {"stream_format": fmt} if fmt else {}
    hard = rng.random() < 0.5
    async with session.post(base + path, json=body(path, rng), params=params) as resp:
        assert resp.status == 200, await resp.text()
        if hard:
            await asyncio.sleep(rng.uniform(0, 0.3))
            connection = resp.connection
            if connection is None or connection.transport is None:
                # The stream ended first and the connection went back to the pool, where
                # another client may be using it now: nothing of ours to abort.
                return "abort_tcp late"
            connection.transport.abort()
            return "abort_tcp"
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(rng.uniform(0, 0.3)):
                await resp.read()
                return "timeout complete"
    return "timeout cut"


async def realtime(session: aiohttp.ClientSession, base: str, rng: random.Random) -> str:
    """A WebSocket turn: aborted mid-turn (then a second turn read to the end), left by
    closing the socket, or read to the end."""
    mode = rng.choice(["abort", "abort", "close", "finish"])
    request = body("/v1/chat/completions", rng)
    del request["stream"]
    start = orjson.dumps({"type": "start", "request": request}).decode()
    async with session.ws_connect(base + "/v1/realtime") as ws:
        await ws.send_str(start)
        seen = Transcript()
        reads = rng.randint(0, 30) if mode != "finish" else 10**6
        while seen.end is None and reads > 0:
            _event(seen, *_frame(await ws.receive()))
            reads -= 1
        if mode == "close":
            check_prefix(seen, complete=False)
            return "ws close"
        if mode == "finish":
            return "ws " + check_prefix(seen, complete=True)
        await ws.send_str('{"type":"abort"}')
        while True:  # until the abort is answered: done(aborted), or nothing_to_abort after done
            kind, event = _frame(await ws.receive())
            if kind == "error":
                assert seen.end == "done" and event["error"]["code"] == "nothing_to_abort", event
                break
            _event(seen, kind, event)
            if seen.end == "aborted":
                break
        outcome = check_prefix(seen, complete=False)
        # The socket stays usable after an abort: a second, short turn reads to its end.
        again = orjson.loads(start)
        again["request"]["mock"] = {"content": CONTENT}
        await ws.send_str(orjson.dumps(again).decode())
        second = Transcript()
        while second.end is None:
            _event(second, *_frame(await ws.receive()))
        check_prefix(second, complete=True)
        return "ws abort " + outcome


def _frame(message: aiohttp.WSMessage) -> tuple[str, dict[str, Any]]:
    assert message.type is aiohttp.WSMsgType.TEXT, message
    event = orjson.loads(message.data)
    return event["type"], event


async def background(session: aiohttp.ClientSession, base: str, rng: random.Random) -> str:
    """``"background": true``, then ``GET /v1/streams/{id}``: read to the end, left, or
    cancelled with ``DELETE`` while being read."""
    path, _ = rng.choice(ROUTES)
    # (not streamed: a Responses request that streams in the background streams at once)
    answer_later = body(path, rng, background=True, stream=False)
    async with session.post(base + path, json=answer_later) as resp:
        assert resp.status == 202, await resp.text()
        stream_id = (await resp.json())["id"]
    mode = rng.choice(["read", "leave", "delete"])
    fmt = rng.choice(["sse", "nexus", "ndjson", None])
    params = {"stream_format": fmt} if fmt else {}
    async with session.get(f"{base}/v1/streams/{stream_id}", params=params) as resp:
        # Streams outlive their clients here, but only for detach_timeout_s: under load the
        # GET may come later than that, and then it reads a log that ends with stream_detached.
        assert resp.status == 200, await resp.text()
        media_type = resp.headers["X-Nexus-Stream-Format"]
        if mode == "read":
            seen = transcript(media_type, await resp.read())
            assert seen.end is not None, seen
            return "background read " + check_prefix(seen, complete=False)
        data = await resp.content.readany()
        if mode == "delete":
            async with session.delete(f"{base}/v1/streams/{stream_id}") as cancel:
                assert cancel.status == 200, await cancel.text()
                status = (await cancel.json())["status"]
                assert status in ("cancelled", "completed"), status
            data += await resp.read()  # the GET ends with the stream
            seen = transcript(media_type, data)
            assert seen.end is not None, seen
            return f"background delete {status} " + check_prefix(seen, complete=False)
    check_prefix(transcript(media_type, data), complete=False)
    return "background leave"


async def resume(session: aiohttp.ClientSession, base: str, rng: random.Random) -> str:
    """Leave an SSE stream after some reads, come back with ``Last-Event-ID``: every word once."""
    path, fmt = rng.choice([r for r in ROUTES if r[1] != "ndjson"])
    params = {"stream_format": fmt} if fmt else {}
    async with session.post(base + path, json=body(path, rng), params=params) as resp:
        assert resp.status == 200, await resp.text()
        media_type = resp.headers["X-Nexus-Stream-Format"]
        stream_id = resp.headers["X-Nexus-Stream-Id"]
        data = b""
        while data.count(b"\n\n") < rng.randint(1, 20):
            chunk = await resp.content.readany()
            if not chunk:
                break
            data += chunk
        # Cut at a frame boundary, as a client that lost the connection there would have it.
        data = data[: data.rfind(b"\n\n") + 2]
        resp.close()
    first = transcript(media_type, data)
    if first.end is not None:
        return "resume " + check_prefix(first, complete=False)
    headers = {"Last-Event-ID": first.last_id} if first.last_id else {}
    url = f"{base}/v1/streams/{stream_id}"
    async with session.get(url, params=params, headers=headers) as again:
        assert again.status in (200, 204), await again.text()
        rest = await again.read()
    # The resumed part is rendered by the same encoder from the same point: one transcript.
    seen = transcript(media_type, data + rest)
    assert seen.end is not None, seen
    return "resume " + check_prefix(seen, complete=False)


# Mixes: (client, weight). With detach_timeout_s = 0 a stream ends with its last client,
# so background streams and resumes have nothing to come back to; they run in the other test.
ENDING_WITH_CLIENT: list[tuple[Client, int]] = [
    (read_to_end, 4),
    (leave_after_frames, 3),
    (cut_by_timeout, 2),
    (realtime, 2),
]
OUTLIVING_CLIENT: list[tuple[Client, int]] = [
    *ENDING_WITH_CLIENT,
    (background, 2),
    (resume, 1),
]


# --- counting --------------------------------------------------------------------------------


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


@dataclass
class Baseline:
    tasks: int
    fds: int


def baseline() -> Baseline:
    gc.collect()
    return Baseline(tasks=len(asyncio.all_tasks()), fds=open_fds())


def leftovers(client: TestClient[Any, Any], base: Baseline) -> dict[str, int]:
    """What is still around beyond the baseline; empty when everything was let go."""
    app = client.app
    assert app is not None and client.server.runner is not None
    server = client.server.runner.server
    assert server is not None
    hub = app[HUB]
    runtime = app[RUNTIME]
    counts = {
        "live streams": len(hub.live),
        "pumps": len(runtime.active),
        "sockets": len(runtime.sockets),
        "server connections": len(server.connections),
        "tasks": max(len(asyncio.all_tasks()) - base.tasks - TASK_SLACK, 0),
        "fds": max(open_fds() - base.fds - FD_SLACK, 0),
    }
    counts.update(instances())
    return {name: count for name, count in counts.items() if count}


LIFETIME_CLASSES = (StreamRun, RunReader, StreamPump, RealtimeConnection, web.Request)


def instances() -> dict[str, int]:
    """Objects of one stream or one connection still alive (each should be gone by now)."""
    counts = Counter(
        type(obj).__name__ for obj in gc.get_objects() if isinstance(obj, LIFETIME_CLASSES)
    )
    return dict(counts)


async def settle(client: TestClient[Any, Any], base: Baseline) -> None:
    """Poll until nothing is left over, for at most SETTLE_S."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + SETTLE_S
    while (left := leftovers(client, base)) and loop.time() < deadline:
        await asyncio.sleep(0.05)
        gc.collect()
    assert not left, f"still there {SETTLE_S:g}s after the round: {left}"


@dataclass
class Round:
    outcomes: Counter[str]
    peaks: dict[str, int]
    """The most streams, pumps, sockets and server connections seen at once."""


async def run_round(
    client: TestClient[Any, Any], mix: list[tuple[Client, int]], seed: int
) -> Round:
    """STREAMS clients at once on one session; every client's outcome, tallied."""
    rng = random.Random(seed)
    kinds = rng.choices([c for c, _ in mix], weights=[w for _, w in mix], k=STREAMS)
    base = str(client.make_url("")).rstrip("/")
    app = client.app
    assert app is not None and client.server.runner is not None
    server: Any = client.server.runner.server
    peaks: dict[str, int] = {}

    async def sample() -> None:
        while True:
            now = {
                "live streams": len(app[HUB].live),
                "pumps": len(app[RUNTIME].active),
                "sockets": len(app[RUNTIME].sockets),
                "server connections": len(server.connections),
            }
            for name, count in now.items():
                peaks[name] = max(peaks.get(name, 0), count)
            await asyncio.sleep(0.01)

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        started = asyncio.Event()

        async def one(kind: Client, seed: int) -> str:
            await started.wait()  # all at once
            return await kind(session, base, random.Random(seed))

        sampler = asyncio.create_task(sample())
        try:
            async with asyncio.timeout(ROUND_TIMEOUT_S), asyncio.TaskGroup() as group:
                tasks = [group.create_task(one(k, rng.getrandbits(32))) for k in kinds]
                started.set()
        finally:
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler
    return Round(Counter(task.result() for task in tasks), peaks)


async def check_rounds(client: TestClient[Any, Any], mix: list[tuple[Client, int]]) -> None:
    base = baseline()
    warm = await run_round(client, mix, seed=1)
    await settle(client, base)
    gc.collect()
    rss_warm = rss_bytes()
    measured = await run_round(client, mix, seed=2)
    await settle(client, base)
    gc.collect()
    growth = rss_bytes() - rss_warm
    for done in (warm, measured):
        outcomes = done.outcomes
        assert sum(outcomes.values()) == STREAMS
        # Every client that read to the end got every word once, and the terminator.
        assert all(o == "read_to_end complete" for o in outcomes if o.startswith("read_to_end"))
        assert outcomes["read_to_end complete"] > STREAMS // 5, outcomes
        # They ran at the same time (on a 2-core machine some 700 to 900 were open at once).
        assert done.peaks["server connections"] > STREAMS // 3, done.peaks
        assert done.peaks["live streams"] > STREAMS // 3, done.peaks
    assert growth < RSS_GROWTH_BOUND, f"RSS grew by {growth / 2**20:.1f} MiB: {measured}"


def config(detach_timeout_s: float) -> dict[str, Any]:
    return {
        "streams": {"detach_timeout_s": detach_timeout_s},
        "store": {"kind": "memory", "max_bytes": STORE_BYTES},
    }


async def test_a_thousand_streams_that_end_with_their_clients(make_client: MakeClient) -> None:
    """``detach_timeout_s = 0``: a client that leaves ends its stream at once."""
    client = await make_client(config(0))
    await check_rounds(client, ENDING_WITH_CLIENT)


async def test_a_thousand_streams_that_outlive_their_clients(make_client: MakeClient) -> None:
    """``detach_timeout_s = 0.2``: streams run on after their clients leave, then are cancelled;
    background streams, resumes and DELETE join the mix."""
    client = await make_client(config(0.2))
    await check_rounds(client, OUTLIVING_CLIENT)


@pytest.mark.parametrize(
    ("media_type", "data", "text", "end"),
    [
        (NDJSON, b'{"type":"delta","delta":{"content":"w0"}}\n{"type":"do', "w0", None),
        (SSE, b'data: {"choices":[{"delta":{"content":"w0"}}]}\n\ndata: [DONE]\n\n', "w0", "done"),
        (
            NATIVE,
            b'event: error\ndata: {"type":"error","error":{"code":"stream_detached"}}\n\n',
            "",
            "stream_detached",
        ),
    ],
)
def test_transcript_reads_complete_frames_only(
    media_type: str, data: bytes, text: str, end: str | None
) -> None:
    seen = transcript(media_type, data)
    assert (seen.text, seen.end) == (text, end)
