"""A turn written from the producer's task (the reader's sink) sends what its own task
would: held to the general path, a compressing connection's, which is never pushed to."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncGenerator, Iterator

import orjson
import websockets
from aiohttp import WSMsgType
from aiohttp.http_websocket import WebSocketWriter
from aiohttp.test_utils import TestServer
from hypothesis import given, settings
from hypothesis import strategies as st

from nexus.config import parse_config
from nexus.encoders.registry import default_registry
from nexus.engine import Engine
from nexus.events import Delta, StreamEvent
from nexus.protocol.websocket_frames import text_frames
from nexus.providers.base import Provider
from nexus.request import ChatRequest
from nexus.server.app import create_app
from nexus.server.routes.realtime import RealtimeConnection
from nexus.server.state import RUNTIME
from support import turn


class FedProvider(Provider):
    """Yields the batches the test puts in its queue, until None."""

    kind = "fed"

    def __init__(self) -> None:
        super().__init__("fed")
        self.queue: asyncio.Queue[list[StreamEvent] | None] = asyncio.Queue()

    async def batches(
        self, request: ChatRequest, model: str
    ) -> AsyncGenerator[list[StreamEvent], None]:
        while (batch := await self.queue.get()) is not None:
            yield batch


def start(model: str) -> str:
    request = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    return orjson.dumps({"type": "start", "request": request}).decode()


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


@contextlib.contextmanager
def counting_pushes() -> Iterator[list[int]]:
    """Counts the batches written from the producer's task (``RealtimeConnection.write_now``)
    while it lasts: ``[n]``."""
    pushed = [0]
    write_now = RealtimeConnection.write_now

    def counted(self: RealtimeConnection, payloads: list[bytes]) -> None:
        write_now(self, payloads)
        pushed[0] += 1

    RealtimeConnection.write_now = counted  # type: ignore[method-assign]
    try:
        yield pushed
    finally:
        RealtimeConnection.write_now = write_now  # type: ignore[method-assign]


async def frames_of(
    batches: list[list[str]], pauses: list[bool], compression: str | None
) -> tuple[list[object], int]:
    """The frames of one turn fed ``batches`` (a pause: the turn catches up before the
    next), and how many batches were written from the producer's task."""
    provider = FedProvider()
    config = parse_config({"realtime": {"compression": compression is not None}})
    app = create_app(config, engine=Engine([provider]), registry=default_registry.copy())
    with counting_pushes() as pushed:
        async with TestServer(app) as server:
            url = f"ws://{server.host}:{server.port}/v1/realtime"
            async with websockets.connect(url, compression=compression) as ws:
                await ws.send(start(model="fed/m"))
                await settle()
                for texts, pause in zip(batches, pauses, strict=False):
                    provider.queue.put_nowait([Delta(content=text) for text in texts])
                    if pause:
                        await settle()
                provider.queue.put_nowait([Delta(finish_reason="stop")])
                provider.queue.put_nowait(None)
                frames: list[object] = await turn(ws)
    return frames, pushed[0]


@settings(max_examples=25, deadline=None, database=None)
@given(
    batches=st.lists(
        st.lists(st.sampled_from(["a", " b", "ü", '"q"', "x" * 300]), min_size=1, max_size=5),
        max_size=10,
    ),
    pauses=st.lists(st.booleans(), min_size=10, max_size=10),
)
def test_a_pushed_turn_sends_the_frames_of_the_turns_own_task(
    batches: list[list[str]], pauses: list[bool]
) -> None:
    async def both() -> None:
        pushed_frames, pushed = await frames_of(batches, pauses, None)
        general, never = await frames_of(batches, pauses, "deflate")
        assert pushed_frames == general
        assert never == 0  # a compressing connection is written by the turn's task only
        if any(pauses[: len(batches)]):
            assert pushed > 0  # a caught-up turn was written from the producer's task

    asyncio.run(both())


def test_a_pushed_batch_larger_than_the_socket_arrives_whole_and_in_order() -> None:
    """A pushed batch is one transport write, whatever its size; the socket it fills is
    waited for by the turn's next write, through aiohttp."""
    tokens = [f"{i:03d} " + "x" * 4000 for i in range(160)]  # 640 KB against 4 KB buffers

    async def scenario() -> tuple[list[object], int]:
        provider = FedProvider()
        app = create_app(
            parse_config({}), engine=Engine([provider]), registry=default_registry.copy()
        )
        with counting_pushes() as pushed:
            async with TestServer(app) as server:
                sock = socket.socket()
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                sock.connect((server.host, server.port))
                sock.setblocking(False)
                url = f"ws://{server.host}:{server.port}/v1/realtime"
                async with websockets.connect(
                    url, sock=sock, compression=None, max_size=None
                ) as ws:
                    (conn,) = app[RUNTIME].sockets
                    server_sock = conn.request.transport.get_extra_info("socket")
                    server_sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
                    await ws.send(start(model="fed/m"))
                    await settle()
                    provider.queue.put_nowait([Delta(content=text) for text in tokens])
                    await settle()
                    provider.queue.put_nowait([Delta(content=" after")])
                    provider.queue.put_nowait([Delta(finish_reason="stop")])
                    provider.queue.put_nowait(None)
                    frames: list[object] = await turn(ws)
        return frames, pushed[0]

    frames, pushed = asyncio.run(scenario())
    contents = [f["delta"]["content"] for f in frames if f["type"] == "delta" and f["delta"]]  # type: ignore[index]
    assert contents == [*tokens, " after"]
    assert pushed >= 1  # the large batch went out from the producer's task


_SIZES = st.one_of(
    st.sampled_from([0, 1, 125, 126, 127, 65535, 65536, 70_000]), st.integers(0, 70_000)
)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(_SIZES, st.binary(min_size=1, max_size=8)), max_size=4))
def test_text_frames_are_what_aiohttps_writer_writes(shapes: list[tuple[int, bytes]]) -> None:
    """The frames a push writes itself are byte for byte aiohttp's own, frame by frame
    (every length encoding: 7, 16 and 64 bits)."""
    payloads = [(seed * (size // len(seed) + 1))[:size] for size, seed in shapes]
    written: list[bytes] = []

    class Transport:
        def write(self, data: bytes) -> None:
            written.append(bytes(data))

        def writelines(self, data: list[bytes]) -> None:
            written.append(b"".join(data))

        def is_closing(self) -> bool:
            return False

    class Protocol:
        transport = Transport()
        writing_paused = False

    async def aiohttps() -> bytes:
        writer = WebSocketWriter(Protocol(), Protocol.transport, use_mask=False, limit=2**40)  # type: ignore[arg-type]
        for payload in payloads:
            await writer.send_frame(payload, WSMsgType.TEXT)
        return b"".join(written)

    assert text_frames(payloads) == asyncio.run(aiohttps())
