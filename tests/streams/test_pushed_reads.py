"""Pushed reads: once a stream is under way, each upstream read's events go from the
socket's ``data_received`` to the run's log and its readers (``Stream.push_to`` ->
``RoutedRun.push_to`` -> ``UpstreamExchange.push_to``), no task woken per read. A fast path beside
the pull path (the run's task awaiting ``UpstreamExchange.__anext__`` per read): a client must get
exactly what the pull path gives. Push is turned off by patching ``Stream.push_to`` to
return None; whether it was on is told by how often ``UpstreamExchange.__anext__`` ran."""

from __future__ import annotations

import asyncio
import logging
import re
from collections import deque
from collections.abc import Callable
from typing import Any

import orjson
import pytest
from aiohttp.test_utils import TestClient

from nexus import Provider
from nexus.cache.run import StreamRun
from nexus.events import Delta, Error, StreamEvent
from nexus.providers.exchange import UpstreamExchange
from nexus.server.state import HUB
from nexus.stream import Stream
from support import MakeClient, parse_sse
from upstreams import DONE, FakeUpstream, Reply, openai_chunk, openai_usage_chunk, sse

Client = TestClient[Any, Any]
MODEL = "up/gpt-up"
GAP = 0.01
"""Between two writes of the upstream: each arrives as a socket read of its own."""


def push_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """The run pulls every read, as it does when its source cannot push."""
    monkeypatch.setattr(Stream, "push_to", lambda self, sink: None)


def count_pulls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """``[n]``: how many times ``UpstreamExchange.__anext__`` ran (a pull per read without push)."""
    calls = [0]
    original = UpstreamExchange.__anext__

    async def counted(self: UpstreamExchange) -> Any:
        calls[0] += 1
        return await original(self)

    monkeypatch.setattr(UpstreamExchange, "__anext__", counted)
    return calls


async def gateway(make: MakeClient, fake: FakeUpstream, options: Any = None, **config: Any) -> Any:
    up = {"kind": "openai", "base_url": fake.url + "/v1", **(options or {})}
    return await make({"providers": {"up": up}, **config})


def body(model: str = MODEL, **extra: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": "Hi"}]
    return {"model": model, "messages": messages, "stream": True, **extra}


def text(*parts: str) -> list[bytes]:
    return [openai_chunk(role="assistant", content=""), *(openai_chunk(content=p) for p in parts)]


STOP = openai_chunk(finish_reason="stop")
USAGE = {"prompt_tokens": 11, "completion_tokens": 9, "total_tokens": 20}
PRICES = {MODEL: {"input_usd_per_mtok": 3.0, "output_usd_per_mtok": 15.0}}
INCLUDE = {"stream_options": {"include_usage": True, "include_cost": True}}
NAMED = [{"index": 0, "id": "call_0", "type": "function", "function": {"name": "get_weather"}}]
TOOL_CALLS = [
    openai_chunk(role="assistant", content=None),
    openai_chunk(tool_calls=NAMED),
    openai_chunk(tool_calls=[{"index": 0, "function": {"arguments": '{"a":'}}]),
    openai_chunk(tool_calls=[{"index": 0, "function": {"arguments": "1}"}}]),
    openai_chunk(finish_reason="tool_calls"),
    DONE,
]
OVERLOADED = sse({"error": {"message": "Busy.", "type": "server_error", "code": "overloaded"}})

SCENARIOS: dict[str, tuple[list[bytes], dict[str, Any]]] = {
    # name: (the upstream's writes, {"end": of its reply, "up": provider options,
    #        "request": body fields, anything else: gateway config})
    "content": ([*text("Hel", "lo ", "wor", "ld"), STOP, DONE], {}),
    "tool_calls": (TOOL_CALLS, {}),
    "priced_usage": (
        [*text("a ", "b ", "c"), STOP, openai_usage_chunk(USAGE), DONE],
        {"models": PRICES, "request": INCLUDE},
    ),
    "error_in_stream": ([*text("so ", "far"), OVERLOADED, openai_chunk(content="never"), DONE], {}),
    "no_done": ([*text("cut ", "short"), STOP], {}),
    "too_large": (
        [*text(*(f"{n:02d}" + "x" * 60 for n in range(12))), STOP, DONE],
        {"streams": {"max_log_bytes": 700}},
    ),
    "idle_timeout": (text("then ", "silence"), {"end": "stall", "up": {"idle_timeout_s": 0.3}}),
}

# Access-line fields two identical requests may differ in.
VARYING = ("duration_ms", "ttfb_ms", "ttft_ms", "pool_wait_ms", "stream_id", "client")


async def access_line(caplog: pytest.LogCaptureFixture, request_id: str) -> dict[str, Any]:
    for _ in range(500):
        for record in caplog.records:
            if record.name == "nexus.access" and record.request_id == request_id:  # type: ignore[attr-defined]
                fields: dict[str, Any] = record.access  # type: ignore[attr-defined]
                return {k: v for k, v in fields.items() if k not in VARYING}
        await asyncio.sleep(0.01)
    raise AssertionError(f"no access line for {request_id}")


async def counters(client: Client) -> dict[str, float]:
    """The app's counters (``/metrics``), by sample."""
    scraped = (await (await client.get("/metrics")).text()).splitlines()
    samples = (line.rpartition(" ") for line in scraped if line.startswith("nexus_"))
    return {name: float(value) for name, _, value in samples if "_total" in name}


async def exchange(
    client: Client, fmt: str, request: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> tuple[int, str, str, dict[str, Any]]:
    """One request: its status, type, body (ids and times normalised) and access line."""
    query = "?stream_format=ndjson" if fmt == "ndjson" else ""
    resp = await client.post("/v1/chat/completions" + query, json=request)
    raw = (await asyncio.wait_for(resp.read(), 10)).decode()
    for name in ("X-Nexus-Stream-Id", "X-Request-Id"):
        raw = raw.replace(resp.headers[name], f"<{name}>")
    raw = re.sub(r'"created":\d+', '"created":0', raw)
    line = await access_line(caplog, resp.headers["X-Request-Id"])
    return resp.status, resp.content_type, raw, line


async def twice(client: Client, monkeypatch: pytest.MonkeyPatch, send: Any) -> list[Any]:
    """What ``send()`` gave pushed, then pulled, each with what it added to the counters."""
    outcomes = []
    for _ in range(2):
        before = await counters(client)
        outcome = await send()
        moved = {k: round(v - before.get(k, 0.0), 9) for k, v in (await counters(client)).items()}
        outcomes.append((outcome, {k: v for k, v in moved.items() if v}))
        push_off(monkeypatch)
    return outcomes


@pytest.mark.parametrize("fmt", ["sse", "ndjson"])
@pytest.mark.parametrize("name", list(SCENARIOS))
async def test_a_pushed_stream_gives_what_a_pulled_one_does(
    make_client: MakeClient,
    oai: FakeUpstream,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    name: str,
    fmt: str,
) -> None:
    """The same upstream reads, pushed then pulled, make the same response, access line
    (outcome, events, bytes, tokens, cost) and counters: the push path logs, prices,
    ends on an upstream's error, a cut body, the log's limit and silence as the pull
    path does. The pushed one must have pushed (fewer pulls), or this holds nothing."""
    caplog.set_level(logging.INFO, logger="nexus.access")
    chunks, config = SCENARIOS[name]
    config = dict(config)
    end, request = config.pop("end", "eof"), body(**config.pop("request", {}))
    client = await gateway(make_client, oai, config.pop("up", None), **config)
    pulls, starts = count_pulls(monkeypatch), []

    async def send() -> Any:
        oai.add(Reply.stream(chunks, delay=GAP, end=end))
        starts.append(pulls[0])
        return await exchange(client, fmt, request, caplog)

    pushed, pulled = await twice(client, monkeypatch, send)
    assert pushed == pulled
    assert starts[1] < pulls[0] - starts[1]  # fewer pulls: it was pushed


class Pushing(Provider):
    """Its own batches (one stream at a time), pushing as ``UpstreamExchange``'s do: the first read
    pulled, the rest pushed from loop callbacks while the sink takes them (``pushed``)."""

    kind = "pushing"

    def __init__(self, reads: list[list[StreamEvent]]) -> None:
        super().__init__("push")
        self.script, self.reads, self.pushed = reads, deque[list[StreamEvent]](), 0

    def batches(self, request: Any, model: str) -> Any:
        self.reads = deque(list(read) for read in self.script)
        return self

    async def __anext__(self) -> list[StreamEvent]:
        if not self.reads:
            raise StopAsyncIteration
        return self.reads.popleft()

    def push_to(self, sink: Callable[[list[StreamEvent]], bool]) -> asyncio.Future[None]:
        loop = asyncio.get_running_loop()
        stopped = loop.create_future()

        def step() -> None:
            if stopped.done():
                return
            if self.reads:
                self.pushed += 1
                if sink(self.reads.popleft()):
                    loop.call_later(GAP, step)
                    return
            stopped.set_result(None)

        loop.call_later(GAP, step)
        return stopped

    async def aclose(self) -> None:
        self.reads.clear()


async def test_a_pushed_batch_with_an_error_is_left_to_the_routed_read(
    make_client: MakeClient, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``RoutedRun.push_to`` leaves a batch with an ``Error`` to ``__anext__``, which cuts it
    there and counts the failed attempt (``nexus_upstream_errors``), as when pulled. An
    HTTP provider's decoder raises its errors (never pushed): a provider of its own does."""
    caplog.set_level(logging.INFO, logger="nexus.access")
    failed = Error(error_type="server_error", message="overloaded", code="overloaded")
    cut: list[StreamEvent] = [Delta(content="c"), failed, Delta(content="x")]
    provider = Pushing([[Delta(content="a")], [Delta(content="b")], cut, [Delta(content="y")]])
    client = await make_client(providers=[provider])
    pushed, pulled = await twice(
        client, monkeypatch, lambda: exchange(client, "sse", body(model="push/m"), caplog)
    )
    assert pushed == pulled
    assert provider.pushed == 2  # both pushed batches were in the first request
    assert 'upstream_errors_total{code="overloaded",provider="push"}' in str(pushed[1])


async def test_a_failure_of_the_pushed_to_reader_is_its_own_not_the_providers(
    make_client: MakeClient, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A bug in the run's own logging of a pushed read raised inside the socket's callback,
    and was logged and counted as the provider's ("provider ... raised")."""
    real = StreamRun._take
    taken: list[int] = []

    def failing(self: StreamRun, batch: list[StreamEvent]) -> bool:
        taken.append(len(batch))
        if len(taken) == 2:  # the first pushed read
            raise RuntimeError("the run's own bug")
        return real(self, batch)

    monkeypatch.setattr(StreamRun, "_take", failing)
    provider = Pushing([[Delta(content="a")], [Delta(content="b")], [Delta(content="c")]])
    client = await make_client(providers=[provider])
    async with asyncio.timeout(5):
        resp = await client.post(
            "/v1/chat/completions?stream_format=ndjson", json=body(model="push/m")
        )
        lines = [orjson.loads(line) for line in (await resp.read()).splitlines()]
    assert any("internal_error" in str(line) for line in lines), lines
    assert provider.pushed == 1
    failed = [r for r in caplog.records if r.getMessage().startswith("stream ")]
    assert failed and failed[0].name == "nexus.streams" and "failed" in failed[0].getMessage()
    assert not [r for r in caplog.records if "raised" in r.getMessage()]


def words(count: int) -> list[str]:
    return [f"w{n} " for n in range(count)]


CHUNKS: list[str] = []


class ChunkSeen:
    """A plugin with a chunk hook: each chunk's kind into ``CHUNKS``."""

    async def on_chunk_received(self, ctx: Any, request_id: str, kind: str, size: int) -> None:
        CHUNKS.append(kind)


async def read_text(client: Client, fake: FakeUpstream, parts: list[str]) -> str:
    """The content of a stream of ``parts``, one upstream write each."""
    fake.add(Reply.stream([*text(*parts), STOP, DONE], delay=0.003))
    resp = await client.post("/v1/chat/completions?stream_format=ndjson", json=body())
    lines = (await asyncio.wait_for(resp.read(), 10)).decode().splitlines()
    assert lines[-2:] == ['{"type":"delta","delta":{},"finish_reason":"stop"}', '{"type":"done"}']
    return "".join(orjson.loads(line)["delta"].get("content", "") for line in lines[:-2])


async def test_a_stream_under_way_is_pushed_not_pulled_read_by_read(
    make_client: MakeClient, oai: FakeUpstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    """50 reads reach the client whole with ``UpstreamExchange.__anext__`` called a handful of
    times (the first read, the end): the rest were pushed from the socket's callback.
    Without push, the same stream takes a pull per read: what the count tells."""
    client = await gateway(make_client, oai)
    pulls = count_pulls(monkeypatch)
    assert await read_text(client, oai, words(50)) == "".join(words(50))
    pushed, pulls[0] = pulls[0], 0
    push_off(monkeypatch)
    assert await read_text(client, oai, words(50)) == "".join(words(50))
    assert pushed <= 4, pushed
    assert pulls[0] >= 25, pulls[0]


async def test_chunk_hooks_keep_the_pull_path_and_see_every_chunk(
    make_client: MakeClient, oai: FakeUpstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunk hook is awaited before each read is logged, which a socket's callback
    cannot do: with one, the run pulls every read, and the hook sees each chunk."""
    CHUNKS.clear()
    plugins = [{"path": f"{__name__}:ChunkSeen"}]
    client = await gateway(make_client, oai, plugins=plugins)
    pulls = count_pulls(monkeypatch)
    assert await read_text(client, oai, words(50)) == "".join(words(50))
    assert pulls[0] >= 25, pulls[0]
    assert CHUNKS == ["delta"] * 51, CHUNKS  # 50 words, the finish


async def test_a_client_leaving_a_pushed_stream_closes_its_upstream_at_once(
    make_client: MakeClient, oai: FakeUpstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No task reads the stream while it is pushed: the client's leaving must still end
    the run (client_disconnect, no task left) and drop the upstream's connection within
    a second, not let it generate to its end for nobody."""
    oai.add(Reply.stream([*text(*words(400)), STOP, DONE], delay=GAP))  # 4 s of words
    client = await gateway(make_client, oai)
    pulls = count_pulls(monkeypatch)
    resp = await client.post("/v1/chat/completions?stream_format=ndjson", json=body())
    run = client.app[HUB].live[resp.headers["X-Nexus-Stream-Id"]]
    for _ in range(10):
        await asyncio.wait_for(resp.content.readline(), 5)
    assert pulls[0] <= 2  # being pushed
    left = asyncio.get_running_loop().time()
    resp.close()
    upstream = oai.requests[0]
    assert await upstream.wait_ended(5) - left < 1.0
    assert upstream.cancelled and upstream.chunks_sent < 200
    await asyncio.wait_for(run.wait(), 1)
    assert isinstance(end := run.events[-1], Error) and end.code == "client_disconnect"
    await asyncio.sleep(0.05)
    assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("nexus-stream")]
    assert not client.app[HUB].live


async def test_a_second_reader_of_a_pushed_stream_gets_what_the_first_gets(
    make_client: MakeClient, oai: FakeUpstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader that attaches mid-stream (``GET /v1/streams/{id}``) reads the log so far,
    then is pushed to beside the first: both get every event once, in order, with the
    same ids; one resuming from the first's 5th event id (``Last-Event-ID``) gets the
    rest of what the first got."""
    oai.add(Reply.stream([*text(*words(60)), STOP, DONE], delay=GAP))
    client = await gateway(make_client, oai)
    pulls = count_pulls(monkeypatch)
    nexus = "?stream_format=nexus"
    first = await client.post(
        "/v1/chat/completions" + nexus, json=body(stream_options={"resumable": True})
    )
    path = f"/v1/streams/{first.headers['X-Nexus-Stream-Id']}{nexus}"
    head = b""
    while head.count(b"event: delta") < 10:
        head += await asyncio.wait_for(first.content.readuntil(b"\n\n"), 5)
    early = [e.id for e in parse_sse(head) if e.event == "delta"][4]
    second = await client.get(path)
    resumed = await client.get(path, headers={"Last-Event-ID": early})
    bodies = await asyncio.wait_for(asyncio.gather(first.read(), second.read(), resumed.read()), 10)
    full, two, three = (
        [(e.id, e.event, e.data) for e in parse_sse(b)] for b in (head + bodies[0], *bodies[1:])
    )
    assert pulls[0] <= 3  # it was pushed
    assert two == full
    assert three == full[[i for i, _, _ in full].index(early) + 1 :]
    content = "".join(
        orjson.loads(d)["delta"].get("content", "") for _, e, d in full if e == "delta"
    )
    assert content == "".join(words(60)) and full[-1][1] == "done"
