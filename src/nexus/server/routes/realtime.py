"""``GET /v1/realtime``: the WebSocket surface. The route only moves frames.

The protocol (envelopes, states, errors) lives in
:class:`~nexus.protocol.realtime.RealtimeSession`; this module reads frames,
feeds them to it and carries out its actions. A turn (:class:`Turn`) sends
each event of the engine's stream as one text frame (the NDJSON object), then
``{"type":"done"}``. It follows the stream's log without a task of its own:
the log's growth calls it back, and it writes what arrived straight to the
socket; a task runs only while the turn waits for something else (a paused
socket, its end).

* ``abort`` ends the turn and cancels its stream: the cancellation reaches the
  provider at its current await, so its cleanup runs at once, not at the next
  chunk; then ``{"type":"done","aborted":true}`` goes out and the connection
  stays open.
* A provider failure (an error event, or an upstream error before output):
  the error frame, then close 1011. A request-level failure (unknown model,
  unsupported input): the error frame, and the connection stays open.
* Ping frames every ``heartbeat_interval_s``; a peer that does not answer
  in half that time is closed and its turn cancelled. A peer that vanishes
  ends the receive loop, which cancels the turn.
* A peer that does not read its frames: once the socket is paused (its
  buffer full) and has taken no byte for ``[server] write_timeout_s``, the
  connection is aborted (no close frame: it could not reach a peer that does
  not read) and its turn cancelled, counted as a ``write_timeout``
  cancellation, whatever frames the peer keeps sending (its pings show that
  it is there, not that it reads). The watchdog's tick checks it, as it
  does the pings: no timer per write.
* Each ``start`` is admitted as an HTTP request is
  (:func:`~nexus.server.access.admit_stream`): the key's models, budget and rate, a
  place among the streams running. A refusal is an error frame (with
  ``retry_after_s`` for ``rate_limited`` and ``too_many_streams``), and the
  connection stays open. The handshake itself is authenticated but takes no
  token: the rate counts model calls (a socket's first ``start`` is never
  refused for its own handshake), and sockets are bounded by ``[server]
  max_connections``.
* A message over ``[realtime] max_message_bytes`` closes with 1009; server
  shutdown closes with 1001.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from typing import Any

import orjson
from aiohttp import WSCloseCode, WSMessage, WSMsgType, web

from ...auth import ApiKey
from ...cache.readers import leave, with_usage
from ...cache.run import LogReader, RunReader, StreamRun
from ...encoders.ndjson import NDJSONEncoder
from ...errors import GatewayError, ServerShuttingDown
from ...events import Done, Error, StreamEvent, plain_content
from ...hooks import CallContext
from ...protocol.realtime import (
    AbortTurn,
    RealtimeSession,
    Send,
    StartTurn,
    gateway_error_frame,
    text_frames,
)
from .. import state
from ..access import admit_stream, authenticate, exchange

__all__ = ["RealtimeConnection", "Turn", "handle"]

log = logging.getLogger("nexus.realtime")

PROTOCOL = "nexus.v1"
"""The subprotocol a browser offers beside ``nexus-key.<key>`` (the one answered)."""
_DONE = '{"type":"done"}'
_CONTENT_HEAD = NDJSONEncoder.content_frame[0]  # the event's JSON, as in NDJSON
_dumps = orjson.dumps
_ABORTED = '{"type":"done","aborted":true}'
_PING = b"\x89\x00"  # FIN, opcode 9 (ping), unmasked, no payload
_INTERNAL = Error(
    error_type="server_error",
    message="The gateway failed during this turn.",
    code="internal_error",
    retryable=True,
)


class RealtimeConnection:
    """One WebSocket client: its session, its socket, at most one running turn."""

    def __init__(
        self, request: web.Request, key: ApiKey | None = None, protocols: tuple[str, ...] = ()
    ) -> None:
        app = request.app
        config = app[state.CONFIG]
        self.request = request
        self.key = key
        self.hub = app[state.HUB]
        self.runtime = app[state.RUNTIME]
        # Pings are the watchdog's (see check()), not a timer and a pong wait of
        # aiohttp's per connection (3.7 KB of an idle one); so pongs, and the client's
        # pings, come to _receive().
        self.ws = web.WebSocketResponse(
            autoping=False,
            max_msg_size=config.realtime.max_message_bytes,
            protocols=protocols,
        )
        self._heartbeat_s = config.server.heartbeat_interval_s
        self._write_timeout_s = config.server.write_timeout_s
        self._stalled = 0.0  # since when the paused socket has taken no byte (0: not paused)
        self._buffered = 0  # the transport's write buffer when last looked at
        self._loop = asyncio.get_running_loop()
        self._last_seen = 0.0  # when the client last sent a frame
        self._pong_due = 0.0  # when a ping went out unanswered: the pong's deadline
        self.request_id = exchange(request).request_id
        """The handshake's ``X-Request-Id``: every error frame of the connection has it."""
        self.session = RealtimeSession(
            max_pending_input_bytes=config.realtime.max_pending_input_bytes,
            max_json_depth=config.limits.max_json_depth,
            request_id=self.request_id,
        )
        self.turn: Turn | None = None
        """The running turn, until it is over (its stream let go)."""

    @property
    def busy(self) -> bool:
        return self.turn is not None

    async def run(self) -> web.WebSocketResponse:
        ws = self.ws
        await ws.prepare(self.request)
        ws.headers.clear()  # sent: not kept for the connection's length
        # What the client got, whatever ends the session (the access line's status).
        exchange(self.request).status = ws.status
        self.runtime.sockets.add(self)
        self._last_seen = self._loop.time()
        self.runtime.watchdog.add(self, min(self._heartbeat_s, self._write_timeout_s) / 4)
        receive = ws.receive
        try:
            while True:
                message = await receive()
                if message.type in _CLOSED or not await self._receive(message):
                    break
                # Not held while the socket waits for its next frame (a turn may be long).
                del message
        finally:
            self.runtime.watchdog.discard(self)
            self.runtime.sockets.discard(self)
            await self._cancel_turn()
        return ws

    def check(self, now: float) -> None:
        """The watchdog's tick: a ping after ``heartbeat_interval_s`` without a frame from
        the client; no frame (a pong or any other) half an interval after it: the peer is
        gone, and the connection is dropped (its turn's stream with it). A socket paused
        for ``write_timeout_s`` without taking a byte: the peer does not read, and the
        connection is dropped too, whatever it sends."""
        stalled = self._stalled_for(now)
        if stalled >= self._write_timeout_s:
            log.warning("realtime client read nothing for %.1fs: dropping the connection", stalled)
            exchange(self.request).cancelled = "write_timeout"
            self._drop()
        elif self._pong_due:
            if now >= self._pong_due:
                log.info("realtime client did not answer a ping: dropping the connection")
                self._drop()
        elif now - self._last_seen >= self._heartbeat_s:
            self._pong_due = now + self._heartbeat_s / 2
            self._ping()

    def _stalled_for(self, now: float) -> float:
        """How long the socket has been paused without taking a byte (0.0: not paused).

        A write that waits (the turn's, or aiohttp's own for a frame or a pong) waits
        for this socket to unpause. Timed from the first tick that sees it paused;
        progress starts the clock again: a smaller buffer at a tick, and the end of
        the turn's wait (:meth:`send_texts`), so that a slow reader whose socket
        pauses and resumes between two ticks is not taken for one that stalled. A
        buffer that grows (pongs to the peer's pings, error frames, queued behind
        the turn's frames) is not progress.
        """
        transport = self.request.transport
        if transport is None or not self.paused:
            self._stalled = 0.0
            return 0.0
        size = transport.get_write_buffer_size()
        if not self._stalled or size < self._buffered:
            self._stalled = now  # paused since this tick, or the peer took some bytes
        self._buffered = size
        return now - self._stalled

    def _drop(self) -> None:
        """Abort the connection: the receive loop ends, and with it the turn."""
        transport = self.request.transport
        if transport is not None:
            transport.abort()

    def _ping(self) -> None:
        """A ping frame written straight to the socket, as a turn writes its frames.

        A control frame is never compressed nor fragmented (RFC 6455 5.5, RFC 7692 6.1),
        so it may go between any two frames. A task per ping (``ws.ping()`` is a
        coroutine) came to every idle connection at once, every interval, and raised
        their memory's high-water mark by ~0.3 KB each (bench/README.md).
        """
        transport = self.request.transport
        if transport is not None and not transport.is_closing() and not self.ws.closed:
            transport.write(_PING)

    async def _receive(self, message: WSMessage) -> bool:
        """Carry out what a client frame asks; False when the socket is done."""
        self._last_seen = self._loop.time()
        self._pong_due = 0.0  # any frame shows the client is there
        if message.type is WSMsgType.PING:
            with contextlib.suppress(ConnectionError):
                await self.ws.pong(message.data)
            return True
        if message.type is WSMsgType.PONG:
            return True
        if message.type is WSMsgType.TEXT:
            actions = self.session.receive_text(message.data)
        elif message.type is WSMsgType.BINARY:
            actions = self.session.receive_binary(message.data)
        else:  # ERROR: the reader already closed the socket (e.g. 1009)
            return False
        for action in actions:
            await self._do(action)
        return True

    async def _do(self, action: Send | StartTurn | AbortTurn) -> None:
        match action:
            case Send(frame=frame):
                await self.ws.send_str(frame)
            case StartTurn(request=request):
                try:
                    owner = self.key.name if self.key is not None else None
                    # As an HTTP request: the key's model, its rate, a place among the streams.
                    async with admit_stream(
                        self.request, self.key, request.model, param="request.model"
                    ):
                        opened = await self.hub.open(
                            request,
                            format=NDJSONEncoder.media_type,
                            owner=owner,
                            ctx=CallContext(
                                request_id=exchange(self.request).request_id,
                                key=owner,
                                endpoint="/v1/realtime",
                                format=NDJSONEncoder.media_type,
                            ),
                        )
                    reader = await self.hub.attach(
                        opened.id, meta=with_usage(opened.info.meta, request.include_usage)
                    )
                except GatewayError as exc:
                    # Refused before anything streamed: the pending input is kept.
                    self.session.start_refused()
                    await self.ws.send_str(gateway_error_frame(exc, self.request_id).frame)
                    return
                self.session.start_accepted()
                # A joined stream is another request's: this socket may leave it, never end it.
                turn = Turn(self, reader, None if opened.joined else opened.run)
                self.turn = turn
                turn.advance()
            case AbortTurn():
                running = self.turn
                if running is None:
                    return
                await running.stop()
                # Sent here, not by the turn: a turn stopped before it wrote anything must
                # still answer. A turn that already sent its end gets nothing more.
                if not running.terminated:
                    running.terminate()
                    with contextlib.suppress(ConnectionError):
                        await self.ws.send_str(_ABORTED)

    def write_now(self, payloads: list[bytes]) -> bool:
        """Write one text frame per payload at once, in one write; False when that cannot be
        done without a wait (the connection compresses, or is going away)."""
        ws = self.ws
        transport = self.request.transport
        if ws.compress or transport is None or ws.closed or transport.is_closing():
            return False
        if payloads:
            transport.write(text_frames(payloads))
        return True

    @property
    def paused(self) -> bool:
        """The socket's buffer is full: wait for it before writing more."""
        return self.request.protocol.writing_paused

    async def send_texts(self, payloads: list[bytes]) -> None:
        """One text frame per payload (see :meth:`write_now`; compressed ones framed by
        aiohttp, each), then the wait for a paused socket."""
        if not self.write_now(payloads):
            ws = self.ws
            if not ws.compress:
                raise ConnectionResetError("the realtime client went away")
            for payload in payloads:
                await ws.send_frame(payload, WSMsgType.TEXT)
        if self.paused:
            await self.request.protocol._drain_helper()  # aiohttp's own wait for the transport
        self._stalled = 0.0  # the socket took what it had: the next wait is timed afresh

    async def fail(self, frame: bytes) -> None:
        """A provider (or gateway) failure ends the connection: the error, then 1011."""
        with contextlib.suppress(ConnectionError):
            await self.ws.send_frame(frame, WSMsgType.TEXT)
            await self.ws.close(code=WSCloseCode.INTERNAL_ERROR, message=b"provider error")

    async def _cancel_turn(self) -> None:
        turn = self.turn
        if turn is not None:
            await turn.stop()

    async def shutdown(self) -> None:
        """Server shutdown: cancel the turn, close with 1001 (going away)."""
        await self._cancel_turn()
        with contextlib.suppress(Exception):
            await self.ws.close(code=WSCloseCode.GOING_AWAY, message=b"server shutting down")


class Turn:
    """One turn's writer: each event of its log as a text frame, then its end.

    It waits for the log without a task: :meth:`advance` writes what the log
    holds straight to the socket, then asks the log (:meth:`RunReader.notify`)
    to call it again when it grows. A task (``task``) runs only while the turn
    waits for something else: a paused socket, a compressing connection's
    writes, its end (the last frame, a close), a log read from the store (a
    stream of another replica's). An idle turn holds no task and no frame.
    """

    __slots__ = ("conn", "over", "reader", "run", "started", "task", "terminated")

    def __init__(self, conn: RealtimeConnection, reader: LogReader, run: StreamRun | None) -> None:
        self.conn = conn
        self.reader = reader
        self.run = run
        """The stream it ends when it ends early; None for one it only joined."""
        self.started = False  # an event went out: a failure is in-band from then on
        self.terminated = False  # its last frame went out: no aborted frame after it
        self.over = False
        self.task: asyncio.Task[None] | None = None

    def advance(self, _: object = None) -> None:
        """Write what the log holds beyond what was written; then wait for more."""
        if self.over or self.task is not None:
            return
        reader = self.reader
        if type(reader) is not RunReader:
            self._wait(self._finish([], None))
            return
        conn = self.conn
        try:
            while (batch := reader.poll()) is not None:
                payloads, end = self._payloads(batch)
                if end is not None or not conn.write_now(payloads):
                    self._wait(self._finish(payloads, end))
                    return
                if conn.paused:
                    self._wait(self._finish([], None))
                    return
        except Exception as exc:  # called by the loop: the turn's task handles it
            self._wait(self._finish([], exc))
            return
        reader.notify(self.advance)

    def _payloads(self, batch: list[StreamEvent]) -> tuple[list[bytes], StreamEvent | None]:
        """The frames of ``batch``'s events up to its terminal entry (returned beside them)."""
        payloads: list[bytes] = []
        for event in batch:
            cls = type(event)
            if cls is Done or cls is Error:
                return payloads, event
            self.started = True
            content = plain_content(event)
            if content is not None:
                payloads.append(_CONTENT_HEAD + _dumps(content) + b"}}")
            else:
                payloads.append(_dumps(event.to_dict()))
        return payloads, None

    def _wait(self, work: Coroutine[Any, Any, None]) -> None:
        self.task = asyncio.get_running_loop().create_task(work)

    async def _finish(self, payloads: list[bytes], end: StreamEvent | Exception | None) -> None:
        """The waiting part: write ``payloads`` (then ``end``, if any), waiting for the
        socket; then, on a local log, back to :meth:`advance`; on another, read it on.
        ``end`` may be what :meth:`advance` raised, to be handled here."""
        conn = self.conn
        back = False
        try:
            if isinstance(end, Exception):
                raise end
            await conn.send_texts(payloads)
            if end is None and type(self.reader) is not RunReader:
                async for batch in self.reader:
                    payloads, end = self._payloads(batch)
                    await conn.send_texts(payloads)
                    if end is not None:
                        break
                # else: the log ended without its terminal entry (a store that lost it)
            if end is not None:
                await self._end(end)
            else:
                back = type(self.reader) is RunReader
        except GatewayError as exc:
            self.terminate()
            with contextlib.suppress(ConnectionError):
                if exc.status >= 500:
                    await conn.fail(orjson.dumps(exc.to_event().to_dict(conn.request_id)))
                else:
                    await conn.ws.send_str(gateway_error_frame(exc, conn.request_id).frame)
        except ConnectionError:
            log.debug("realtime client went away mid-turn")
        except Exception:
            log.exception("realtime turn failed")
            self.terminate()
            await conn.fail(orjson.dumps(_INTERNAL.to_dict(conn.request_id)))
        finally:
            self.task = None
            if not back:
                await self._close()
        if back:
            self.advance()

    async def _end(self, event: StreamEvent) -> None:
        if type(event) is Done:
            self.terminate()  # before the frame: the client may start again
            await self.conn.ws.send_str(_ABORTED if event.aborted else _DONE)
            return
        failure = self.reader.failure
        if not self.started and failure is not None:
            raise failure
        self.terminate()
        body = event.to_dict(self.conn.request_id) if type(event) is Error else event.to_dict()
        await self.conn.fail(orjson.dumps(body))

    def terminate(self) -> None:
        """The turn's last frame is about to go out: the session may start the next."""
        self.terminated = True
        if self.conn.turn is self:
            self.conn.session.turn_ended()

    async def stop(self) -> None:
        """End the turn now (an abort, the socket gone, shutdown); its stream with it."""
        task = self.task
        if task is not None:
            task.cancel()
            await asyncio.wait((task,))
        await self._close()

    async def _close(self) -> None:
        """Over: the stream let go (ended, unless shared), the connection free for the next."""
        if self.over:
            return
        self.over = True
        conn = self.conn
        if conn.turn is self:
            conn.turn = None
            if not self.terminated:  # else the session already moved on: it may be streaming
                conn.session.turn_ended()
        await leave(self.reader, self.run)


_CLOSED = (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED)


async def handle(request: web.Request) -> web.StreamResponse:
    if request.app[state.RUNTIME].shutting_down:
        raise ServerShuttingDown("The server is shutting down; retry the request.")
    offered = tuple(
        p.strip() for p in request.headers.get("Sec-WebSocket-Protocol", "").split(",") if p.strip()
    )
    key = authenticate(request, offered)
    exchange(request).format = "websocket"
    return await RealtimeConnection(request, key, _chosen(offered)).run()


def _chosen(offered: tuple[str, ...]) -> tuple[str, ...]:
    """The subprotocol to answer with: a browser fails the handshake if none of the ones it
    offered comes back. ``nexus.v1`` when offered, else the key's own (it is the client's)."""
    if not offered:
        return ()
    if PROTOCOL in offered:
        return (PROTOCOL,)
    return (offered[0],)
