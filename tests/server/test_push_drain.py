"""The pump's push (written in the producer's task): one HTTP chunk, the bytes aiohttp's
chunked writer gives, and no orphaned drain waiter left behind."""

from __future__ import annotations

import asyncio
import gc
from typing import Any, ClassVar

from aiohttp.base_protocol import BaseProtocol
from aiohttp.http_writer import StreamWriter
from hypothesis import given
from hypothesis import strategies as st

from nexus.encoders.openai_sse import OpenAISSEEncoder
from nexus.events import Delta
from nexus.server.chunked import chunk
from nexus.server.render import Renderer
from nexus.server.streaming import StreamPump
from nexus.types import StreamMeta
from nexus.watchdog import Watchdog


async def test_a_push_that_fills_the_socket_leaves_no_unretrieved_error_on_a_reset() -> None:
    """A push whose write pauses the socket must leave no drain future with the protocol
    (a push does not wait): when the client then resets the connection, aiohttp would set
    ConnectionError on it, nobody would await it, and asyncio would log "Future exception
    was never retrieved" at ERROR, once per such client."""
    loop = asyncio.get_running_loop()
    reported: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: reported.append(context))

    written: list[bytes] = []

    class Transport:
        def get_write_buffer_size(self) -> int:
            return 1 << 20

        def write(self, data: bytes) -> None:
            written.append(data)
            protocol.pause_writing()  # this write filled the socket

        def is_closing(self) -> bool:
            return False

    protocol = BaseProtocol(loop)
    protocol.transport = Transport()  # type: ignore[assignment]

    class Response:
        prepared, status = True, 200

        async def write(self, data: bytes) -> None:  # aiohttp's: to the transport, then drain
            protocol.pause_writing()  # this write filled the socket
            await protocol._drain_helper()

    class Request:
        app: ClassVar[dict[str, Any]] = {}
        path = "/v1/chat/completions"

    request = Request()
    request.protocol = protocol  # type: ignore[attr-defined]
    request.transport = protocol.transport  # type: ignore[attr-defined]
    meta = StreamMeta.new("m")

    class Reader:
        pass

    reader: Any = Reader()
    reader.meta = meta
    pump = StreamPump(
        request,  # type: ignore[arg-type]
        reader,
        Renderer(OpenAISSEEncoder(meta), meta.id, ids=False),
        heartbeat_s=15,
        write_timeout_s=30,
        headers={},
        watchdog=Watchdog(),
    )
    pump.response = Response()  # type: ignore[assignment]
    pump._chunked = True  # prepared: the headers said chunked
    assert pump._push([Delta("hi")])  # taken: written, the drain left to the next write
    [one] = written  # one chunk: its size, its data, its end
    size, _, rest = one.partition(b"\r\n")
    assert int(size, 16) == len(rest) - 2 and rest.endswith(b"\n\n\r\n")
    assert not pump._push([Delta("ho")])  # the socket is full: left to the pump's task
    protocol.connection_lost(ConnectionResetError("reset by peer"))  # the client resets
    await asyncio.sleep(0)
    gc.collect()
    await asyncio.sleep(0)
    loop.set_exception_handler(None)
    assert not [c for c in reported if "never retrieved" in str(c.get("message"))], reported


@given(st.binary(min_size=1, max_size=70_000))
def test_a_pushed_chunk_is_what_aiohttps_chunked_writer_writes(data: bytes) -> None:
    loop = asyncio.new_event_loop()
    try:
        out: list[bytes] = []

        class Transport:
            def is_closing(self) -> bool:
                return False

            def write(self, piece: bytes) -> None:
                out.append(bytes(piece))

            def writelines(self, pieces: list[bytes]) -> None:
                out.extend(bytes(piece) for piece in pieces)

        protocol = BaseProtocol(loop)
        protocol.transport = Transport()  # type: ignore[assignment]
        writer = StreamWriter(protocol, loop)
        writer.enable_chunking()
        loop.run_until_complete(writer.write(data, drain=False))
        assert chunk(data) == b"".join(out)
    finally:
        loop.close()
