"""A realtime socket's turn: its stream's log followed to the socket, one text frame an
event. Kept apart from the connection (:mod:`.realtime`), which reads the client's
frames: a turn only writes, in a task of its own, until its stream ends or is stopped.
What its frames send is counted by the socket's :class:`FrameMeter`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, AnyStr, Protocol

from aiohttp import WSMsgType, web

from ...cache.readers import leave
from ...cache.run import LogReader, StreamRun
from ...encoders.ndjson import NDJSONEncoder
from ...errors import GatewayError, StreamIncomplete
from ...events import Done, Error, StreamEvent
from ...protocol.realtime import RealtimeSession
from ...protocol.realtime_envelopes import gateway_error_frame
from ..access import METRICS
from ..state import Exchange, exchange

if TYPE_CHECKING:
    from ..metrics import Metrics

__all__ = ["FORMAT", "FrameMeter", "Turn"]

log = logging.getLogger("nexus.realtime")

FORMAT = "websocket"
"""The ``format`` of a realtime socket: its access line's, its frames' counters' label."""


class FrameMeter:
    """A socket's turn frames in ``nexus_events_out_total`` and ``nexus_bytes_out_total``
    (``format="websocket"``) and in its access line's ``events`` and ``bytes`` (the
    socket's :class:`Exchange`, summed over its turns): one event a frame, its payload's
    bytes (as HTTP counts a body's, not its chunks' framing). Counted per write, added to
    both at the watchdog's tick, as a turn ends and as the socket does (as the HTTP pump
    adds a pushed batch's): no counter increment per frame."""

    __slots__ = ("_bytes", "_events", "bytes", "events", "socket")

    def __init__(self, metrics: Metrics | None, socket: Exchange) -> None:
        self._events = metrics.events.labels(FORMAT) if metrics is not None else None
        self._bytes = metrics.bytes.labels(FORMAT) if metrics is not None else None
        self.socket = socket
        """The socket's access line: what its turns sent, as the counters got it."""
        self.events = 0  # frames sent since the counters last had them
        self.bytes = 0

    def add(self, payloads: list[bytes]) -> None:
        """``payloads`` went out, one text frame each."""
        self.events += len(payloads)
        self.bytes += sum(map(len, payloads))

    def flush(self) -> None:
        """Add what went out since the last call to the counters and the access line."""
        if not self.events:
            return
        socket = self.socket
        socket.events += self.events
        socket.bytes += self.bytes
        if self._events is not None and self._bytes is not None:
            self._events.inc(self.events)
            self._bytes.inc(self.bytes)
        self.events = self.bytes = 0


class Connection(Protocol):
    """What a turn uses of its connection
    (:class:`~nexus.server.routes.realtime.RealtimeConnection`, which imports this module)."""

    request_id: str
    request: web.Request
    ws: web.WebSocketResponse
    session: RealtimeSession
    meter: FrameMeter
    turn: Turn | None

    @property
    def writable(self) -> bool: ...

    @property
    def cause(self) -> str | None:
        """Why the connection is ending, once it is (a ping or write timeout, ...)."""

    def write_now(self, payloads: list[bytes]) -> None: ...

    async def send_texts(self, payloads: list[bytes]) -> None: ...

    async def fail(self, payload: bytes) -> None: ...


_NO_PLACE: AbstractContextManager[None] = contextlib.nullcontext()

_TURN_LIMITS = frozenset({"max_stream_duration", "stream_too_large"})
"""Errors that end a turn for a limit of its own (``[limits] max_stream_duration_s``,
``[streams] max_log_bytes``): the turn ends with the error frame, as a refused start
does, and the socket stays open for the next; a provider failure after output closes it
(1011), one before refuses the ``start`` (its error frame) and leaves it open."""

_INTERNAL = Error(
    error_type="server_error",
    message="The gateway failed during this turn.",
    code="internal_error",
    retryable=True,
)


class Turn:
    """One turn's writer: each event of its log as a text frame, then its end, in a task
    (or, once caught up, each new batch pushed to it: :meth:`_push`)."""

    __slots__ = (
        "conn",
        "encoder",
        "over",
        "place",
        "reader",
        "record",
        "run",
        "started",
        "status",
        "task",
        "terminated",
    )

    def __init__(
        self,
        conn: Connection,
        reader: LogReader,
        run: StreamRun | None,
        record: Exchange,
        place: AbstractContextManager[None] = _NO_PLACE,
    ) -> None:
        self.conn = conn
        self.reader = reader
        self.run = run
        """The stream it ends when it ends early; None for one it only joined."""
        self.place = place  # a joined stream's place among its key's readers, until over
        place.__enter__()
        self.record = record
        """The turn as its spend line and the metrics see it: its model, its first token,
        how it ended."""
        self.status = 200  # as HTTP would answer it: a refusal before any event, its own
        self.started = False  # an event went out: a failure is in-band from then on
        self.terminated = False  # its last frame went out: no aborted frame after it
        self.over = False
        self.encoder = NDJSONEncoder(reader.meta)  # a frame is a line, without its newline
        self.encoder.request_id = conn.request_id
        reader.sink = self._push
        self.task = asyncio.get_running_loop().create_task(self._follow())

    def _push(self, batch: list[StreamEvent]) -> bool:
        """The reader's sink: ``batch`` written in the producer's task once the turn has
        caught up with its log, so that an upstream read wakes one task (as the HTTP
        pump's push); False (nothing encoded) leaves it to the turn's task: a write under
        way, a full socket, a compressing connection, the turn's end."""
        conn = self.conn
        if self.terminated or not conn.writable:
            return False
        for event in batch:
            cls = type(event)
            if cls is Done or cls is Error:
                return False
        encode = self.encoder.encode
        payloads = [encode(event)[:-1] for event in batch]
        conn.write_now(payloads)
        conn.meter.add(payloads)
        if not self.started:
            self._first()
        return True

    def _first(self) -> None:
        """Its first event went out: the turn's time to first token."""
        self.started = True
        record = self.record
        record.ttft = time.monotonic() - record.started

    async def _follow(self) -> None:
        """Write the log's events as they come, then the end; waiting for the socket."""
        conn = self.conn
        encode = self.encoder.encode
        meter = conn.meter
        try:
            async for batch in self.reader:
                payloads: list[bytes] = []
                for event in batch:
                    cls = type(event)
                    if cls is Done or cls is Error:
                        await conn.send_texts(payloads)
                        meter.add(payloads)
                        await self._end(event)  # type: ignore[arg-type]
                        return
                    if not self.started:
                        self._first()
                    payloads.append(encode(event)[:-1])
                await conn.send_texts(payloads)
                meter.add(payloads)
            # The log ended without its terminal entry (a store that lost it): the turn's
            # end is an error, as a hole in the log is, never a wait for a done.
            raise StreamIncomplete("The stream's log ended without its last event.")
        except GatewayError as exc:
            self.terminate()
            self.status, self.record.error = exc.status, exc.code  # before any event
            exc.__traceback__ = None  # the run's failure: see nexus.server.errors
            with contextlib.suppress(ConnectionError):
                if exc.status >= 500 and self.started:
                    await self._fail(exc.to_event())
                else:  # before any output (every target failed): the start refused, as HTTP
                    refused = None if self.started else "start"  # answers a status
                    if refused:  # (among the socket's refusals; the turn's own line says why)
                        exchange(conn.request).refused += 1
                    frame = gateway_error_frame(exc, conn.request_id, refused=refused)
                    await conn.ws.send_str(frame.frame)
        except ConnectionError:
            log.debug("realtime client went away mid-turn")
        except Exception:
            log.exception("realtime turn failed")
            self.terminate()
            self.record.stream_error = _INTERNAL.code
            await self._fail(_INTERNAL)
        finally:
            await self._close()

    async def _end(self, event: Done | Error) -> None:
        if type(event) is Done:
            self.record.ended_with(event)
            self.terminate()  # before the frame: the client may start again
            await self.conn.ws.send_frame(
                self.last(self.encoder.encode(event)[:-1]), WSMsgType.TEXT
            )
            return
        failure = self.reader.failure
        if not self.started and failure is not None:
            raise failure
        assert type(event) is Error
        self.record.ended_with(event)
        self.terminate()
        if event.code in _TURN_LIMITS:  # the turn's own limit: the socket is fine
            await self.conn.ws.send_frame(self.last(self.encoder.error(event)[:-1]), WSMsgType.TEXT)
            return
        await self._fail(event)

    async def _fail(self, error: Error) -> None:
        """A provider (or gateway) failure ends the socket: the error frame, then 1011
        (:meth:`Connection.fail`); the socket's access line says so, as it does after an
        unexpected error's 1011 (``mid_stream_error:<code>``)."""
        socket = exchange(self.conn.request)
        socket.stream_error = socket.stream_error or error.code or error.error_type
        await self.conn.fail(self.last(self.encoder.error(error)[:-1]))

    def last(self, payload: AnyStr) -> AnyStr:
        """``payload``, the turn's last frame (its done, an error, an abort's done; ASCII),
        counted as it goes out if the turn streamed: one that ended before its first event
        counts no frame, as an HTTP request answered with an error status writes no stream."""
        if self.started:
            meter = self.conn.meter
            meter.events += 1
            meter.bytes += len(payload)
        return payload

    def terminate(self) -> None:
        """The turn's last frame is about to go out: the session may start the next."""
        self.terminated = True
        if self.conn.turn is self:
            self.conn.session.turn_ended()

    async def stop(self, cause: str) -> None:
        """End the turn now, its stream with it; ``cause`` is why (``aborted``,
        ``shutdown``, ``ping_timeout``, ``client_disconnect``, ...), the ``cancelled:``
        outcome of its spend line when it had not ended yet."""
        if not self.terminated:
            self.record.cancelled = self.record.cancelled or cause
        self.reader.sink = None  # nothing more from the producer's task (an abort answers)
        task = self.task
        if task is not asyncio.current_task():
            task.cancel()
            await asyncio.wait((task,))
        await self._close()

    async def _close(self) -> None:
        """Over: the stream let go (ended, unless shared), the connection free for the next."""
        if self.over:
            return
        self.over = True
        self.place.__exit__(None, None, None)
        conn = self.conn
        record = self.record
        if not self.terminated:  # ended early on its own: its socket went (a timeout, ...)
            record.cancelled = record.cancelled or conn.cause or "client_disconnect"
        conn.meter.flush()  # its frames, in the counters before the turn counts
        metrics = conn.request.app.get(METRICS)
        if metrics is not None:  # each turn counts as an HTTP stream request does
            outcome = record.outcome(self.status)
            elapsed = time.monotonic() - record.started
            metrics.observe(
                record.endpoint,
                record.model,
                outcome,
                elapsed,
                record.ttft,
                cache=record.cache,
                cancelled=record.cancelled,  # its own cause (the socket's line counts none)
            )
        if conn.turn is self:
            conn.turn = None
            if not self.terminated:  # else the session already moved on: it may be streaming
                conn.session.turn_ended()
        await leave(self.reader, self.run, aborted=record.cancelled == "aborted")
