"""The connection layer of ``nexus serve``: slow and idle clients, a connection cap,
parser errors that reveal nothing, masked WebSocket frames.

:class:`Connection` subclasses aiohttp's :class:`~aiohttp.web.RequestHandler` (one per
connection) through public methods only, each calling ``super()``;
:class:`ConnectionSite` listens with it, as ``TCPSite`` does; a
:class:`~nexus.server.connection_registry.ConnectionRegistry` counts the connections
and keeps their deadlines, with one watchdog tick for all of them. A connection is
always in one phase::

    connect ──> HEAD ──(request head complete: the handler starts)──> BUSY
                 ^                                                     │
                 └──(first byte of the next request)── IDLE <──(response written)
    BUSY ──(WebSocket upgrade)──> UPGRADED        past max_connections ──> REJECTED

HEAD lasts at most ``[server] header_timeout_s``, IDLE ``keepalive_timeout_s``; BUSY
and UPGRADED are timed where the body, the stream or the WebSocket is handled, so a
long stream is never cut here. Writes that stay paused with no byte leaving the buffer
for three times ``write_timeout_s`` close the connection: the net under answers the
stream pump does not time. A REJECTED connection gets a 503 ``too_many_connections``
at once, without the app, and is closed at its EOF or a second later. "The handler
starts" is :func:`connection_middleware`; "the response is written" is aiohttp's
``log_access`` call.

After an upgrade, an unmasked client frame (RFC 6455 §5.1) gets a 1002 close. A parser
error is answered 400 ``invalid_request`` with the parser's reason but not its excerpt
of the raw bytes, and has an access line (:mod:`nexus.server.rejections`);
:mod:`nexus.server.redaction` covers whatever else aiohttp logs.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import sys
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, cast

import orjson
from aiohttp import web
from aiohttp.http import HttpProcessingError, WebSocketReader
from yarl import URL

from ..errors import GatewayError
from ..protocol.websocket_frames import MaskScanner, close_frame
from .connection_registry import ConnectionRegistry, Phase
from .errors import Handler
from .rejections import Rejected
from .state import REQUEST_HANDLER_ARGS, new_request_id

if TYPE_CHECKING:
    from aiohttp.web_request import BaseRequest

__all__ = [
    "HANDLER_ARGS",
    "Connection",
    "ConnectionRegistry",
    "ConnectionSite",
    "Phase",
    "connection_middleware",
    "kernel_queued",
]

HANDLER_ARGS: dict[str, Any] = {"auto_decompress": False}
"""What every request handler is built with (``create_app``'s and :class:`ConnectionSite`'s):
the routes inflate bodies after the key check, in bounded pieces."""

log = logging.getLogger("nexus.server")

_UNMASKED = close_frame(1002, "client frames must be masked")


def _json_response(error: GatewayError) -> web.Response:
    response = web.Response(
        status=error.status,
        body=orjson.dumps(error.openai_body()),
        content_type="application/json",
        headers=error.headers,
    )
    response.force_close()
    return response


class _MaskCheckedReader:
    """aiohttp's WebSocket frame reader behind a :class:`MaskScanner`."""

    __slots__ = ("connection", "reader", "scanner")

    def __init__(self, reader: WebSocketReader, connection: Connection) -> None:
        self.reader = reader
        self.connection = connection
        self.scanner = MaskScanner()

    def feed_data(self, data: bytes) -> tuple[bool, bytes]:
        if self.scanner.feed(data):
            return self.reader.feed_data(data)
        self.connection.fail_websocket()
        return True, b""

    def feed_eof(self) -> None:
        self.reader.feed_eof()


class Connection(web.RequestHandler):
    """aiohttp's request handler (one per connection), tracked by a :class:`ConnectionRegistry`."""

    __slots__ = ("phase", "registry", "timed_elsewhere", "wire")

    phase: Phase
    timed_elsewhere: bool
    """A stream pump times this connection's writes: the registry's stall net skips it."""
    wire: asyncio.Transport | None
    """The transport, kept after ``force_close`` forgets it, to abort an expired one."""

    def __init__(self, manager: web.Server, registry: ConnectionRegistry, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self.registry = registry
        self.phase = Phase.HEAD
        self.timed_elsewhere = False
        self.wire = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        registry = self.registry
        now = asyncio.get_running_loop().time()
        if registry.admit(self, now):
            self.wire = cast(asyncio.Transport, transport)
            super().connection_made(transport)
            return
        # Not handed to aiohttp: no request task, no parser; the 503, then EOF.
        writer = cast(asyncio.Transport, transport)
        if not registry.linger(self, transport, now):
            writer.abort()
            return
        # Its id is in the answer; no access line (counted and warned of in the registry).
        writer.write(registry.rejection(new_request_id()))
        if writer.can_write_eof():
            writer.write_eof()

    def data_received(self, data: bytes) -> None:
        phase = self.phase
        if phase is Phase.IDLE and data:
            self.registry.head_begun(self, asyncio.get_running_loop().time())
        elif phase is Phase.REJECTED:
            return  # read and dropped, so that closing does not reset the 503
        super().data_received(data)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.wire = None
        rejected = self.phase is Phase.REJECTED
        self.registry.lost(self)
        if not rejected:
            super().connection_lost(exc)

    def set_parser(self, parser: Any, data_received_cb: Any = None) -> None:
        """The WebSocket upgrade: untimed from now on, and every frame must be masked."""
        self.registry.upgraded(self)
        checked = _MaskCheckedReader(parser, self)
        super().set_parser(cast(WebSocketReader, checked), data_received_cb)

    def log_access(
        self, request: BaseRequest, response: web.StreamResponse, time: float | None
    ) -> None:
        self.registry.response_done(self, asyncio.get_running_loop().time())
        super().log_access(request, response, time)

    def request_started(self) -> None:
        self.registry.request_started(self)

    def expire(self, reason: str) -> None:
        log.debug("closing a connection from %s: %s", self.peername, reason)
        if self.wire is not None:
            self.wire.abort()  # close() would first wait to write what the client does not read
        self.force_close()

    def hang_up(self) -> None:
        self.force_close()  # (aiohttp's: the transport closes once its buffer is out)

    def write_buffer_size(self) -> int:
        """What waits for the client: the transport's buffer and the kernel's queue."""
        wire = self.wire
        return 0 if wire is None else wire.get_write_buffer_size() + kernel_queued(wire)

    def pause_writing(self) -> None:
        """The transport's buffer is full: timed by the registry until it drains."""
        super().pause_writing()
        self.registry.write_paused(self, asyncio.get_running_loop().time())

    def resume_writing(self) -> None:
        super().resume_writing()
        self.registry.write_resumed(self)

    def fail_websocket(self) -> None:
        """An unmasked client frame: close 1002, and the connection (RFC 6455 §5.1, §7.1.7)."""
        log.info("closing a WebSocket from %s: an unmasked client frame (1002)", self.peername)
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.write(_UNMASKED)
        self.force_close()

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """A JSON error; for a malformed request, its reason without the raw bytes, in a
        :class:`~nexus.server.rejections.Rejected` that names it to its access line."""
        if not isinstance(exc, HttpProcessingError):
            super().handle_error(request, status, exc, message)  # logs; raises if too late
            try:
                phrase = HTTPStatus(status).phrase
            except ValueError:
                phrase = "Error"
            return _json_response(GatewayError(f"{phrase}.", status=status))
        if request.writer.output_size > 0:
            raise ConnectionError("a response was under way: no error response can follow")
        return Rejected(exc, status)  # its access line: nexus.server.rejections


@web.middleware
async def connection_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Marks the request's :class:`Connection` BUSY (the first middleware of the app)."""
    protocol = request.protocol
    if isinstance(protocol, Connection):
        protocol.request_started()
    return await handler(request)


class ConnectionSite(web.BaseSite):
    """A TCP listener of :class:`Connection` objects, in ``TCPSite``'s place in an
    ``AppRunner``; ``handler_args`` go to each ``RequestHandler``, under the app's own
    (:data:`~nexus.server.state.REQUEST_HANDLER_ARGS`), as aiohttp's runners apply them."""

    def __init__(
        self,
        runner: web.AppRunner,
        host: str,
        port: int,
        *,
        registry: ConnectionRegistry,
        backlog: int = 128,
        reuse_port: bool = False,
        handler_args: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(runner, backlog=backlog)
        if connection_middleware not in runner.app.middlewares:
            raise RuntimeError(
                "ConnectionSite needs connection_middleware in the app's middlewares "
                "(create_app puts it there): without it a running request looks idle"
            )
        self.runner = runner
        self.backlog_size = backlog
        self.host = host
        self.port = port
        self.registry = registry
        self.reuse_port = reuse_port
        self.handler_args = handler_args or {}
        self.listener: asyncio.Server | None = None

    @property
    def name(self) -> str:
        return str(URL.build(scheme="http", host=self.host, port=self.port))

    @property
    def addresses(self) -> list[Any]:
        """The listening sockets' addresses (``runner.addresses`` knows only aiohttp's sites)."""
        sockets = self.listener.sockets if self.listener is not None else ()
        return [sock.getsockname() for sock in sockets]

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        server = self.runner.server
        if server is None:
            raise RuntimeError("call runner.setup() before starting a site")
        registry = self.registry
        # The app's own arguments win, as in aiohttp's runners (its access logger).
        own = self.runner.app.get(REQUEST_HANDLER_ARGS, {})
        args = {**HANDLER_ARGS, **self.handler_args, **own}

        def factory() -> Connection:
            return Connection(server, registry, loop=loop, **args)

        self.listener = await loop.create_server(
            factory,
            self.host,
            self.port,
            backlog=self.backlog_size,
            reuse_port=self.reuse_port or None,
        )
        registry.start()

    async def close_listener(self) -> None:
        """Accept no more connections, and close the idle ones (the server stops); the
        open ones are still read and timed until :meth:`stop`."""
        if self.listener is not None:
            self.listener.close()
            self.listener = None
        self.registry.close_idle()

    async def stop(self) -> None:
        if self.listener is not None:
            self.listener.close()
            self.listener = None
        self.registry.stop()
        await super().stop()


if sys.platform == "linux":  # where TIOCOUTQ on a TCP socket is SIOCOUTQ (tcp(7))
    from fcntl import ioctl
    from termios import TIOCOUTQ

    def kernel_queued(transport: asyncio.BaseTransport) -> int:
        """Bytes the kernel still holds for the peer of ``transport``'s socket (Linux's
        ``SIOCOUTQ``: sent but not acknowledged, and not sent); 0 where it cannot tell."""
        sock = transport.get_extra_info("socket")
        if sock is None:
            return 0
        try:
            queued = ioctl(sock.fileno(), TIOCOUTQ, b"\0\0\0\0")
        except (OSError, ValueError):
            return 0
        return int(struct.unpack("i", queued)[0])

else:

    def kernel_queued(transport: asyncio.BaseTransport) -> int:
        """0: not known here (what the kernel holds is asked of Linux only)."""
        return 0
