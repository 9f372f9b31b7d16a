"""The one pump: a stream's log and an encoder in, an HTTP response out.

Route handlers call :func:`pump`. It reads the log (a :class:`~nexus.cache.run.LogReader`) in
batches, renders each with a :class:`~nexus.server.render.Renderer` and writes it at once: what
upstream delivered together goes out in one write (a backlog, in pieces that let other connections
have the loop: ``YIELD_EVERY``). The race between producer, heartbeat, disconnect and shutdown:

* **Before the headers.** The first batch is awaited for up to one heartbeat interval. A failure
  there becomes an HTTP status with a JSON body; if the interval passes first, the headers go out
  with a heartbeat, and failures travel in the stream from then on.
* **Producer.** The stream's own task (:class:`~nexus.cache.run.StreamRun`) reads the provider; the
  pump follows the log. Once caught up, the pump has each new batch pushed to it
  (:meth:`StreamPump._push`): rendered and written in the producer's task while the socket takes
  it, so that an upstream read wakes one task, as in a byte-copying proxy; a batch it leaves (a
  write under way, a full socket) wakes the pump's task instead. When its client leaves, the reader
  detaches: the last reader of a stream that is not resumable (or whose client left before its
  headers named it) cancels it at once; a resumable one runs on for ``detach_timeout_s``.
* **Watchdog.** One task (:mod:`~nexus.watchdog`) checks every response's timers (a
  :class:`~nexus.server.writer.Writer`): a heartbeat after ``heartbeat_interval_s`` without a
  write; the connection aborted when its full socket takes no byte for ``write_timeout_s``.
* **Disconnect.** aiohttp cancels the handler when the peer goes away (``handler_cancellation``);
  ``finally`` detaches the reader (a failed write too).
* **Shutdown.** After the grace the app cancels the streams (their logs end with a retryable
  ``server_shutting_down`` error, then the terminator), then :meth:`StreamPump.shutdown` the
  pumps still running (those following another replica's stream).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Coroutine
from typing import Any

from aiohttp import web

from ..cache.readers import forget_unseen
from ..cache.run import LogReader
from ..encoders.base import Encoder
from ..errors import GatewayError, ServerShuttingDown, StreamError
from ..events import Done, Error, StreamEvent
from ..watchdog import Watchdog
from .access import METRICS, Exchange, exchange, request_spend, settled_spend
from .chunked import ChunkedResponse, chunk
from .render import Cursor, Renderer, uses_event_ids
from .state import Pump
from .writer import Writer

__all__ = ["LOG_LOST", "StreamPump", "pump"]

log = logging.getLogger("nexus.server")

_END = object()
_ENDS = (Error, Done)  # a log's terminal entries: a first event of these is no output
_UNREAD = object()

WRITE_SLICE = 64 * 1024
"""Most bytes given to the transport at once (see :meth:`StreamPump._write_sliced`)."""
YIELD_EVERY = 256 * 1024  # written without a wait, then the loop runs others (a backlog)


class StreamPump(Writer):
    """Writes one stream log to one HTTP response. Made and run by :func:`pump`."""

    _now = staticmethod(time.monotonic)
    # One per stream: slots, not a dict of its own past 29 attributes (see StreamRun's).
    __slots__ = (
        "_active", "_broken", "_bytes", "_chunked", "_ended", "_events", "_failed_with", "_head",
        "_last", "_metered", "_protocol", "_shutting_down", "_task", "exchange", "first_wait_s",
        "headers", "name", "origin", "reader", "renderer", "response"
    )  # fmt: skip

    def __init__(
        self,
        request: web.Request,
        reader: LogReader,
        renderer: Renderer,
        *,
        exchange: Exchange | None = None,
        heartbeat_s: float,
        write_timeout_s: float,
        headers: dict[str, str],
        active: set[Pump] | None = None,
        first_wait_s: float | None = None,
        origin: bool = True,
        watchdog: Watchdog | None = None,
    ) -> None:
        super().__init__(
            request, heartbeat_s=heartbeat_s, write_timeout_s=write_timeout_s, watchdog=watchdog
        )
        self.origin = origin
        self.exchange = exchange or Exchange("", self._now())
        metrics = request.app.get(METRICS)
        fmt = self.exchange.format or "unknown"
        self._events = metrics.events.labels(fmt) if metrics is not None else None
        self._bytes = metrics.bytes.labels(fmt) if metrics is not None else None
        self._metered = (0, self.exchange.bytes)  # in the counters so far
        self.reader, self.renderer = reader, renderer
        self.name = f"stream {reader.meta.id}"
        self.first_wait_s = heartbeat_s if first_wait_s is None else first_wait_s
        self.headers, self._active = headers, active
        self.response: web.StreamResponse | None = None
        self._task: asyncio.Task[object] | None = None
        self._shutting_down = self._ended = False
        self._chunked = self._head = False  # HTTP chunks (not to HTTP/1.0, nor HEAD); HEAD
        self._last: StreamEvent | None = None  # the last event of the first output
        self._broken: Exception | None = None  # what the encoder's heartbeat() raised
        self._failed_with: Error | None = None  # the gateway's error this client got
        self._protocol = request.protocol

    def shutdown(self) -> None:
        """Cancel this stream for server shutdown (see the module docstring)."""
        self._shutting_down = True
        if self._task is not None and not self._task.done():
            self._task.cancel()

    async def run(self) -> web.StreamResponse:
        self._task = asyncio.current_task()
        if self._active is not None:
            self._active.add(self)
        renderer = self.renderer
        try:
            batches = aiter(self.reader)
            try:
                data = await self._first_output(batches, renderer.begin())
            except GatewayError as exc:
                if self.response is None:
                    raise
                return await self._fail(exc)  # (headers out early: an in-band error)
            if data is _END:
                # The log ended without its terminal entry (a store that lost it).
                self.exchange.ended_with(LOG_LOST)
                return await self._end(self._begin() + renderer.fail(LOG_LOST))
            if renderer.done:
                self.exchange.ended_with(self._last)
                if self.response is None and not renderer.wrote:
                    # Resumed after the last event: nothing left (EventSource stops on 204).
                    return web.Response(status=204, headers={"Cache-Control": "no-cache"})
                return await self._end(self._begin() + data)  # type: ignore[operator]
            await self._write(self._begin() + data)  # type: ignore[operator]
            if self._head:
                return await self._end(b"")
            data = b""  # an idle stream does not keep its first output
            self.reader.sink = self._push
            unyielded = 0
            async for batch in batches:
                data = renderer.feed(batch)
                if renderer.done:
                    self.exchange.ended_with(batch[-1])
                    return await self._end(data)
                if data:
                    await self._write(data)
                    unyielded += len(data)
                    if unyielded >= YIELD_EVERY:  # a 60 MB log held the loop 0.3 s
                        unyielded = 0
                        await asyncio.sleep(0)
            # The log ended without its terminal entry (a store that lost it).
            self.exchange.ended_with(LOG_LOST)
            return await self._end(renderer.fail(LOG_LOST))
        except asyncio.CancelledError:
            task = self._task  # (cancelled by _beat_failed alone: the stream ends in-band)
            if self._broken is not None and task and task.uncancel() == 0 and not self._ended:
                return await self._fail(self._broken)
            if not self._shutting_down or self._ended:
                if not self._ended and self.exchange.cancelled is None:
                    self.exchange.cancelled = "client_disconnect"
                raise
            self.exchange.cancelled = "shutdown"
            if self.response is None:
                raise ServerShuttingDown(
                    "The server is shutting down; retry the request."
                ) from None
            # Shutdown: a retryable error, the terminator and a clean end of the body.
            with contextlib.suppress(Exception):
                await self._end(renderer.fail(_SHUTDOWN))
            if task is not None:
                task.uncancel()
            return self.response
        except Exception as exc:
            if self.response is None:
                if not isinstance(exc, GatewayError):  # (an encoder's start(): a 500)
                    self._failed_with = _INTERNAL
                raise
            if isinstance(exc, ConnectionError):
                log.debug("client left stream %s: %s", self.reader.meta.id, exc)
            elif isinstance(exc, GatewayError):
                log.warning("stream %s ended: %s", self.reader.meta.id, exc.code)
            else:
                log.exception("stream %s failed", self.reader.meta.id)
            return await self._fail(exc)
        finally:
            self._settle()
            self._watch(False)
            self._meter()
            if self._active is not None:
                self._active.discard(self)
            if self.origin and self.response is None:
                forget_unseen(self.reader)  # (it never learnt the stream's id)
            await self.reader.close(self._failed_with)
            ex = self.exchange
            if self.origin and ex.spend is None and self.reader.failure is None:
                # The client left before the end: its stream, unless resumable, is being
                # cancelled; its spend goes on the access line or on a line of its own.
                ex.spend = await settled_spend(self.request.app, ex, self.reader, self.reader.run)

    async def _fail(self, exc: Exception) -> web.StreamResponse:
        """End the stream in-band: after the headers nothing may escape to the middleware
        (it would write a second response into this body). The gateway's failure (not the
        client gone) is the response's outcome, and, when its client was the stream's last,
        the stream's (its plugins hear the same)."""
        assert self.response is not None
        if not self._ended:
            event = exc.to_event() if isinstance(exc, GatewayError) else _INTERNAL
            if not isinstance(exc, ConnectionError):  # (its outcome: not ok)
                self.exchange.ended_with(event)
                self._failed_with = event
            with contextlib.suppress(Exception):
                await self._end(self.renderer.fail(event))
        return self.response

    async def _read_in_task(self, batches: AsyncIterator[list[StreamEvent]], out: bytes) -> object:
        """The next batch, read in a task of its own: a read that must not be cancelled (a
        store's) outlives the wait for the first output, past which the headers go out."""
        task: asyncio.Future[object] = asyncio.ensure_future(anext(batches, _END))
        try:
            if self.response is None:
                done, _ = await asyncio.wait((task,), timeout=self.first_wait_s)
                if not done:
                    await self._headers_early(out)
            # From the headers on, the watchdog writes the heartbeats.
            if not task.done():
                await asyncio.wait((task,))
            return task.result()
        finally:
            if not task.done():
                task.cancel()
                await asyncio.wait((task,))

    async def _headers_early(self, out: bytes) -> bytes:
        """No first output within ``first_wait_s``: the headers go out with what is ready
        (and a heartbeat, after a heartbeat interval); what is left to write (nothing)."""
        idle = self.first_wait_s >= self.heartbeat_s
        beat = self.renderer.heartbeat() if idle else b""
        await self._write(self._begin() + out + beat)
        return b""

    def _settle(self) -> None:
        """The access line's view: who answered (no one yet, or failed) and what it spent."""
        ex, reader = self.exchange, self.reader
        if self.origin:
            ex.spend = request_spend(reader, hit=ex.cache == "hit")
        run = reader.run  # (None: it ran elsewhere, and its meta says who answered)
        if reader.failure is not None or (run is not None and not run.answered):
            ex.provider = ""  # nothing served (not the first target tried: it failed)
            return
        served = reader.served
        ex.provider = served.provider
        ex.served = f"{served.provider}/{served.upstream_model}" if served.provider else None

    async def _first_output(self, batches: AsyncIterator[list[StreamEvent]], head: bytes) -> object:
        """The first bytes to write: ``head`` and the log rendered so far; ``_END`` if none.

        The first batch is awaited before anything is written, so that a stream failing
        before any output raises (an HTTP status); batches that render nothing (a resume)
        are read on. Past ``first_wait_s`` the headers go out with what is ready."""
        renderer = self.renderer
        out = head
        while True:
            if self.reader.cancel_safe:
                # Read here, under a deadline: no task of its own, which under load would
                # cost the first byte two turns of the event loop.
                batch: object = _UNREAD
                if self.response is None:
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(self.first_wait_s):
                            batch = await anext(batches, _END)
                if batch is _UNREAD:
                    if self.response is None:
                        out = await self._headers_early(out)
                    batch = await anext(batches, _END)
            else:
                batch = await self._read_in_task(batches, out)
                if self.response is not None:
                    out = b""
            if batch is _END:
                return _END
            events: list[StreamEvent] = batch  # type: ignore[assignment]
            self._last = events[-1]
            # Only the request that made the stream gets its failure as an HTTP status; an
            # attach gets the stream as it is, error and all.
            fresh = self.origin and renderer.step == 0 and not renderer.resumed
            if self.response is None and fresh and type(events[0]) is Error:
                failure = self.reader.failure
                raise failure if failure is not None else StreamError(events[0])
            if self.origin and self.exchange.ttft is None and type(events[0]) not in _ENDS:
                self.exchange.ttft = self._now() - self.exchange.started  # its first output
            out += renderer.feed(events)
            if out or renderer.done:
                return out

    def _meter(self) -> None:
        """Add the events (the renderer's count) and bytes written since the last call to the
        exchange and the format's counters: after each write of the pump's task, and for the
        batches pushed in the producer's task (one per upstream read: two increments less
        each) at the watchdog's next tick and at the end."""
        ex = self.exchange
        events, size = self._metered
        ex.events = self.renderer.written if ex.bytes else 0  # (none before a byte went out)
        self._metered = (ex.events, ex.bytes)
        if self._events is not None and ex.events != events:
            self._events.inc(ex.events - events)
        if self._bytes is not None and ex.bytes != size:
            self._bytes.inc(ex.bytes - size)

    def check(self, now: float) -> None:
        self._meter()
        super().check(now)

    def _begin(self) -> bytes:  # the response, sent with the first write
        if self.response is None:
            self._head = self.request.method == "HEAD"
            if self.request.version >= (1, 1):
                self.response = ChunkedResponse(status=200, headers=self.headers)
                self.response.enable_chunked_encoding()
            else:  # HTTP/1.0 has no chunks: the body ends with the connection
                self.response = web.StreamResponse(status=200, headers=self.headers)
            self.headers = {}  # in the response now, the stream's id with them (resumed)
            if (run := self.reader.run) is not None:
                run.info.named = True
        return b""

    async def _write(self, data: bytes, *, last: bool = False) -> None:
        """Write ``data``, timed by the watchdog; ``last``: and the end of the body, in the
        same write (aiohttp sends the end of a chunked body on its own after the handler)."""
        response = self.response
        assert response is not None
        if not response.prepared:
            await response.prepare(self.request)  # the headers go out with ``data``
            # Serialised: the headers (and the copies their serialisation cached) are not
            # kept for the stream's length.
            self._chunked = response.headers.get("Transfer-Encoding") == "chunked"
            response.headers.clear()
            self.exchange.ttfb = self._now() - self.exchange.started
            self.exchange.status = response.status
            # From the headers on, the watchdog owns heartbeats and write stalls.
            self._watch(True)
        if self._head:
            data = b""
        if len(data) > WRITE_SLICE:
            await self._timed(self._write_sliced(data))
            if not last:
                return
            data = b""
        self._writing += 1  # Writer._timed, inlined: one coroutine less a write
        try:
            await (response.write_eof(data) if last else response.write(data))
        finally:
            self._writing -= 1
        self._wrote()
        self.exchange.bytes += len(data)
        self._meter()  # the counters at once here; a pushed batch's at the next tick

    async def _write_sliced(self, data: bytes) -> None:
        """Write a large output in slices: the transport never holds more than about one
        (a write returns once its buffer drains below the low-water mark)."""
        assert self.response is not None
        write = self.response.write
        view = memoryview(data)
        for start in range(0, len(view), WRITE_SLICE):
            piece = view[start : start + WRITE_SLICE]
            await write(piece)
            self._wrote()  # each slice is timed on its own: a slow reader takes them
            self.exchange.bytes += len(piece)

    def _push(self, batch: list[StreamEvent]) -> bool:
        """The reader's sink (:class:`~nexus.cache.readers.RunReader`): render and write
        ``batch`` in the producer's task, when nothing else is being written and the
        socket takes more; else False, and this pump's task reads it.

        The write cannot wait there, and need not: it is one HTTP chunk handed to the transport
        (:func:`chunk`, the framing aiohttp's chunked writer gives the same bytes), as a
        byte-copying proxy's would be. The headers went out with the first write in chunks
        (else nothing is pushed: HTTP/1.0, HEAD), nothing else is being written, and the body
        is never compressed. Should the socket fill with these very bytes, they are with the
        transport already; the wait for it to drain is left to the next write, which this task
        makes through aiohttp (a paused socket is never pushed to)."""
        transport = self._protocol.transport
        if self._writing or self._ended or not self._chunked or self._protocol.writing_paused:
            return False
        if transport is None or transport.is_closing():
            return False  # the client left: this pump's task finds out
        data = self.renderer.feed(batch)
        if data:
            transport.write(chunk(data))
            self._wrote()
            self.exchange.bytes += len(data)
        return True

    async def _end(self, data: bytes) -> web.StreamResponse:
        """Write the last bytes and the end of the body; nothing goes after them."""
        self._ended = True  # the watchdog stops heartbeats but still watches this write
        await self._write(data, last=True)
        assert self.response is not None
        return self.response

    def _beat_due(self, now: float) -> bool:
        return not self._ended and self._broken is None and super()._beat_due(now)

    def _beat_failed(self, exc: Exception) -> None:
        """The encoder's ``heartbeat()`` raised: end the stream in-band, in this pump's task."""
        self._broken = exc
        if self._task is not None and not self._task.done():
            self._task.cancel()

    async def _heartbeat(self) -> None:
        response = self.response
        if self._ended or self._writing or response is None or self._head:
            return  # a write began since the tick, or the terminator went out
        heartbeat = self.renderer.heartbeat()
        # The frame reaches the transport before this task first waits: it cannot
        # follow the terminator, nor go between two slices of a frame.
        await self._timed(response.write(heartbeat))
        self.exchange.bytes += len(heartbeat)

    def _abort(self, why: str, cause: str = "write_timeout") -> None:
        super()._abort(why, cause)
        if self._task is not None and not self._task.done():
            self._task.cancel()


def _error(code: str, why: str) -> Error:
    message = f"{why}; the response is incomplete."
    return Error(error_type="server_error", message=message, code=code, retryable=True)


# The gateway's own ends of a stream (events are immutable: one of each serves all).
_SHUTDOWN = ServerShuttingDown("The server is shutting down; retry the request.").to_event()
_INTERNAL = _error("internal_error", "The gateway failed while streaming")
LOG_LOST = _error("stream_incomplete", "The stream's log ended without its last event")


def pump(
    request: web.Request,
    reader: LogReader,
    encoder_cls: type[Encoder],
    *,
    heartbeat_s: float,
    write_timeout_s: float,
    after: Cursor | None = None,
    headers: dict[str, str] | None = None,
    active: set[Pump] | None = None,
    first_wait_s: float | None = None,
    origin: bool = True,
    watchdog: Watchdog | None = None,
) -> Coroutine[Any, Any, web.StreamResponse]:
    """Write ``reader``'s log to the client of ``request`` in ``encoder_cls``'s format.

    The reader starts at the log's first entry: a resume (``after``) renders the
    skipped part unwritten, so that stateful encoders pick up where they were.
    ``first_wait_s`` (default: the heartbeat interval): how long the headers wait
    for output (an attach's is short). ``origin``: the request that made the
    stream, which gets a failure before any output as an HTTP status.
    """
    meta = reader.meta
    ex = exchange(request)
    encoder = encoder_cls(meta)
    encoder.request_id = ex.request_id  # this response's, for its error frames
    renderer = Renderer(encoder, meta.id, ids=uses_event_ids(encoder_cls), after=after)
    all_headers = {
        "Content-Type": encoder.content_type or encoder.media_type,
        "Cache-Control": "no-cache",
        "X-Accel-Buffering": "no",
        "Vary": "Accept, X-Nexus-Stream-Format",
        "X-Nexus-Stream-Format": encoder.media_type,
        "X-Nexus-Stream-Id": meta.id,
    }
    all_headers.update(ex.headers)
    if headers:
        all_headers.update(headers)
    ex.format = encoder.media_type
    ex.stream_id = meta.id
    ex.provider = meta.provider
    ex.model = ex.model or meta.model
    ex.streamed = True
    runner = StreamPump(
        request,
        reader,
        renderer,
        exchange=ex,
        heartbeat_s=heartbeat_s,
        write_timeout_s=write_timeout_s,
        headers=all_headers,
        active=active,
        first_wait_s=first_wait_s,
        origin=origin,
        watchdog=watchdog,
    )
    return runner.run()  # awaited by the caller: no frame of this call held meanwhile
