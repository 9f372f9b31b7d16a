"""The pump's push (written in the producer's task) leaves no orphaned drain waiter behind."""

from __future__ import annotations

import asyncio
import gc
from typing import Any, ClassVar

from aiohttp.base_protocol import BaseProtocol

from nexus.encoders.openai_sse import OpenAISSEEncoder
from nexus.events import Delta
from nexus.server.render import Renderer
from nexus.server.streaming import StreamPump
from nexus.types import StreamMeta
from nexus.watchdog import Watchdog


async def test_a_push_that_fills_the_socket_leaves_no_unretrieved_error_on_a_reset() -> None:
    """A push whose write pauses the socket closes aiohttp's write coroutine at its drain
    wait; the drain future stays with the protocol. When the client then resets the
    connection, aiohttp sets ConnectionError on that future: nobody awaits it, so asyncio
    logs "Future exception was never retrieved" at ERROR, once per such client."""
    loop = asyncio.get_running_loop()
    reported: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: reported.append(context))

    class Transport:
        def get_write_buffer_size(self) -> int:
            return 1 << 20

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
    assert pump._push([Delta("hi")])  # taken: written, the drain left to the next write
    protocol.connection_lost(ConnectionResetError("reset by peer"))  # the client resets
    await asyncio.sleep(0)
    gc.collect()
    await asyncio.sleep(0)
    loop.set_exception_handler(None)
    assert not [c for c in reported if "never retrieved" in str(c.get("message"))], reported
