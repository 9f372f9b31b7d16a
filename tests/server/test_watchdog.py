"""One watchdog task for every response: heartbeats and stalls without a task per stream."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from typing import Any, ClassVar

import pytest

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


async def test_a_heartbeat_due_as_a_big_write_begins_does_not_split_its_frame() -> None:
    # The tick finds a heartbeat due in the loop turn a batch larger than a write slice
    # arrives; the heartbeat task runs once the first slice waits on a slow client: it
    # must not go out between two slices of one frame.
    from nexus.encoders.openai_sse import OpenAISSEEncoder
    from nexus.events import Delta, Done
    from nexus.server.render import Renderer
    from nexus.server.streaming import WRITE_SLICE, StreamPump
    from nexus.types import StreamMeta

    class Reader:
        cancel_safe = True  # a queue's get

        def __init__(self, meta: StreamMeta) -> None:
            self.meta, self.failure = meta, None
            self.served, self.spend, self.run = meta, None, None
            self.queue: asyncio.Queue[Any] = asyncio.Queue()

        def __aiter__(self) -> Reader:
            return self

        async def __anext__(self) -> Any:
            item = await self.queue.get()
            if item is None:
                raise StopAsyncIteration
            return item

        async def close(self, failed: Any = None) -> None:
            pass

        async def settled_spend(self, wait_s: float) -> None:
            return None

    class Transport:
        def get_write_buffer_size(self) -> int:
            return 0

    class Protocol:
        writing_paused = False

    class Request:
        app: ClassVar[dict[str, Any]] = {}
        path = "/v1/chat/completions"
        transport = Transport()
        protocol = Protocol()

    class Response:
        prepared, status = True, 200

        def __init__(self) -> None:
            self.writes: list[bytes] = []
            self.gate = asyncio.Event()
            self.gate.set()

        async def write(self, data: bytes) -> None:
            self.writes.append(bytes(data))
            if len(data) == WRITE_SLICE:
                await self.gate.wait()  # a slow client: the slice waits for the socket

        async def write_eof(self, data: bytes = b"") -> None:  # the last bytes, then the end
            self.writes.append(bytes(data))

    meta = StreamMeta.new("m")
    reader = Reader(meta)
    renderer = Renderer(OpenAISSEEncoder(meta), meta.id, ids=False)
    pump = StreamPump(
        Request(),  # type: ignore[arg-type]
        reader,
        renderer,
        heartbeat_s=15,
        write_timeout_s=30,
        headers={},
        watchdog=Watchdog(),
    )
    response = Response()
    pump.response = response  # type: ignore[assignment]
    task = asyncio.create_task(pump.run())
    reader.queue.put_nowait([Delta("hi")])
    for _ in range(5):
        await asyncio.sleep(0)
    pump._last_write -= 20  # idle past the heartbeat interval
    response.gate.clear()
    reader.queue.put_nowait([Delta("x" * 200_000)])
    pump.check(asyncio.get_running_loop().time())  # the tick, in the same loop turn
    for _ in range(5):
        await asyncio.sleep(0)
    response.gate.set()
    reader.queue.put_nowait([Done()])
    await asyncio.wait_for(task, 5)
    body = b"".join(response.writes)
    start = body.index(b'"content":"xxxx')
    assert b": ping" not in body[start : body.index(b"\n\n", start)], "inside the frame"
    assert body.endswith(b"data: [DONE]\n\n")


@pytest.mark.skipif(sys.platform != "linux", reason="the kernel's queue is asked of Linux only")
async def test_a_reader_draining_the_kernel_s_queue_is_not_stalled() -> None:
    """A slow reader drains the kernel's send queue first; the transport's buffer moves only
    once that queue has room. Its progress there is progress: the write is not stalled."""
    import socket

    from nexus.server.connection import kernel_queued
    from nexus.server.writer import Writer

    listener = socket.create_server(("127.0.0.1", 0))
    sender = socket.create_connection(listener.getsockname())
    receiver, _ = listener.accept()
    listener.close()
    sender.setblocking(False)
    try:
        with contextlib.suppress(BlockingIOError):
            while True:  # fill the kernel's queue: the peer reads nothing yet
                sender.send(b"x" * 65536)
        queued = kernel_queued(FakeTransport(sender))
        assert queued > 65536

        class Request:
            transport = FakeTransport(sender)
            protocol = type("Paused", (), {"writing_paused": True})()

        class Pump(Writer):
            async def _heartbeat(self) -> None:
                pass

        pump = Pump(Request(), heartbeat_s=15, write_timeout_s=1, watchdog=Watchdog())  # type: ignore[arg-type]
        assert pump._stalled_for(100.0) == 0.0  # full from now on
        assert pump._stalled_for(100.5) == 0.5  # nothing taken
        receiver.recv(32768)  # the reader takes some: the queue shrinks, the buffer does not
        await asyncio.sleep(0.05)  # the peer's window opens, the kernel sends on
        assert kernel_queued(Request.transport) < queued
        assert pump._stalled_for(101.5) == 0.0, "progress in the kernel's queue is progress"
        assert pump._stalled_for(102.5) == 1.0  # and nothing since
        # The connections no pump times are judged on the same sum.
        from nexus.server.connection import Connection

        conn = Connection.__new__(Connection)
        conn.wire = Request.transport  # type: ignore[assignment]
        before = conn.write_buffer_size()
        assert before == 65536 + kernel_queued(Request.transport)
        receiver.recv(32768)
        await asyncio.sleep(0.05)
        assert conn.write_buffer_size() < before
    finally:
        sender.close()
        receiver.close()


class FakeTransport:
    """A transport whose own buffer never moves, over a real socket."""

    def __init__(self, sock: Any) -> None:
        self.sock = sock

    def get_write_buffer_size(self) -> int:
        return 65536

    def get_extra_info(self, name: str) -> Any:
        return self.sock if name == "socket" else None


async def test_a_heartbeat_that_raises_is_logged_once_and_drops_its_connection(
    caplog: Any,
) -> None:
    """Its task raised, unretrieved, and the next tick started another: a traceback per
    tick, and no keepalive ever again (a WebSocket's; the HTTP pump's own: see
    test_encoder_failures)."""
    from nexus.server.writer import Writer

    dropped: list[str] = []

    class Request:
        transport = None
        protocol = None

    class Pump(Writer):
        async def _heartbeat(self) -> None:
            raise RuntimeError("heartbeat bug")

        def _abort(self, why: str, cause: str = "write_timeout") -> None:
            dropped.append(cause)

    pump = Pump(Request(), heartbeat_s=1, write_timeout_s=5, watchdog=Watchdog())  # type: ignore[arg-type]
    pump.check(pump._loop.time() + 2)
    beat = pump._beat
    assert beat is not None
    await beat  # contained: nothing left for "Task exception was never retrieved"
    assert dropped == ["internal_error"]
    assert [r.getMessage() for r in caplog.records] == ["the heartbeat of a connection failed"]
