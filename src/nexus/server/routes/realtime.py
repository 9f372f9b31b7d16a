"""``GET /v1/realtime``: the WebSocket surface. The route only moves frames.

:class:`~nexus.protocol.realtime.RealtimeSession` holds the protocol; this
module feeds it the client's frames and carries out its actions. A turn
(:class:`Turn`) follows its stream's log in a task and sends each event as a
text frame: its NDJSON line without the newline, the last ``{"type":"done"}``.

* ``abort`` cancels the turn's stream at once, then ``{"type":"done","aborted":true}``.
* A provider failure: the error frame, then close 1011. A request-level
  failure (unknown model, unsupported input): the error frame; the connection
  stays open. Each ``start`` is admitted as an HTTP request is
  (:func:`~nexus.server.access.admit_stream`); a refusal is an error frame
  (with ``retry_after_s`` when HTTP would send ``Retry-After``).
* Pings after ``heartbeat_interval_s`` without a frame from the peer; no answer
  in half that time drops the connection. A peer that does not read (its socket
  full, taking no byte for ``write_timeout_s``) is aborted: a ``write_timeout``.
  Both are the watchdog's checks (:class:`~nexus.server.writer.Writer`).
* A message over ``[realtime] max_message_bytes`` closes with 1009. Shutdown
  ends a running turn with a retryable ``server_shutting_down`` error frame,
  then closes with 1001.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from aiohttp import WSCloseCode, WSMessage, WSMsgType, web

from ...auth import ApiKey
from ...cache.readers import leave, with_usage
from ...cache.run import LogReader, StreamRun
from ...encoders.ndjson import NDJSONEncoder
from ...errors import GatewayError, ServerShuttingDown
from ...events import Done, Error, StreamEvent
from ...hooks import CallContext
from ...protocol.realtime import (
    AbortTurn,
    RealtimeSession,
    Send,
    StartTurn,
    gateway_error_frame,
)
from ...protocol.websocket_frames import text_frames
from .. import state
from ..access import (
    account_at_end,
    admit_stream,
    authenticate,
    budgeted,
    exchange,
    log_value,
)
from ..writer import Writer
from .common import check_open

__all__ = ["RealtimeConnection", "Turn", "handle"]

log = logging.getLogger("nexus.realtime")

PROTOCOL = "nexus.v1"
"""The subprotocol a browser offers beside ``nexus-key.<key>`` (the one answered)."""
_ABORTED = '{"type":"done","aborted":true}'
_INTERNAL = Error(
    error_type="server_error",
    message="The gateway failed during this turn.",
    code="internal_error",
    retryable=True,
)
_SHUTDOWN = ServerShuttingDown("The server is shutting down; retry the request.").to_event()


class RealtimeConnection(Writer):
    """One WebSocket client: its session, its socket, at most one running turn."""

    name = "a realtime connection"

    def __init__(
        self, request: web.Request, key: ApiKey | None = None, protocols: tuple[str, ...] = ()
    ) -> None:
        app = request.app
        config = app[state.CONFIG]
        self.runtime = app[state.RUNTIME]
        super().__init__(
            request,
            heartbeat_s=config.server.heartbeat_interval_s,
            write_timeout_s=config.server.write_timeout_s,
            watchdog=self.runtime.watchdog,
        )
        self.key = key
        self.hub = app[state.HUB]
        # Pings are the watchdog's (see check()), not aiohttp's timers per connection.
        self.ws = web.WebSocketResponse(
            autoping=False,
            max_msg_size=config.realtime.max_message_bytes,
            protocols=protocols,
            compress=config.realtime.compression,
        )
        self._last_seen = 0.0  # when the client last sent a frame
        self._pong_due = 0.0  # when a ping went out unanswered: the pong's deadline
        self._closing: asyncio.Task[object] | None = None  # the shutdown's close
        self._handling = False  # a client frame is being carried out
        self.request_id = exchange(request).request_id
        """The handshake's ``X-Request-Id``: every error frame of the connection has it."""
        self.session = RealtimeSession(
            max_pending_input_bytes=config.realtime.max_pending_input_bytes,
            max_json_depth=config.limits.max_json_depth,
            max_json_items=config.limits.max_json_items,
            request_id=self.request_id,
            ledger=self.runtime.pending,
            owner=key.name if key is not None else "",
        )
        self.turn: Turn | None = None
        """The running turn, until it is over (its stream let go)."""

    @property
    def busy(self) -> bool:
        """A turn runs, or a client frame is being carried out (an abort's answer is
        still to go out): the server's shutdown does not close it yet."""
        return self.turn is not None or self._handling

    async def run(self) -> web.WebSocketResponse:
        ws = self.ws
        await ws.prepare(self.request)
        ws.headers.clear()  # sent: not kept for the connection's length
        # What the client got, whatever ends the session (the access line's status).
        exchange(self.request).status = ws.status
        self.runtime.sockets.add(self)
        self._last_seen = self._loop.time()
        self._watch(True)
        receive = ws.receive
        try:
            while True:
                message = await receive()
                self._handling = True
                try:
                    if message.type in _CLOSED or not await self._receive(message):
                        break
                finally:
                    self._handling = False
                # Not held while the socket waits for its next frame (a turn may be long).
                del message
            if self._closing is not None:
                await self._closing  # the shutdown's close frames, before the handler ends
        finally:
            self._watch(False)
            self.runtime.sockets.discard(self)
            self.session.close()  # its pending input no longer counts against its key
            await self._cancel_turn()
        return ws

    def check(self, now: float) -> None:
        """The watchdog's tick; and no frame half an interval after a ping: the peer is
        gone, and the connection is dropped (its turn's stream with it)."""
        # (Not while the server stops: the grace ends the socket, its turn's frame first.)
        if self._pong_due and now >= self._pong_due and not self.runtime.shutting_down:
            log.info("realtime client did not answer a ping: dropping the connection")
            self._drop()
        else:
            super().check(now)

    def _beat_due(self, now: float) -> bool:
        return not self._pong_due and now - self._last_seen >= self.heartbeat_s

    async def _heartbeat(self) -> None:
        self._pong_due = self._loop.time() + self.heartbeat_s / 2
        if not self.ws.closed:
            await self.ws.ping()

    def _drop(self) -> None:
        """Abort the connection: the receive loop ends, and with it the turn."""
        transport = self.request.transport
        if transport is not None:
            transport.abort()

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
            case Send(frame=text):
                await self.ws.send_str(text)
            case StartTurn(request=request):
                try:
                    owner = self.key.name if self.key is not None else None
                    # As an HTTP request: the key's model, its rate, its budget's hold, a
                    # place among the streams.
                    request, hold = budgeted(self.request, self.key, request)
                    async with admit_stream(
                        self.request, self.key, request.model, param="request.model", hold=hold
                    ):
                        opened = await self.hub.open(
                            request,
                            format=NDJSONEncoder.media_type,
                            owner=owner,
                            ctx=CallContext(
                                request_id=self.request_id,
                                key=owner,
                                endpoint="/v1/realtime",
                                format=NDJSONEncoder.media_type,
                            ),
                        )
                    reader = await self.hub.reader_of(
                        opened, meta=with_usage(opened.info.meta, request.include_usage)
                    )
                except GatewayError as exc:
                    # Refused before anything streamed: the pending input is kept. The
                    # socket's access line is one for all its turns: this outcome's own.
                    log.warning(
                        "%s start refused: %s (key=%s model=%s)",
                        self.request_id,
                        exc.code,
                        owner,
                        log_value(request.model),
                    )
                    self.session.start_refused()
                    await self.ws.send_str(gateway_error_frame(exc, self.request_id).frame)
                    return
                self.session.start_accepted()
                # A joined stream is another request's: this socket may leave it, never end it.
                run = None if opened.joined else opened.run
                if run is not None and opened.cache != "hit":
                    # The socket's access line is one for all its turns: each its own spend.
                    account_at_end(self.request.app, exchange(self.request), run, request.model)
                self.turn = Turn(self, reader, run)
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

    @property
    def paused(self) -> bool:
        """The socket's buffer is full: writes wait for it."""
        return self.request.protocol.writing_paused

    async def send_texts(self, payloads: list[bytes]) -> None:
        """One text frame per payload, timed by the watchdog."""
        await self._timed(self._send_texts(payloads))

    @property
    def writable(self) -> bool:
        """:meth:`write_now` may write: nothing else is being written, the socket takes
        more, the connection is open and does not compress (aiohttp's writer then holds
        the deflate context), the client is there."""
        transport = self.request.transport
        return not (
            self._writing
            or self.ws.compress
            or self.ws.closed
            or transport is None
            or transport.is_closing()
            or self.request.protocol.writing_paused
        )

    def write_now(self, payloads: list[bytes]) -> None:
        """One text frame per payload, handed to the transport in one write (when
        :attr:`writable`): nothing waits, as in the HTTP pump's push. Should these bytes
        fill the socket, the wait is left to the next write, which the turn's task makes
        through aiohttp (a paused socket is never written to here)."""
        self.request.transport.write(text_frames(payloads))  # type: ignore[union-attr]
        self._wrote()

    async def _send_texts(self, payloads: list[bytes]) -> None:
        send = self.ws.send_frame
        for payload in payloads:
            await send(payload, WSMsgType.TEXT)

    async def fail(self, payload: bytes) -> None:
        """A provider (or gateway) failure ends the connection: the error, then 1011."""
        with contextlib.suppress(ConnectionError):
            await self.ws.send_frame(payload, WSMsgType.TEXT)
            await self.ws.close(code=WSCloseCode.INTERNAL_ERROR, message=b"provider error")

    async def _cancel_turn(self) -> None:
        turn = self.turn
        if turn is not None:
            await turn.stop()

    async def shutdown(self) -> None:
        """Server shutdown: a running turn's stream is cancelled and the turn ends with a
        retryable error frame; then the close, 1001 (going away)."""
        self._closing = asyncio.current_task()  # the handler waits for the close to be done
        turn = self.turn
        await self._cancel_turn()
        with contextlib.suppress(Exception):
            if turn is not None and not turn.terminated:
                turn.terminate()
                await self.ws.send_frame(turn.encoder.error(_SHUTDOWN)[:-1], WSMsgType.TEXT)
            await self.ws.close(code=WSCloseCode.GOING_AWAY, message=b"server shutting down")


class Turn:
    """One turn's writer: each event of its log as a text frame, then its end, in a task
    (or, once caught up, each new batch pushed to it: :meth:`_push`)."""

    __slots__ = ("conn", "encoder", "over", "reader", "run", "started", "task", "terminated")

    def __init__(self, conn: RealtimeConnection, reader: LogReader, run: StreamRun | None) -> None:
        self.conn = conn
        self.reader = reader
        self.run = run
        """The stream it ends when it ends early; None for one it only joined."""
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
        conn.write_now([encode(event)[:-1] for event in batch])
        self.started = True
        return True

    async def _follow(self) -> None:
        """Write the log's events as they come, then the end; waiting for the socket."""
        conn = self.conn
        encode = self.encoder.encode
        try:
            async for batch in self.reader:
                payloads: list[bytes] = []
                for event in batch:
                    cls = type(event)
                    if cls is Done or cls is Error:
                        await conn.send_texts(payloads)
                        await self._end(event)  # type: ignore[arg-type]
                        return
                    self.started = True
                    payloads.append(encode(event)[:-1])
                await conn.send_texts(payloads)
            # The log ended without its terminal entry (a store that lost it).
        except GatewayError as exc:
            self.terminate()
            with contextlib.suppress(ConnectionError):
                if exc.status >= 500:
                    await conn.fail(self.encoder.error(exc.to_event())[:-1])
                else:
                    await conn.ws.send_str(gateway_error_frame(exc, conn.request_id).frame)
        except ConnectionError:
            log.debug("realtime client went away mid-turn")
        except Exception:
            log.exception("realtime turn failed")
            self.terminate()
            await conn.fail(self.encoder.error(_INTERNAL)[:-1])
        finally:
            await self._close()

    async def _end(self, event: Done | Error) -> None:
        if type(event) is Done:
            self.terminate()  # before the frame: the client may start again
            await self.conn.ws.send_frame(self.encoder.encode(event)[:-1], WSMsgType.TEXT)
            return
        failure = self.reader.failure
        if not self.started and failure is not None:
            raise failure
        self.terminate()
        await self.conn.fail(self.encoder.error(event)[:-1])  # type: ignore[arg-type]

    def terminate(self) -> None:
        """The turn's last frame is about to go out: the session may start the next."""
        self.terminated = True
        if self.conn.turn is self:
            self.conn.session.turn_ended()

    async def stop(self) -> None:
        """End the turn now (an abort, the socket gone, shutdown); its stream with it."""
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
        conn = self.conn
        if conn.turn is self:
            conn.turn = None
            if not self.terminated:  # else the session already moved on: it may be streaming
                conn.session.turn_ended()
        await leave(self.reader, self.run)


_CLOSED = (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED)


async def handle(request: web.Request) -> web.StreamResponse:
    check_open(request)
    offered = tuple(
        p.strip() for p in request.headers.get("Sec-WebSocket-Protocol", "").split(",") if p.strip()
    )
    key = authenticate(request, offered)
    exchange(request).format = "websocket"
    return await RealtimeConnection(request, key, _chosen(offered)).run()


def _chosen(offered: tuple[str, ...]) -> tuple[str, ...]:
    """The subprotocol to answer with: a browser fails the handshake if none of the ones it
    offered comes back. ``nexus.v1`` when offered, else the key's own (it is the client's)."""
    return (PROTOCOL,) if PROTOCOL in offered else offered[:1]
