"""``/v1/realtime`` through the real ``websockets`` client, and raw sockets that misbehave."""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import socket
import zlib
from typing import Any

import orjson
import pytest
import websockets

from nexus.protocol.realtime import PENDING_ITEM_BYTES
from nexus.server.state import RUNTIME
from support import GatedProvider, MakeClient, turn
from upstreams import FakeUpstream, Reply, openai_chunk


class TextOnlyProvider(GatedProvider):
    kind = "textonly"


async def connect(make_client: MakeClient, config: dict[str, Any] | None = None, **kw: Any) -> Any:
    client = await make_client(config, **kw)
    url = f"ws://{client.server.host}:{client.server.port}/v1/realtime"
    return client, await websockets.connect(url, max_size=None)


def start(content: str = "hello realtime world", **extra: Any) -> str:
    request: dict[str, Any] = {
        "model": "mock/echo",
        "messages": [{"role": "user", "content": content}],
    }
    request.update(extra)
    return orjson.dumps({"type": "start", "request": request}).decode()


async def test_full_turn(make_client: MakeClient) -> None:
    _, ws = await connect(make_client)
    async with ws:
        await ws.send(start())
        frames = await turn(ws)
    assert [f["type"] for f in frames] == ["delta", "delta", "delta", "delta", "usage", "done"]
    text = "".join(f["delta"].get("content", "") for f in frames if f["type"] == "delta")
    assert text == "hello realtime world"
    assert frames[3] == {"type": "delta", "delta": {}, "finish_reason": "stop"}
    assert frames[-1] == {"type": "done"}


async def test_two_turns_on_one_connection(make_client: MakeClient) -> None:
    _, ws = await connect(make_client)
    async with ws:
        await ws.send(start("first turn"))
        first = await turn(ws)
        await ws.send(
            start("second turn", mock={"reasoning": "hmm", "tool_calls": [{"name": "f"}]})
        )
        second = await turn(ws)
    assert first[-1] == {"type": "done"}
    types = [f["type"] for f in second]
    assert types[0] == "reasoning"
    assert "tool_call" in types
    assert second[-1] == {"type": "done"}


async def test_abort_closes_provider_at_once(make_client: MakeClient) -> None:
    gated = GatedProvider(before=1, after=1)
    _, ws = await connect(make_client, providers=[gated])
    async with ws:
        await ws.send(start(model="gated/slow"))
        first = orjson.loads(await asyncio.wait_for(ws.recv(), 5))
        assert first == {"type": "delta", "delta": {"content": "before0 "}}
        loop = asyncio.get_running_loop()
        sent = loop.time()
        await ws.send('{"type":"abort"}')
        done = orjson.loads(await asyncio.wait_for(ws.recv(), 5))
        assert done == {"type": "done", "aborted": True}
        assert gated.closed.is_set()  # cleaned up before "done" went out
        assert gated.closed_at is not None and gated.closed_at - sent < 0.5
        assert not gated.gate.is_set()
        # The connection stays open for the next turn.
        await ws.send(start("after abort"))
        frames = await turn(ws)
        assert frames[-1] == {"type": "done"}


async def test_image_and_audio_are_routed_to_the_provider(make_client: MakeClient) -> None:
    png = os.urandom(100)
    pcm = os.urandom(48)
    _, ws = await connect(make_client)
    async with ws:
        await ws.send(
            orjson.dumps(
                {"type": "image", "mime_type": "image/png", "b64": base64.b64encode(png).decode()}
            ).decode()
        )
        await ws.send(
            orjson.dumps(
                {
                    "type": "audio_chunk",
                    "format": "pcm16",
                    "b64": base64.b64encode(pcm[:20]).decode(),
                }
            ).decode()
        )
        await ws.send(
            orjson.dumps(
                {
                    "type": "audio_chunk",
                    "format": "pcm16",
                    "b64": base64.b64encode(pcm[20:]).decode(),
                }
            ).decode()
        )
        await ws.send(
            orjson.dumps(
                {"type": "audio_chunk", "format": "mp3", "b64": base64.b64encode(b"mp3!").decode()}
            ).decode()
        )
        await ws.send(start("look and listen"))
        frames = await turn(ws)
        text = "".join(f["delta"].get("content", "") for f in frames if f["type"] == "delta")
        attachments = "[image image/png 100 bytes] [audio pcm16 48 bytes] [audio mp3 4 bytes]"
        assert text == f"look and listen {attachments}"
        # Pending input was consumed by that start.
        await ws.send(start("nothing attached"))
        frames = await turn(ws)
        text = "".join(f["delta"].get("content", "") for f in frames if f["type"] == "delta")
        assert text == "nothing attached"


@pytest.mark.parametrize(
    ("frame", "fragment"),
    [
        ("not json", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        ('{"type": "teleport"}', "unknown envelope type 'teleport'"),
        ('{"kind": "start"}', "needs a 'type'"),
        ('{"type": "audio_chunk", "format": "pcm16"}', "b64"),
        ('{"type": "audio_chunk", "format": "pcm16", "b64": "%%%"}', "not valid base64"),
        ('{"type": "image", "mime_type": "image/png", "b64": "abc"}', "not valid base64"),
        ('{"type": "image", "mime_type": "image/png"}', "exactly one of b64 and url"),
        (b"\x00\x01binary", "binary frames are not accepted"),
    ],
)
async def test_bad_input_gets_an_error_and_the_connection_lives(
    make_client: MakeClient, frame: str | bytes, fragment: str
) -> None:
    _, ws = await connect(make_client)
    async with ws:
        await ws.send(frame)
        error = orjson.loads(await asyncio.wait_for(ws.recv(), 5))
        assert error["type"] == "error"
        assert error["error"]["code"] == "invalid_envelope"
        assert fragment in error["error"]["message"]
        await ws.send(start("still here"))
        assert (await turn(ws))[-1] == {"type": "done"}


async def test_invalid_start_request_names_the_field(make_client: MakeClient) -> None:
    _, ws = await connect(make_client)
    async with ws:
        await ws.send(start(temperature=7))
        error = orjson.loads(await asyncio.wait_for(ws.recv(), 5))
        assert error["error"]["code"] == "invalid_request"
        assert error["error"]["param"] == "request.temperature"
        await ws.send(start(model="nobody/x"))
        error = orjson.loads(await asyncio.wait_for(ws.recv(), 5))
        assert error["error"]["code"] == "model_not_found"
        assert error["error"]["param"] == "request.model"  # as every start field is named
        await ws.send(start("fine"))
        assert (await turn(ws))[-1] == {"type": "done"}


async def test_start_while_streaming_and_abort_while_idle(make_client: MakeClient) -> None:
    gated = GatedProvider(before=1, after=2)
    _, ws = await connect(make_client, providers=[gated])
    async with ws:
        await ws.send('{"type": "abort"}')
        error = orjson.loads(await asyncio.wait_for(ws.recv(), 5))
        assert error["error"]["code"] == "nothing_to_abort"
        await ws.send(start(model="gated/m"))
        assert orjson.loads(await ws.recv())["type"] == "delta"
        await ws.send(start("second"))
        error = orjson.loads(await asyncio.wait_for(ws.recv(), 5))
        assert error["error"]["code"] == "stream_in_progress"
        gated.gate.set()  # the running stream goes on to its end
        frames = await turn(ws)
        assert [f["delta"].get("content") for f in frames if f["type"] == "delta"][:2] == [
            "after0 ",
            "after1 ",
        ]
        assert frames[-1] == {"type": "done"}


async def test_unsupported_input_is_refused_before_streaming(make_client: MakeClient) -> None:
    text_only = TextOnlyProvider("textonly")
    _, ws = await connect(make_client, providers=[text_only])
    async with ws:
        await ws.send(
            '{"type": "image", "mime_type": "image/png", "url": "https://example.com/a.png"}'
        )
        await ws.send(start(model="textonly/m"))
        error = orjson.loads(await asyncio.wait_for(ws.recv(), 5))
        assert error["error"]["code"] == "unsupported_input"
        assert "image" in error["error"]["message"]
        assert not text_only.started.is_set()
        await ws.send(start("and then text"))
        assert (await turn(ws))[-1] == {"type": "done"}


async def test_provider_failure_sends_error_then_1011(
    make_client: MakeClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="nexus")
    _, ws = await connect(make_client)
    await ws.send(start("a b c", mock={"fail_after": 1}))
    frames = await turn(ws)
    assert [f["type"] for f in frames] == ["delta", "error"]
    assert frames[-1]["error"]["code"] == "upstream_error"
    with pytest.raises(websockets.ConnectionClosedError):
        await asyncio.wait_for(ws.recv(), 5)
    assert ws.close_code == 1011
    for _ in range(500):  # the socket's access line, once its handler ended
        lines = [r.access for r in caplog.records if r.name == "nexus.access"]  # type: ignore[attr-defined]
        if lines:
            break
        await asyncio.sleep(0.01)
    # The failure, and no client_disconnect beside it (aiohttp cancels the handler as the
    # connection closes after 1011: no client left).
    assert lines[0]["outcome"] == "mid_stream_error:upstream_error"
    assert lines[0].get("cancelled") is None


async def test_a_provider_failure_before_any_output_refuses_the_start_and_keeps_the_socket(
    make_client: MakeClient, caplog: pytest.LogCaptureFixture
) -> None:
    """As HTTP answers such a request with a status: nothing streamed, the socket is fine
    (it was closed 1011, and its access line said ``mid_stream_error``)."""
    caplog.set_level(logging.INFO, logger="nexus")
    _, ws = await connect(make_client)
    await ws.send(start("a b c", mock={"fail_after": 0}))
    (frame,) = await turn(ws)
    assert (frame["type"], frame["refused"]) == ("error", "start")
    assert frame["error"]["code"] == "upstream_error"
    await ws.send(start("a b c"))
    assert (await turn(ws))[-1] == {"type": "done"}
    await ws.close()
    for _ in range(500):  # the socket's access line, once its handler ended
        lines = [r.access for r in caplog.records if r.name == "nexus.access"]  # type: ignore[attr-defined]
        if lines:
            break
        await asyncio.sleep(0.01)
    assert "mid_stream_error" not in str(lines[-1].get("outcome"))


async def test_message_over_the_limit_closes_1009(
    make_client: MakeClient, caplog: pytest.LogCaptureFixture
) -> None:
    """And the socket's access line says so (``cancelled:protocol_error``, a warning): it
    said ``ok`` at INFO, so oversize or garbage attempts were invisible."""
    caplog.set_level(logging.INFO, logger="nexus")
    _, ws = await connect(make_client, {"realtime": {"max_message_bytes": 1024}})
    await ws.send("x" * 2048)
    with pytest.raises(websockets.ConnectionClosedError):
        await asyncio.wait_for(ws.recv(), 5)
    assert ws.close_code == 1009
    for _ in range(500):  # the access line: once the handler ended
        lines = [r for r in caplog.records if r.name == "nexus.access"]
        if lines:
            break
        await asyncio.sleep(0.01)
    (line,) = lines
    assert line.access["outcome"] == "cancelled:protocol_error"  # type: ignore[attr-defined]
    assert line.levelno == logging.WARNING
    assert any(
        "closed 1009" in r.getMessage() for r in caplog.records if r.name == "nexus.realtime"
    )


async def test_pending_input_over_the_limit(make_client: MakeClient) -> None:
    # The first chunk and what an item counts for fit; the second is a second item.
    limit = 40 + PENDING_ITEM_BYTES + 20
    _, ws = await connect(make_client, {"realtime": {"max_pending_input_bytes": limit}})
    async with ws:
        chunk = base64.b64encode(os.urandom(40)).decode()
        await ws.send(orjson.dumps({"type": "audio_chunk", "format": "wav", "b64": chunk}).decode())
        await ws.send(orjson.dumps({"type": "audio_chunk", "format": "wav", "b64": chunk}).decode())
        error = orjson.loads(await asyncio.wait_for(ws.recv(), 5))
        assert error["error"]["code"] == "input_too_large"
        await ws.send(start("kept"))
        frames = await turn(ws)
        text = "".join(f["delta"].get("content", "") for f in frames if f["type"] == "delta")
        assert text == "kept [audio wav 40 bytes]"


async def test_pings_are_answered_and_keep_the_connection(make_client: MakeClient) -> None:
    _, ws = await connect(make_client, {"server": {"heartbeat_interval_s": 0.1}})
    async with ws:
        pong = await ws.ping()  # client -> server ping is answered too
        await asyncio.wait_for(pong, 5)
        await asyncio.sleep(0.5)  # five server pings, answered by the client library
        await ws.send(start("alive"))
        assert (await turn(ws))[-1] == {"type": "done"}


# --- raw clients: peers that misbehave in ways a client library will not ---


async def _raw_socket(
    client: Any, extensions: str = ""
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection(client.server.host, client.server.port)
    key = base64.b64encode(os.urandom(16)).decode()
    extra = f"Sec-WebSocket-Extensions: {extensions}\r\n" if extensions else ""
    writer.write(
        (
            "GET /v1/realtime HTTP/1.1\r\nHost: localhost\r\n"
            "Upgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n{extra}\r\n"
        ).encode()
    )
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 101")
    assert (b"permessage-deflate" in head) == bool(extensions)
    return reader, writer


def _masked_text(payload: bytes) -> bytes:
    mask = os.urandom(4)
    assert len(payload) < 126
    body = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    return bytes([0x81, 0x80 | len(payload)]) + mask + body


@pytest.mark.parametrize("extensions", ["", "permessage-deflate"])
async def test_server_pings_are_bare_control_frames_and_a_pong_keeps_the_peer(
    make_client: MakeClient, extensions: str
) -> None:
    # Check the bytes aiohttp writes for the gateway's pings. With compression
    # negotiated too, a control frame has RSV1 clear and is never compressed.
    client = await make_client(
        {"server": {"heartbeat_interval_s": 0.1}, "realtime": {"compression": bool(extensions)}}
    )
    reader, writer = await _raw_socket(client, extensions)
    pong = bytes([0x8A, 0x80]) + os.urandom(4)  # masked, no payload
    for _ in range(4):  # four intervals: 0.4 s, far past one pong's deadline (0.05 s)
        assert await asyncio.wait_for(reader.readexactly(2), 5) == b"\x89\x00"
        writer.write(pong)
    writer.write(_masked_text(start("alive").encode()))
    inflate = zlib.decompressobj(-zlib.MAX_WBITS)
    texts: list[bytes] = []
    compressed = 0
    while b'{"type":"done"}' not in texts[-1:]:
        head = await asyncio.wait_for(reader.readexactly(2), 5)
        assert head[1] & 0x80 == 0  # a server's frames are never masked
        size = head[1] & 0x7F
        if size >= 126:
            size = int.from_bytes(await reader.readexactly(2 if size == 126 else 8), "big")
        payload = await reader.readexactly(size)
        if head[0] == 0x89:  # another ping between the turn's frames: still bare
            assert payload == b""
            continue
        assert head[0] & 0x0F == 1 and head[0] & 0x80  # whole text frames
        if head[0] & 0x40:  # RSV1: compressed (RFC 7692 7.2.2)
            compressed += 1
            payload = inflate.decompress(payload + b"\x00\x00\xff\xff")
        texts.append(payload)
    assert b"".join(texts).count(b'"type":"delta"') >= 1
    assert bool(compressed) == bool(extensions)
    writer.close()


async def test_peer_that_ignores_pings_is_closed_and_its_stream_cancelled(
    make_client: MakeClient,
) -> None:
    gated = GatedProvider(before=1, after=1)
    client = await make_client({"server": {"heartbeat_interval_s": 0.2}}, providers=[gated])
    _, writer = await _raw_socket(client)
    writer.write(_masked_text(start("x", model="gated/m").encode()))
    await writer.drain()
    await asyncio.wait_for(gated.started.wait(), 5)
    # Never read, never pong: the server's heartbeat must give up on us.
    await asyncio.wait_for(gated.closed.wait(), 5)
    assert not gated.gate.is_set()
    writer.close()


async def test_vanished_peer_cancels_the_stream(make_client: MakeClient) -> None:
    gated = GatedProvider(before=1, after=1)
    client = await make_client(providers=[gated])
    _, writer = await _raw_socket(client)
    writer.write(_masked_text(start("x", model="gated/m").encode()))
    await writer.drain()
    await asyncio.wait_for(gated.started.wait(), 5)
    loop = asyncio.get_running_loop()
    gone = loop.time()
    writer.transport.abort()  # TCP gone, no close frame
    await asyncio.wait_for(gated.closed.wait(), 5)
    assert gated.closed_at is not None and gated.closed_at - gone < 0.5


@pytest.mark.parametrize("compression", [None, "deflate"])
async def test_a_batch_of_tokens_goes_out_one_text_frame_each(
    make_client: MakeClient, compression: str | None
) -> None:
    # An upstream that writes 300 tokens (some escaped, some long) in one piece: the
    # gateway reads them as one batch and writes their frames together.
    tokens = [f"t{i} " for i in range(300)]
    tokens[7] = 'quote " and \\ and \u00e9 \U0001f600'
    tokens[150] = "x" * 70_000  # a frame with the 64-bit length
    tokens[151] = "y" * 300  # and one with the 16-bit length
    body = b"".join(openai_chunk(content=t) for t in tokens)
    body += openai_chunk(finish_reason="stop") + b"data: [DONE]\n\n"
    async with FakeUpstream(Reply.stream([body])) as upstream:
        provider = {"kind": "openai", "base_url": upstream.url + "/v1"}
        client = await make_client(
            {"providers": {"up": provider}, "realtime": {"compression": compression is not None}}
        )
        url = f"ws://{client.server.host}:{client.server.port}/v1/realtime"
        async with websockets.connect(url, max_size=None, compression=compression) as ws:
            assert (ws.response.headers.get("Sec-WebSocket-Extensions") is not None) == (
                compression is not None
            )
            await ws.send(start(model="up/m"))
            frames = await turn(ws)
    contents = [f["delta"]["content"] for f in frames if f["type"] == "delta" and f["delta"]]
    assert contents == tokens
    assert frames[-2] == {"type": "delta", "delta": {}, "finish_reason": "stop"}
    assert frames[-1] == {"type": "done"}


def turn_tasks() -> list[asyncio.Task[Any]]:
    return [t for t in asyncio.all_tasks() if "Turn." in t.get_coro().__qualname__]  # type: ignore[union-attr]


async def test_a_turn_follows_its_stream_in_one_task_that_ends_with_it(
    make_client: MakeClient,
) -> None:
    gated = GatedProvider(before=1, after=2)
    client, ws = await connect(make_client, providers=[gated])
    async with ws:
        await ws.send(start(model="gated/m"))
        assert orjson.loads(await asyncio.wait_for(ws.recv(), 5))["delta"] == {
            "content": "before0 "
        }
        (conn,) = client.app[RUNTIME].sockets
        assert conn.turn is not None and turn_tasks() == [conn.turn.task]
        gated.gate.set()
        frames = await turn(ws)
        assert [f["delta"].get("content") for f in frames[:2]] == ["after0 ", "after1 "]
        assert frames[-1] == {"type": "done"}
        await asyncio.sleep(0.05)
        assert conn.turn is None and turn_tasks() == []
        # The next turn on the same connection starts as the first did.
        await ws.send(start("again"))
        assert (await turn(ws))[-1] == {"type": "done"}


async def test_a_client_that_stops_reading_gets_every_frame_once_it_reads_again(
    make_client: MakeClient,
) -> None:
    # 2 MB of tokens, far more than the (shrunk) socket buffers hold while the client does
    # not read: the turn waits for the paused socket, then writes the rest.
    tokens = [f"{i:05d} " + "x" * 4090 for i in range(500)]
    pieces = [
        b"".join(openai_chunk(content=t) for t in tokens[i : i + 50])
        for i in range(0, len(tokens), 50)
    ]
    pieces.append(openai_chunk(finish_reason="stop") + b"data: [DONE]\n\n")
    async with FakeUpstream(Reply.stream(pieces)) as upstream:
        provider = {"kind": "openai", "base_url": upstream.url + "/v1"}
        client = await make_client({"providers": {"up": provider}})
        url = f"ws://{client.server.host}:{client.server.port}/v1/realtime"
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect((client.server.host, client.server.port))
        sock.setblocking(False)
        async with websockets.connect(
            url, sock=sock, max_size=None, max_queue=1, compression=None
        ) as ws:
            (conn,) = client.app[RUNTIME].sockets
            server_sock = conn.request.transport.get_extra_info("socket")
            server_sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            await ws.send(start(model="up/m"))
            for _ in range(500):
                if conn.paused:
                    break
                await asyncio.sleep(0.01)
            assert conn.paused, "the socket never filled up"
            assert conn.turn is not None and conn.turn.task is not None
            frames = await turn(ws)
    contents = [f["delta"]["content"] for f in frames if f["type"] == "delta" and f["delta"]]
    assert contents == tokens
    assert frames[-1] == {"type": "done"}


async def test_a_failure_while_writing_from_the_log_ends_the_turn_with_an_error(
    make_client: MakeClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What the turn's rendering raises reaches the client as an error frame and a 1011.
    from nexus.encoders.ndjson import NDJSONEncoder

    def broken(self: NDJSONEncoder, event: object) -> bytes:
        raise RuntimeError("boom")

    monkeypatch.setattr(NDJSONEncoder, "encode", broken)
    client = await make_client()
    url = f"ws://{client.server.host}:{client.server.port}/v1/realtime"
    async with websockets.connect(url, compression=None) as ws:
        await ws.send(start("a b c"))
        frames = await turn(ws)
        assert frames[-1]["type"] == "error"
        assert frames[-1]["error"]["code"] == "internal_error"
        with pytest.raises(websockets.ConnectionClosedError):
            await asyncio.wait_for(ws.recv(), 5)
        assert ws.close_code == 1011
    for _ in range(100):
        if not client.app[RUNTIME].sockets:
            break
        await asyncio.sleep(0.01)
    assert not client.app[RUNTIME].sockets


async def test_a_start_right_after_done_is_not_undone_by_the_ending_turn(
    make_client: MakeClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The ending turn lets the session go when its done frame is on its way; its last
    # steps (the write, the release) run while the next start is being opened. They must
    # not let the session go a second time: a third start would then be accepted and the
    # second turn's stream orphaned, never cancelled.
    from aiohttp import web

    from nexus.cache.hub import StreamHub

    send_str = web.WebSocketResponse.send_str
    open_stream = StreamHub.open

    async def slow_done(self: web.WebSocketResponse, data: str, *a: Any, **kw: Any) -> None:
        await send_str(self, data, *a, **kw)
        if data == '{"type":"done"}':
            await asyncio.sleep(0.2)

    async def slow_open(self: StreamHub, *a: Any, **kw: Any) -> Any:
        await asyncio.sleep(0.3)
        return await open_stream(self, *a, **kw)

    monkeypatch.setattr(web.WebSocketResponse, "send_str", slow_done)
    monkeypatch.setattr(StreamHub, "open", slow_open)
    gated = GatedProvider(before=1, after=1)
    client, ws = await connect(make_client, providers=[gated])
    async with ws:
        await ws.send(start("first"))
        assert (await turn(ws))[-1] == {"type": "done"}
        await ws.send(start("second", model="gated/m"))
        assert orjson.loads(await asyncio.wait_for(ws.recv(), 5))["type"] == "delta"
        (conn,) = client.app[RUNTIME].sockets
        assert conn.session.streaming
        await ws.send(start("third"))
        error = orjson.loads(await asyncio.wait_for(ws.recv(), 5))
        assert error["error"]["code"] == "stream_in_progress"
        await ws.send('{"type": "abort"}')
        assert orjson.loads(await asyncio.wait_for(ws.recv(), 5)) == {
            "type": "done",
            "aborted": True,
        }
    await asyncio.wait_for(gated.closed.wait(), 5)


async def test_a_closed_socket_gives_its_pending_input_back_to_the_allowance(
    make_client: MakeClient,
) -> None:
    # Without keys every connection shares one allowance: room for one chunk here.
    limit = 40 + PENDING_ITEM_BYTES
    client, first = await connect(make_client, {"realtime": {"max_pending_bytes_per_key": limit}})
    url = f"ws://{client.server.host}:{client.server.port}/v1/realtime"
    chunk = orjson.dumps(
        {"type": "audio_chunk", "format": "wav", "b64": base64.b64encode(b"a" * 40).decode()}
    ).decode()
    async with websockets.connect(url) as second:
        await first.send(chunk)
        await first.send(start("sync"))  # the chunk is held once this turn has started
        await turn(first)
        await first.send(chunk)
        await first.send('{"type":"abort"}')  # nothing to abort: an error frame, in order
        await asyncio.wait_for(first.recv(), 5)
        await second.send(chunk)
        refused = orjson.loads(await asyncio.wait_for(second.recv(), 5))
        assert refused["error"]["code"] == "input_too_large"
        await first.close()
        for _ in range(100):  # the gateway sees the close, and lets the first's input go
            await second.send(chunk)
            await second.send('{"type":"abort"}')
            answer = orjson.loads(await asyncio.wait_for(second.recv(), 5))
            if answer["error"]["code"] == "nothing_to_abort":
                break
            await asyncio.wait_for(second.recv(), 5)  # the abort's answer
            await asyncio.sleep(0.02)
        assert answer["error"]["code"] == "nothing_to_abort"  # the chunk was taken


async def test_a_log_that_ends_without_its_end_ends_the_turn_with_an_error(
    make_client: MakeClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A log that stops without its done or error (a store that lost its end): the turn
    used to stop writing and send nothing more, its client waiting for a done forever."""
    from nexus.cache.readers import RunReader

    read = RunReader.__anext__
    reads = 0

    async def ends_after_the_first(self: RunReader) -> Any:
        nonlocal reads
        reads += 1
        if reads > 1:
            raise StopAsyncIteration
        batch = await read(self)
        return [e for e in batch if type(e).__name__ not in ("Done", "Error")] or batch[:1]

    monkeypatch.setattr(RunReader, "__anext__", ends_after_the_first)
    _, ws = await connect(make_client)
    async with ws:
        await ws.send(start("a b c"))
        frames = await turn(ws)
        assert frames[-1]["type"] == "error"
        assert frames[-1]["error"]["code"] == "stream_incomplete"
        monkeypatch.setattr(RunReader, "__anext__", read)
        await ws.send(start("again"))  # the socket is fine: the next turn runs
        assert (await turn(ws))[-1] == {"type": "done"}
