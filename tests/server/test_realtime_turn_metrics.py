"""Each realtime turn counts in ``nexus_requests_total`` under its model and outcome, and
in the time-to-first-token and duration histograms, as an HTTP stream request does: a
turn cut short is one cancellation of its own cause, one that fails before any output is
``error:<code>`` in its spend line too, its cache lookup counts. ``model="unknown"`` on
``/v1/realtime`` counts the sockets alone (a refused ``start`` without a model the gateway
serves is ``none``), and a socket closed 1011 after a provider failure says so."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import orjson
import pytest
import websockets

from nexus.server.state import RUNTIME
from support import MakeClient, access_record, masked, raw_socket, read_frame, turn
from upstreams import FakeUpstream, Reply, openai_chunk

USER = [{"role": "user", "content": "x"}]
SLOW = {"content": " ".join(["word"] * 200), "delay_ms": 50}  # ten seconds: aborted
REQUESTS = 'nexus_requests_total{endpoint="/v1/realtime",model="%s",outcome="%s"}'
TTFT = 'nexus_time_to_first_token_seconds_count{model="%s"}'
DURATION = 'nexus_stream_duration_seconds_count{model="%s"}'


def start(model: str = "mock/echo", **extra: Any) -> str:
    return orjson.dumps(
        {"type": "start", "request": {"model": model, "messages": USER, **extra}}
    ).decode()


def sample(page: str, name: str) -> float:
    for line in page.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def total(page: str, prefix: str) -> float:
    """The sum of the samples whose line begins with ``prefix``."""
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in page.splitlines() if line.startswith(prefix)
    )


async def metrics_once(client: Any, name: str) -> str:
    """``/metrics`` once ``name`` is counted (polled: turns and sockets count as they end)."""
    page = ""
    for _ in range(1000):
        page = await (await client.get("/metrics")).text()
        if sample(page, name):
            return page
        await asyncio.sleep(0.01)
    raise AssertionError(f"{name} never counted:\n{page}")


async def test_each_turn_is_counted_by_model_and_outcome(make_client: MakeClient) -> None:
    client = await make_client()
    url = f"ws://{client.server.host}:{client.server.port}/v1/realtime"
    async with websockets.connect(url) as ws:
        for _ in range(2):
            await ws.send(start())
            assert (await turn(ws))[-1] == {"type": "done"}
        await ws.send(start(mock=SLOW))
        assert orjson.loads(await ws.recv())["type"] == "delta"
        await ws.send('{"type":"abort"}')
        assert (await turn(ws))[-1] == {"type": "done", "aborted": True}
        await ws.send(start("nope/x"))
        assert (await turn(ws))[-1]["error"]["code"] == "model_not_found"
        await ws.send('{"type":"start","request":{"model":"mock/echo"}}')  # no messages
        assert (await turn(ws))[-1]["error"]["code"] == "invalid_request"
        page = await metrics_once(client, REQUESTS % ("mock/echo", "cancelled:aborted"))
    assert sample(page, REQUESTS % ("mock/echo", "ok")) == 2
    assert sample(page, REQUESTS % ("mock/echo", "cancelled:aborted")) == 1
    # A refused start counts under the model it named when the gateway serves it (it was
    # "none" for an invalid request to mock/echo), else under "none": not among the sockets.
    assert sample(page, REQUESTS % ("none", "error:model_not_found")) == 1
    assert sample(page, REQUESTS % ("mock/echo", "error:invalid_request")) == 1
    assert sample(page, REQUESTS % ("none", "error:invalid_request")) == 0
    # The aborted turn has its first token, not a duration: it says when it was cut.
    assert sample(page, TTFT % "mock/echo") == 3
    assert sample(page, DURATION % "mock/echo") == 2
    page = await metrics_once(client, REQUESTS % ("unknown", "ok"))
    assert total(page, 'nexus_requests_total{endpoint="/v1/realtime",model="unknown"') == 1


CUTS = ["abort", "close", "vanish", "shutdown", "ping_timeout"]


@pytest.mark.parametrize("cut", CUTS)
async def test_a_turn_cut_short_is_one_cancellation_of_its_cause(
    make_client: MakeClient, cut: str
) -> None:
    """Not also ``cancelled`` (its stream let go) nor once more for its socket: the docs'
    ``cancelled`` is a ``DELETE`` or a WebSocket ``abort``."""
    heartbeat = {"server": {"heartbeat_interval_s": 0.2}} if cut == "ping_timeout" else {}
    client = await make_client(heartbeat)
    if cut == "ping_timeout":
        reader, writer = await raw_socket(client)  # never answers a ping
        writer.write(masked(0x1, start(mock=SLOW).encode()))
        assert (await read_frame(reader))[0] == 0x1
        outcome, cause = "cancelled:ping_timeout", "ping_timeout"
    else:
        url = f"ws://{client.server.host}:{client.server.port}/v1/realtime"
        ws = await websockets.connect(url)
        await ws.send(start(mock=SLOW))
        assert orjson.loads(await asyncio.wait_for(ws.recv(), 10))["type"] == "delta"
        outcome, cause = {
            "abort": ("cancelled:aborted", "cancelled"),
            "close": ("cancelled:client_disconnect", "client_disconnect"),
            "vanish": ("cancelled:client_disconnect", "client_disconnect"),
            "shutdown": ("cancelled:shutdown", "shutdown"),
        }[cut]
        if cut == "abort":
            await ws.send('{"type":"abort"}')
            assert (await turn(ws))[-1] == {"type": "done", "aborted": True}
            await ws.close()
        elif cut == "close":
            await ws.close()
        elif cut == "vanish":
            ws.transport.abort()
        else:
            for conn in list(client.app[RUNTIME].sockets):  # as the app's shutdown does
                await asyncio.create_task(conn.shutdown())
    await metrics_once(client, REQUESTS % ("mock/echo", outcome))
    sockets = 'nexus_requests_total{endpoint="/v1/realtime",model="unknown"'
    for _ in range(1000):  # the socket's own line, counted as its handler ends
        page = await (await client.get("/metrics")).text()
        if total(page, sockets):
            break
        await asyncio.sleep(0.01)
    assert total(page, sockets) == 1
    assert total(page, "nexus_cancellations_total") == 1, page
    assert sample(page, f'nexus_cancellations_total{{cause="{cause}"}}') == 1, page
    if cut == "ping_timeout":
        writer.close()


async def test_a_turn_failing_before_output_is_an_error_in_its_spend_line_as_counted(
    make_client: MakeClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="nexus")
    refused = {"error": {"message": "bad param", "type": "invalid_request_error"}}
    async with FakeUpstream(Reply.json(400, refused)) as upstream:
        provider = {"kind": "openai", "base_url": upstream.url + "/v1"}
        client = await make_client({"providers": {"up": provider}})
        url = f"ws://{client.server.host}:{client.server.port}/v1/realtime"
        async with websockets.connect(url) as ws:
            await ws.send(start("up/m"))
            assert (await turn(ws))[-1]["error"]["code"] == "upstream_invalid_request"
            page = await metrics_once(client, REQUESTS % ("up/*", "error:upstream_invalid_request"))
            for _ in range(1000):
                lines = [r.access for r in caplog.records if r.name == "nexus.spend"]  # type: ignore[attr-defined]
                if lines:
                    break
                await asyncio.sleep(0.01)
    (line,) = lines
    assert line["outcome"] == "error:upstream_invalid_request"
    assert 'outcome="mid_stream_error' not in page
    assert (sample(page, TTFT % "up/*"), sample(page, DURATION % "up/*")) == (0, 0)


async def test_a_socket_closed_1011_after_a_provider_failure_says_so(
    make_client: MakeClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="nexus.access")
    async with FakeUpstream(Reply.stream([openai_chunk(content="Hi")], end="abort")) as upstream:
        provider = {"kind": "openai", "base_url": upstream.url + "/v1"}
        client = await make_client({"providers": {"up": provider}})
        url = f"ws://{client.server.host}:{client.server.port}/v1/realtime"
        async with websockets.connect(url) as ws:
            await ws.send(start("up/m"))
            assert (await turn(ws))[-1]["error"]["code"] == "upstream_disconnect"
            with pytest.raises(websockets.ConnectionClosedError) as closed:
                await asyncio.wait_for(ws.recv(), 10)
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 1011
        record = await access_record(caplog)
    assert record.levelno == logging.WARNING
    assert record.access["outcome"] == "mid_stream_error:upstream_disconnect"  # type: ignore[attr-defined]
    page = await metrics_once(
        client, REQUESTS % ("unknown", "mid_stream_error:upstream_disconnect")
    )
    assert sample(page, REQUESTS % ("unknown", "ok")) == 0


async def test_a_turns_cache_lookup_counts_and_its_replay_is_not_timed(
    make_client: MakeClient,
) -> None:
    client = await make_client({"cache": {"enabled": True}})
    url = f"ws://{client.server.host}:{client.server.port}/v1/realtime"
    async with websockets.connect(url) as ws:
        for _ in range(2):
            await ws.send(start())
            assert (await turn(ws))[-1] == {"type": "done"}
        page = await metrics_once(client, REQUESTS % ("mock/echo", "ok"))
        for _ in range(1000):  # the second turn counts as its task ends
            if sample(page, REQUESTS % ("mock/echo", "ok")) == 2:
                break
            await asyncio.sleep(0.01)
            page = await (await client.get("/metrics")).text()
    assert sample(page, 'nexus_cache_total{result="miss"}') == 1
    assert sample(page, 'nexus_cache_total{result="hit"}') == 1
    assert (sample(page, TTFT % "mock/echo"), sample(page, DURATION % "mock/echo")) == (1, 1)


EVENTS = 'nexus_events_out_total{format="websocket"}'
BYTES = 'nexus_bytes_out_total{format="websocket"}'


async def frames_of_turn(ws: Any) -> list[str]:
    """The text frames of one turn, as the client got them, through its done or error."""
    frames = []
    while True:
        frame = await asyncio.wait_for(ws.recv(), 10)
        frames.append(frame)
        if orjson.loads(frame)["type"] in ("done", "error"):
            return frames


async def counted(client: Any, events: int) -> str:
    """``/metrics`` once ``events`` turn frames are counted (or after ten seconds)."""
    page = ""
    for _ in range(1000):
        page = await (await client.get("/metrics")).text()
        if sample(page, EVENTS) >= events:
            return page
        await asyncio.sleep(0.01)
    return page


async def test_a_turns_frames_count_in_the_events_and_bytes_out(make_client: MakeClient) -> None:
    """Each frame of a turn's stream once (its events, its done or error frame, an abort's
    done), its payload's bytes, under ``format="websocket"`` as the socket's access line says;
    a refused ``start``'s error frame is no stream's, as an HTTP error status is none."""
    client = await make_client()
    url = f"ws://{client.server.host}:{client.server.port}/v1/realtime"
    sent: list[str] = []
    async with websockets.connect(url) as ws:
        for content in ("one two three", {"content": "a b c d e f g h", "delay_ms": 5}):
            await ws.send(start(mock=content) if isinstance(content, dict) else start())
            sent += await frames_of_turn(ws)
        await ws.send(start(mock=SLOW))
        sent.append(await ws.recv())
        await ws.send('{"type":"abort"}')
        sent += await frames_of_turn(ws)
        assert orjson.loads(sent[-1]) == {"type": "done", "aborted": True}
        await ws.send(start("nope/x"))
        assert (await turn(ws))[-1]["error"]["code"] == "model_not_found"  # not counted
        page = await counted(client, len(sent))
    assert sample(page, EVENTS) == len(sent)
    assert sample(page, BYTES) == sum(len(frame.encode()) for frame in sent)
    assert 'format="application/x-ndjson"' not in page  # the HTTP format's counters


async def test_a_running_turns_frames_count_at_the_watchdogs_tick(
    make_client: MakeClient,
) -> None:
    """Not only at its end: a long turn's frames are counted while it runs."""
    client = await make_client({"server": {"heartbeat_interval_s": 1.0}})  # a tick: 0.25 s
    url = f"ws://{client.server.host}:{client.server.port}/v1/realtime"
    async with websockets.connect(url) as ws:
        await ws.send(start(mock=SLOW))
        got = [await asyncio.wait_for(ws.recv(), 10) for _ in range(3)]
        page = await counted(client, len(got))
        assert sample(page, EVENTS) >= len(got)
        assert sample(page, BYTES) >= sum(len(frame.encode()) for frame in got)


async def test_the_sockets_access_line_carries_its_turns_frames_as_counted(
    make_client: MakeClient, caplog: pytest.LogCaptureFixture
) -> None:
    """An HTTP stream's access line says what it wrote (``events``, ``bytes``); a socket's
    said nothing of its turns' frames. It has them now, summed over the socket's life, the
    same totals the counters got; a turn's spend line is its stream's spend, as an HTTP
    stream's is, and has none (what one reader was sent is its access line's)."""
    caplog.set_level(logging.INFO, logger="nexus")
    client = await make_client(
        {"models": {"mock/echo": {"input_usd_per_mtok": 1, "output_usd_per_mtok": 1}}}
    )
    url = f"ws://{client.server.host}:{client.server.port}/v1/realtime"
    sent: list[str] = []
    async with websockets.connect(url) as ws:
        for content in ("one two three", "four five"):
            await ws.send(start(mock={"content": content}))
            sent += await frames_of_turn(ws)
        await ws.send(start(mock=SLOW))
        sent.append(await ws.recv())
        await ws.send('{"type":"abort"}')
        sent += await frames_of_turn(ws)
        await ws.send(start("nope/x"))  # refused: no stream's frame, not counted
        assert (await turn(ws))[-1]["error"]["code"] == "model_not_found"
    fields = (await access_record(caplog)).access  # type: ignore[attr-defined]
    page = await counted(client, len(sent))
    assert (fields["format"], fields["refused"]) == ("websocket", 1)
    assert fields["events"] == len(sent) == sample(page, EVENTS)
    assert fields["bytes"] == sum(len(frame.encode()) for frame in sent) == sample(page, BYTES)
    for _ in range(1000):  # each turn that made its stream: a spend line, as it ends
        spends = [r.access for r in caplog.records if r.name == "nexus.spend"]  # type: ignore[attr-defined]
        if len(spends) == 3:
            break
        await asyncio.sleep(0.01)
    assert len(spends) == 3
    assert all("events" not in line and "bytes" not in line for line in spends)


async def test_a_socket_without_a_turn_sent_no_frame_and_says_so(
    make_client: MakeClient, caplog: pytest.LogCaptureFixture
) -> None:
    """Once open, a socket writes frames (as a stream request writes its body): zero of
    each, not nothing, for one that never streamed; a refused handshake has no frames."""
    caplog.set_level(logging.INFO, logger="nexus.access")
    client = await make_client()
    url = f"ws://{client.server.host}:{client.server.port}/v1/realtime"
    async with websockets.connect(url) as ws:
        await ws.send('{"type":"abort"}')  # nothing to abort: no frame of a turn
        await asyncio.sleep(0.1)
    fields = (await access_record(caplog)).access  # type: ignore[attr-defined]
    assert (fields["status"], fields["events"], fields["bytes"]) == (101, 0, 0)
    caplog.clear()
    assert (await client.get("/v1/realtime")).status == 400  # no upgrade asked: no socket
    fields = (await access_record(caplog)).access  # type: ignore[attr-defined]
    assert (fields["status"], fields["events"], fields["bytes"]) == (400, None, None)
