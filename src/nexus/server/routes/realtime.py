"""``GET /v1/realtime``: the WebSocket surface. The route only moves frames.

:class:`~nexus.protocol.realtime.RealtimeSession` holds the protocol; this module feeds it
the client's frames and carries out its actions. A turn (:class:`~.realtime_turn.Turn`)
follows its stream's log and sends each event as a text frame (its NDJSON line), the last
``{"type":"done"}``. The handshake's ``anthropic-beta`` header holds for every turn.

* ``abort`` cancels the turn's stream at once and, once it ended (its key's places back, its
  spend charged: a barge-in's ``start`` finds it gone), ``{"type":"done","aborted":true}``.
* A provider failure: the error frame, then close 1011. A request-level failure (unknown
  model, unsupported input) or a turn past its own limit (its duration, its log's size):
  the error frame; the connection stays open. Each ``start`` is admitted as an HTTP request
  is (:func:`~nexus.server.key_admission.admit_stream`); a refusal is an error frame (with
  ``retry_after_s`` when HTTP would send ``Retry-After``).
* Pings after ``heartbeat_interval_s`` without a frame from the peer; no answer in half that
  time drops the connection. A peer that does not read (its socket full, taking no byte for
  ``write_timeout_s``) is aborted: a ``write_timeout``. Both are the watchdog's checks.
* Each frame is counted against the socket's budget (``[realtime] max_frames_per_second``,
  ``max_bytes_per_second``: :class:`~nexus.protocol.realtime_budget.FrameBudget`) and the
  loop is yielded to after it (aiohttp hands over every frame of one read without the loop
  turning: tiny frames sent flat out would hold it). Past the budget, or after
  ``max_invalid_frames`` errors in a row: closed 1008.
* A message over ``[realtime] max_message_bytes`` closes with 1009, text not UTF-8 with 1007
  (``cancelled:protocol_error``). Shutdown ends a running turn with a retryable
  ``server_shutting_down`` error frame, then closes 1001; a ``start`` in its grace is refused
  so, and closes 1001 unless a turn runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time

from aiohttp import WebSocketError, WSCloseCode, WSMessage, WSMsgType, web

from ...auth import ApiKey
from ...cache.readers import with_usage
from ...encoders.ndjson import NDJSONEncoder
from ...errors import GatewayError, ServerShuttingDown
from ...hooks import CallContext
from ...protocol.anthropic_betas import parse_betas
from ...protocol.negotiation import select_subprotocol
from ...protocol.realtime import (
    AbortTurn,
    Close,
    Decoded,
    RealtimeSession,
    Send,
    StartTurn,
)
from ...protocol.realtime_budget import FrameBudget, frame_size
from ...protocol.realtime_envelopes import gateway_error_frame
from ...protocol.websocket_frames import text_frames
from .. import state
from ..access import METRICS, account_at_end, exchange
from ..key_admission import admit, admit_stream, authenticate, budgeted
from ..log_lines import quoted
from ..state import Exchange
from ..writer import Writer
from .common import check_open, count_cache, join_place, with_betas
from .realtime_keys import key_socket
from .realtime_turn import FORMAT, FrameMeter, Turn

__all__ = ["RealtimeConnection", "handle"]

log = logging.getLogger("nexus.realtime")

POLICY_CLOSE_WAIT_S = 1.0  # a peer closed 1008 answers the close within this (or is cut off)
ABORT_WAIT_S = 5.0  # an abort's done waits for its stream's end this long at most
_ABORTED = '{"type":"done","aborted":true}'
_SHUTDOWN = ServerShuttingDown("The server is shutting down; retry the request.").to_event()


class RealtimeConnection(Writer):
    """One WebSocket client: its session, its socket, at most one running turn."""

    name = "a realtime connection"

    def __init__(
        self,
        request: web.Request,
        key: ApiKey | None = None,
        protocols: tuple[str, ...] = (),
        *,
        token: bool = False,
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
        exchange(request).upgraded = self.ws  # (see server/errors.py: its unexpected errors)
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
            max_invalid_frames=config.realtime.max_invalid_frames,
        )
        self.budget = FrameBudget(
            frames_per_s=config.realtime.max_frames_per_second,
            bytes_per_s=config.realtime.max_bytes_per_second,
            max_message_bytes=config.realtime.max_message_bytes,
            max_pending_input_bytes=config.realtime.max_pending_input_bytes,
            now=self._loop.time(),
        )
        self.turn: Turn | None = None  # the running turn, until it is over (its stream let go)
        self.meter = FrameMeter(app.get(METRICS), exchange(request))  # its turns' frames
        self._left = False  # the socket is done: the client is gone, or closed 1008
        self._logged: set[str] = set()  # the refusal codes logged for this socket
        self._token = token  # the handshake's rate token, which the first start uses
        self._retry_at = -math.inf  # until when the last refusal told the client to wait

    @property
    def busy(self) -> bool:
        """A turn runs, or a client frame is being carried out (an abort's answer is
        still to go out): the server's shutdown does not close it yet."""
        return self.turn is not None or self._handling

    async def run(self) -> web.WebSocketResponse:
        ws = self.ws
        ws.headers.update(exchange(self.request).headers)  # its X-Request-Id, as every answer's
        await ws.prepare(self.request)
        ws.headers.clear()  # sent: not kept for the connection's length
        ex = exchange(self.request)  # its access line: the status the client got, whatever
        ex.status, ex.streamed = ws.status, True  # ends it; its turns' frames (the meter's)
        self.runtime.sockets.add(self)
        self._last_seen = self._loop.time()
        self._watch(True)
        receive = ws.receive
        pause = asyncio.sleep
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
                # receive() returns without suspending while frames are queued: each frame
                # lets the other connections run (see the module docstring).
                await pause(0)
            if self._closing is not None:
                await self._closing  # the shutdown's close frames, before the handler ends
        finally:
            self._watch(False)
            self.meter.flush()
            self.runtime.sockets.discard(self)
            self.session.close()  # its pending input no longer counts against its key
            # Why the socket ended, for its turn: a ping or write timeout, a policy close,
            # the client leaving (its close frame, or its connection gone).
            await self._cancel_turn(exchange(self.request).cancelled or "client_disconnect")
        return ws

    def check(self, now: float) -> None:
        """The watchdog's tick; and no frame half an interval after a ping: the peer is
        gone, and the connection is dropped (its turn's stream with it). Not while the
        server stops: the grace ends the socket, its turn's frame first."""
        if self._pong_due and now >= self._pong_due and not self.runtime.shutting_down:
            log.info("realtime client did not answer a ping: dropping the connection")
            ex = exchange(self.request)
            ex.cancelled = ex.cancelled or "ping_timeout"
            self._drop()
        else:
            self.meter.flush()
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
        now = self._last_seen = self._loop.time()
        self._pong_due = 0.0  # any frame shows the client is there
        data = message.data
        over = self.budget.take(frame_size(data), now)
        if over is not None:
            await self._refuse_socket(over)
            return False
        if message.type is WSMsgType.PING:
            with contextlib.suppress(ConnectionError):
                await self.ws.pong(message.data)
            return True
        if message.type is WSMsgType.PONG:
            return True
        if message.type is WSMsgType.TEXT:
            decoded = self.session.decode(data)
            if not isinstance(decoded, Decoded):
                actions = decoded
            elif decoded.start and self.runtime.shutting_down:
                return await self._start_while_stopping(decoded)
            elif decoded.start and not await self._rate_token(decoded):
                return not self._left
            else:
                actions = self.session.receive_decoded(decoded)
                first = actions[0] if decoded.start else None  # (a start has an answer)
                if type(first) is Send and first.code:  # invalid, or while a turn runs
                    self._count_refusal(first.code, decoded.model)
        elif message.type is WSMsgType.BINARY:
            actions = self.session.receive_binary(message.data)
        else:  # ERROR: aiohttp closed the socket; WebSocketError: the peer broke the protocol
            if isinstance(error := message.data, WebSocketError):  # 1009, 1007, 1002
                log.warning("%s realtime socket closed %d: %s", self.request_id, error.code, error)
                exchange(self.request).cancelled = "protocol_error"
            return False
        for action in actions:
            if type(action) is Close:
                await self._refuse_socket(action.reason)
                return False
            await self._do(action)  # type: ignore[arg-type]
            if self._left:
                return False
        return True

    async def _send(self, text: str) -> None:
        """One text frame. A client that is gone (reset, or closed as the frame went out)
        has left, as a client closing does: the socket is done (:attr:`_left`), its access
        line ``cancelled:client_disconnect``, and nothing is logged as a failure."""
        try:
            await self.ws.send_str(text)
        except ConnectionError:
            self._left = True
            ex = exchange(self.request)
            ex.cancelled = ex.cancelled or "client_disconnect"

    async def _start_while_stopping(self, decoded: Decoded) -> bool:
        """A ``start`` in the shutdown's grace (a voice client's barge-in): no turn, no rate
        token, a retryable ``server_shutting_down``; with no turn left to finish, the socket
        closes 1001 at once. False when the socket is done."""
        await self._refused(ServerShuttingDown(_SHUTDOWN.message), decoded.model)
        if self.turn is not None or self._left:
            return not self._left
        exchange(self.request).cancelled = "shutdown"
        await self._going_away()
        return False

    async def _going_away(self) -> None:
        """The shutdown's close: 1001 (going away)."""
        with contextlib.suppress(Exception):
            await self.ws.close(code=WSCloseCode.GOING_AWAY, message=b"server shutting down")

    async def _rate_token(self, decoded: Decoded) -> bool:
        """A token of the key's rate for a ``start``, taken before it is parsed (as HTTP takes
        it before the body); False, its refusal sent, when over the rate. The first ``start``
        uses the handshake's token: a socket and its first turn cost one (a key allowed one
        request a second can open a socket and start at once)."""
        if self._token:
            self._token = False
            return True
        try:
            await admit(self.request, self.key, None)
        except GatewayError as exc:
            await self._refused(exc, decoded.model)
            return False
        return True

    async def _refused(self, exc: GatewayError, model: str | None) -> None:
        """A ``start`` refused before anything streamed (its rate, its admission): its
        error frame, counted, and a strike towards ``max_invalid_frames`` if sent before the
        last refusal's ``retry_after_s`` (or after one no wait mends): a client that waits
        as told is never closed, one retrying at once is."""
        self._count_refusal(exc.code, model)
        now, wait = asyncio.get_running_loop().time(), exc.headers.get("Retry-After", "")
        strike = now < self._retry_at or (not exc.retryable and not wait)  # (no wait mends it)
        self._retry_at = now + (int(wait) if wait.isdigit() else 1)
        frame = gateway_error_frame(exc, self.request_id, refused="start")
        for action in self.session.refused(frame, strike):
            if type(action) is Close:
                await self._refuse_socket(action.reason)
                self._left = True  # the socket is done
            else:
                await self._send(action.frame)  # type: ignore[union-attr]

    def _count_refusal(self, code: str, model: str | None) -> None:
        """A refused ``start``: the socket's access line is one for all its turns and
        counts them (``refused``); the first refusal of each code on the socket is a
        warning of its own, the others only counted, since a client retrying in a loop
        would otherwise write a line a frame."""
        exchange(self.request).refused += 1
        metrics = self.request.app.get(METRICS)
        if metrics is not None:  # counted as an HTTP request refused so is
            metrics.refused_start(model, code)
        if code not in self._logged:
            self._logged.add(code)
            log.warning(
                "%s start refused: %s (key=%s model=%s); more on this socket are counted "
                "in its access line (refused=)",
                self.request_id,
                code,
                self.key.name if self.key is not None else None,
                quoted(model),
            )

    async def _refuse_socket(self, reason: str) -> None:
        """Close the socket with 1008 (policy violation): the peer broke its budget or
        sent invalid frames in a row. Its turn ends with the socket."""
        log.warning("%s realtime socket closed: %s", self.request_id, reason)
        exchange(self.request).cancelled = "policy_violation"
        # aiohttp's close reads the peer's frames until its close frame: a peer that keeps
        # flooding is cut off (the connection closed) after POLICY_CLOSE_WAIT_S.
        with contextlib.suppress(ConnectionError, TimeoutError):
            async with asyncio.timeout(POLICY_CLOSE_WAIT_S):
                await self.ws.close(code=WSCloseCode.POLICY_VIOLATION, message=reason.encode())

    async def _do(self, action: Send | StartTurn | AbortTurn) -> None:
        match action:
            case Send(frame=text):
                await self._send(text)
            case StartTurn(request=request):
                started = time.monotonic()
                try:
                    owner = self.key.name if self.key is not None else None
                    # As an HTTP request: its betas, the key's model, its rate, its budget's
                    # hold, a place among the streams.
                    betas = with_betas(self.request, request)  # (the handshake's header)
                    request, hold = budgeted(self.request, self.key, betas)
                    async with admit_stream(
                        self.request,
                        self.key,
                        request.model,
                        param="request.model",
                        rate_taken=True,  # by the frame (_rate_token)
                        hold=hold,
                    ):
                        opened = await self.hub.open(
                            request,
                            format=NDJSONEncoder.media_type,
                            owner=owner,
                            ctx=CallContext(
                                self.request_id, owner, "/v1/realtime", NDJSONEncoder.media_type
                            ),
                        )
                    place = await join_place(self.request, self.key, opened, False)
                    reader = await self.hub.reader_of(
                        opened, meta=with_usage(opened.info.meta, request.include_usage)
                    )
                except GatewayError as exc:
                    self.session.start_refused()  # the pending input is kept
                    await self._refused(exc, request.model)
                    return
                self.session.start_accepted()
                # A joined stream is another request's: this socket may leave it, never end it.
                run = None if opened.joined else opened.run
                record = Exchange(
                    self.request_id,
                    started,
                    exchange(self.request).client_request_id,  # the socket's, for each turn
                    endpoint="/v1/realtime",
                    format=NDJSONEncoder.media_type,
                    key=self.key,
                    model=request.model,
                )
                count_cache(self.request, record, opened)
                if run is not None and opened.cache != "hit":
                    # The socket's access line is one for all its turns: each its own spend.
                    account_at_end(self.request.app, record, run, refusal=True)
                self.turn = Turn(self, reader, run, record, place)
            case AbortTurn():
                running = self.turn
                if running is None:
                    return
                await running.stop("aborted")
                if running.run is not None and running.run.ending:  # (ended by it: not shared)
                    await asyncio.wait((running.run.done,), timeout=ABORT_WAIT_S)
                # Sent here, not by the turn: a turn stopped before it wrote anything must
                # still answer. A turn that already sent its end gets nothing more.
                if not running.terminated:
                    running.terminate()
                    await self._send(running.last(_ABORTED))

    @property
    def cause(self) -> str | None:
        """Why the socket is ending, when the gateway ends it (``ping_timeout``,
        ``write_timeout``, ``policy_violation``); None: the client's doing."""
        return exchange(self.request).cancelled

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

    async def _cancel_turn(self, cause: str) -> None:
        if (turn := self.turn) is not None:
            await turn.stop(cause)

    async def shutdown(self) -> None:
        """Server shutdown: a running turn's stream is cancelled and the turn ends with a
        retryable error frame; then the close, 1001 (going away)."""
        self._closing = asyncio.current_task()  # the handler waits for the close to be done
        # Its access line: the peer's answer to the close may cancel the handler (with
        # handler_cancellation) as it waits, which would otherwise read as the client's.
        ex = exchange(self.request)
        ex.cancelled = ex.cancelled or "shutdown"
        turn = self.turn
        await self._cancel_turn("shutdown")
        with contextlib.suppress(Exception):
            if turn is not None and not turn.terminated:
                turn.terminate()
                await self.ws.send_frame(
                    turn.last(turn.encoder.error(_SHUTDOWN)[:-1]), WSMsgType.TEXT
                )
        await self._going_away()


_CLOSED = (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED)


async def handle(request: web.Request) -> web.StreamResponse:
    check_open(request)
    offered = tuple(
        p.strip() for p in request.headers.get("Sec-WebSocket-Protocol", "").split(",") if p.strip()
    )
    chosen = select_subprotocol(offered)  # (before the key: it answers any caller alike)
    protocols = () if chosen is None else (chosen,)
    key = authenticate(request, offered)
    exchange(request).format = FORMAT
    parse_betas(request.headers.getall("anthropic-beta", ()))  # bad: a 400, not each turn's
    if key is None:
        return await RealtimeConnection(request, key, protocols).run()
    # As an HTTP request: a token of the key's rate (its first start's); then a place
    # among its sockets.
    await admit(request, key, None)
    async with key_socket(request, key):
        return await RealtimeConnection(request, key, protocols, token=True).run()
