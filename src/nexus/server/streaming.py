"""The one pump: a :class:`~nexus.stream.Stream` and an encoder in, an HTTP response out.

Route handlers hold no framing code; they call :func:`pump`. It writes the
encoder's ``start()`` with the first frame, each event as it arrives (flushed at
once), ``heartbeat()`` when idle, and ``end()`` last.

The race between producer, heartbeat, disconnect and shutdown:

* **Before the headers.** The first event is awaited for up to one heartbeat
  interval. A failure there (a ``GatewayError`` raised, or an error event)
  becomes an HTTP status with a JSON body. If the interval passes first, the
  headers go out with a heartbeat: from then on failures travel in the stream.
* **Producer.** The handler task reads the stream directly (no task or timer
  per event) and writes each frame; a slow reader slows the provider down
  (writes wait for the transport to drain), so memory stays bounded.
* **Watchdog.** One task per stream owns the timers: after
  ``heartbeat_interval_s`` without a write it writes a heartbeat, and a write
  that has not finished after ``write_timeout_s`` (a client that stopped
  reading) gets the connection aborted.
* **Disconnect.** The server runs with ``handler_cancellation``: aiohttp
  cancels the handler task when the peer goes away, wherever it awaits, and
  ``finally`` closes the stream, which closes the provider at once. A failed
  write ends the pump the same way.
* **Shutdown.** After the grace period the app calls :meth:`StreamPump.shutdown`:
  the handler task is cancelled and, if headers went out, writes a retryable
  ``server_shutting_down`` error and the format's terminator; otherwise the
  client gets a 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from aiohttp import web

from ..encoders.base import Encoder
from ..errors import GatewayError, ServerShuttingDown, StreamError
from ..events import Error, StreamEvent
from ..stream import Stream

__all__ = ["StreamPump", "pump"]

log = logging.getLogger("nexus.server")

_END = object()


async def _next(events: AsyncIterator[StreamEvent]) -> object:
    try:
        return await events.__anext__()
    except StopAsyncIteration:
        return _END


class StreamPump:
    """Writes one stream to one HTTP response. Made and run by :func:`pump`."""

    def __init__(
        self,
        request: web.Request,
        stream: Stream,
        encoder: Encoder,
        *,
        heartbeat_s: float,
        write_timeout_s: float,
        headers: dict[str, str],
        active: set[StreamPump] | None = None,
    ) -> None:
        self.request = request
        self.stream = stream
        self.encoder = encoder
        self.heartbeat_s = heartbeat_s
        self.write_timeout_s = write_timeout_s
        self.headers = headers
        self.response: web.StreamResponse | None = None
        self._active = active
        self._task: asyncio.Task[object] | None = None
        self._shutting_down = False
        self._watchdog: asyncio.Task[None] | None = None
        self._ended = False
        self._loop = asyncio.get_running_loop()
        self._last_write = self._loop.time()
        self._write_started = self._last_write

    def shutdown(self) -> None:
        """Cancel this stream for server shutdown (see the module docstring)."""
        self._shutting_down = True
        if self._task is not None and not self._task.done():
            self._task.cancel()

    async def run(self) -> web.StreamResponse:
        self._task = asyncio.current_task()
        if self._active is not None:
            self._active.add(self)
        try:
            events = aiter(self.stream)
            try:
                first = await self._first_event(events)
            except GatewayError as exc:
                if self.response is None:
                    raise
                return await self._end_with_error(exc.to_event())
            if first is _END:
                return await self._end(self._begin() + self.encoder.end())
            if type(first) is Error:
                if self.response is None:
                    raise StreamError(first)
                return await self._end_with_error(first)
            await self._write(self._begin() + self.encoder.encode(first))  # type: ignore[arg-type]
            response = self._require_response()
            encode = self.encoder.encode
            write = response.write
            now = self._loop.time
            async for event in events:
                if type(event) is Error:
                    return await self._end_with_error(event)
                data = encode(event)
                if data:
                    self._write_started = now()
                    await write(data)
                    self._last_write = now()
            return await self._end(self.encoder.end())
        except asyncio.CancelledError:
            if not self._shutting_down or self._ended:
                raise
            if self.response is None:
                raise ServerShuttingDown(
                    "The server is shutting down; retry the request."
                ) from None
            # Shutdown: a retryable error, the terminator and a clean end of the body.
            with contextlib.suppress(Exception):
                await self._end_with_error(_shutdown_event())
                await self.response.write_eof()
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            return self.response
        except Exception as exc:
            if self.response is None:
                raise
            # After the headers nothing may escape to the middleware (it would write a
            # second response into this body): end the stream in-band instead.
            if isinstance(exc, ConnectionError):
                log.debug("client left stream %s: %s", self.stream.meta.id, exc)
            else:
                log.exception("stream %s failed", self.stream.meta.id)
            if not self._ended:
                with contextlib.suppress(Exception):
                    await self._end_with_error(_internal_event())
            return self.response
        finally:
            if self._watchdog is not None:
                self._watchdog.cancel()
            if self._active is not None:
                self._active.discard(self)
            await self.stream.close()

    def _require_response(self) -> web.StreamResponse:
        assert self.response is not None
        return self.response

    async def _first_event(self, events: AsyncIterator[StreamEvent]) -> object:
        """The first event; if it is slow, the headers go out with a heartbeat meanwhile."""
        task = self._loop.create_task(_next(events))
        try:
            done, _ = await asyncio.wait((task,), timeout=self.heartbeat_s)
            if not done:
                await self._write(self._begin() + self.encoder.heartbeat())
                await asyncio.wait((task,))
            return task.result()
        finally:
            if not task.done():
                task.cancel()
                await asyncio.wait((task,))

    def _begin(self) -> bytes:
        """Create the response (sent with the first write); ``start()`` the first time.

        Called before any other encoder method: stateful encoders (Anthropic,
        Responses) number their frames from ``start()`` on.
        """
        if self.response is None:
            self.response = web.StreamResponse(status=200, headers=self.headers)
            return self.encoder.start()
        return b""

    async def _write(self, data: bytes) -> None:
        response = self._require_response()
        if not response.prepared:
            await response.prepare(self.request)
            # From the headers on, the watchdog owns heartbeats and write stalls.
            self._watchdog = self._loop.create_task(self._watch())
        self._write_started = self._loop.time()
        await response.write(data)
        self._last_write = self._loop.time()

    async def _end(self, data: bytes) -> web.StreamResponse:
        """Write the last bytes of the stream; nothing is written after them."""
        self._ended = True  # the watchdog stops heartbeats but still watches this write
        await self._write(data)
        return self._require_response()

    async def _end_with_error(self, event: Error) -> web.StreamResponse:
        return await self._end(self._begin() + self.encoder.error(event) + self.encoder.end())

    async def _watch(self) -> None:
        """Heartbeats when idle; abort the connection when a write stalls."""
        response = self._require_response()
        heartbeat = self.encoder.heartbeat()
        # Stalls are noticed within a quarter of the write timeout.
        tick = self.write_timeout_s / 4
        while True:
            now = self._loop.time()
            if self._write_started > self._last_write:
                stalled = now - self._write_started
                if stalled >= self.write_timeout_s:
                    self._abort(f"a write stalled for {stalled:.1f}s")
                    return
                wake = self._write_started + self.write_timeout_s
            else:
                idle = now - self._last_write
                if self._ended:
                    wake = now + tick
                elif idle >= self.heartbeat_s:
                    self._write_started = now
                    try:
                        # Awaited here, not in a task: the frame goes to the transport
                        # before anything else runs, so it cannot follow the terminator.
                        async with asyncio.timeout(self.write_timeout_s):
                            await response.write(heartbeat)
                    except (TimeoutError, ConnectionError):
                        self._abort("a heartbeat could not be written")
                        return
                    self._last_write = self._loop.time()
                    continue
                else:
                    wake = self._last_write + self.heartbeat_s
            await asyncio.sleep(max(min(wake - now, tick), 0.001))

    def _abort(self, why: str) -> None:
        log.warning("dropping client of stream %s: %s", self.stream.meta.id, why)
        transport = self.request.transport
        if transport is not None:
            transport.abort()
        if self._task is not None and not self._task.done():
            self._task.cancel()


def _shutdown_event() -> Error:
    return ServerShuttingDown("The server is shutting down; retry the request.").to_event()


def _internal_event() -> Error:
    return Error(
        error_type="server_error",
        message="The gateway failed while streaming; the response is incomplete.",
        code="internal_error",
        retryable=True,
    )


async def pump(
    request: web.Request,
    stream: Stream,
    encoder_cls: type[Encoder],
    *,
    heartbeat_s: float,
    write_timeout_s: float,
    active: set[StreamPump] | None = None,
) -> web.StreamResponse:
    """Stream ``stream`` to the client of ``request`` in ``encoder_cls``'s format."""
    encoder = encoder_cls(stream.meta)
    headers = {
        "Content-Type": encoder.content_type or encoder.media_type,
        "Cache-Control": "no-cache",
        "X-Accel-Buffering": "no",
        "Vary": "Accept, X-Nexus-Stream-Format",
        "X-Nexus-Stream-Format": encoder.media_type,
        "X-Nexus-Stream-Id": stream.meta.id,
        "x-request-id": stream.meta.id,
    }
    runner = StreamPump(
        request,
        stream,
        encoder,
        heartbeat_s=heartbeat_s,
        write_timeout_s=write_timeout_s,
        headers=headers,
        active=active,
    )
    return await runner.run()
