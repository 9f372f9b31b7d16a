"""HTTP/1.1 connections to one upstream, pooled: the client Nexus streams providers with.

Why not aiohttp's client, which the gateway serves with: its body reader buffers each
socket read in a ``StreamReader`` and wakes the task that reads it, one future and one
task step per read; for a stream that arrives one token per read, that wake-up was half of
the gateway's CPU per chunk above a byte-copy proxy's (``bench/README.md``). Here the
socket's ``data_received`` hands the body to a :class:`Listener` (the provider's exchange),
which decodes it and, once its stream is under way, pushes the events on in the same call:
no task is woken per read. The parsing is llhttp's, through ``httptools``.

What a client owes an upstream and the gateway, kept here: keep-alive connections reused
(last in, first out) and dropped after :data:`KEEPALIVE_S` idle; at most ``limit`` in use,
the wait for one in a FIFO queue (its bound is the caller's: ``pool_timeout_s``); a connect
deadline; TLS with the system's trust store and the host's name checked; a response head
bounded (:data:`MAX_HEAD_BYTES`, :data:`MAX_HEADERS`) so a hostile upstream cannot grow the
gateway's memory before its first event; header values with a line break refused before
they are written (a key read from the environment cannot smuggle a header in); no
redirects, proxies or decompression (see :mod:`nexus.providers.http`).
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import re
import socket
import ssl
from collections.abc import Mapping
from typing import Any, Protocol
from urllib.parse import urlsplit

import aiohappyeyeballs
import httptools
from multidict import CIMultiDict

__all__ = [
    "KEEPALIVE_S",
    "MAX_HEADERS",
    "MAX_HEAD_BYTES",
    "POOL_WAITS",
    "Connection",
    "ConnectionPool",
    "HeaderRefused",
    "Listener",
    "PoolWaits",
    "UpstreamClosed",
    "UpstreamMalformed",
]

KEEPALIVE_S = 15.0
"""An idle connection older than this is closed instead of reused (aiohttp's default too):
upstreams close theirs after a while, and a request on a half-closed one fails."""
DNS_TTL_S = 10.0
"""How long a host's addresses are reused (aiohttp's default too)."""
MAX_HEAD_BYTES = 64 * 1024
MAX_HEADERS = 128
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # a header's name (RFC 9110)
_BREAK = re.compile(r"[\r\n\x00]")


AddrInfo = tuple[Any, Any, int, str, Any]


class UpstreamClosed(ConnectionError):
    """The upstream closed the connection (or it failed) before the response's end."""


class UpstreamMalformed(ValueError):
    """The upstream's response is not HTTP/1.1 as it may be spoken, or past a bound."""


class _Extra(Exception):
    """Raised in the parser's callback to stop it at bytes past a response's end."""


class HeaderRefused(ValueError):
    """A request header that cannot be written as it is (:meth:`ConnectionPool.request_head`)."""


class PoolWaits:
    """What one call waited for pooled upstream connections, over all its attempts; None
    while it made no upstream HTTP request (a mock provider, a cache hit, a joined stream)."""

    __slots__ = ("seconds",)

    def __init__(self) -> None:
        self.seconds: float | None = None

    def add(self, seconds: float) -> None:
        self.seconds = (self.seconds or 0.0) + seconds


POOL_WAITS: contextvars.ContextVar[PoolWaits | None] = contextvars.ContextVar(
    "nexus_pool_waits", default=None
)
"""The tally of the call being served: set by the server per request, inherited by a
stream's run task."""


class Listener(Protocol):
    """Who reads a response, called from the socket's callbacks (never awaits)."""

    def head(self, status: int, headers: CIMultiDict[str]) -> None: ...

    def body(self, data: bytes) -> None:
        """The body bytes of one socket read (its chunked framing taken off)."""

    def ended(self, error: BaseException | None) -> None:
        """The response's end: ``None`` once it is whole, else why it never will be."""


class Connection(asyncio.Protocol):
    """One HTTP/1.1 connection: one request at a time, its response to a :class:`Listener`."""

    __slots__ = (
        "_by_close",
        "_head_bytes",
        "_head_read",
        "_headers",
        "_in_message",
        "_listener",
        "_parser",
        "_pieces",
        "_pool",
        "_whole",
        "closed",
        "idle_since",
        "reusable",
        "transport",
    )

    def __init__(self, pool: ConnectionPool) -> None:
        self._pool = pool
        self.transport: asyncio.Transport | None = None
        self._parser: httptools.HttpResponseParser | None = None
        self._listener: Listener | None = None
        self._headers: CIMultiDict[str] = CIMultiDict()
        self._head_bytes = 0  # the head's header lines (-1 once it is whole)
        self._head_read = 0  # bytes read while no head was whole
        self._pieces: list[bytes] = []
        self._in_message = False
        self._whole = False
        self._by_close = False  # the body ends when the connection does
        self.reusable = False
        self.closed = False
        self.idle_since = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def send(self, request: bytes, listener: Listener) -> None:
        """Write ``request`` (a whole request, head and body); its response goes to
        ``listener``."""
        self._listener = listener
        self._parser = httptools.HttpResponseParser(self)
        self._headers = CIMultiDict()
        self._head_bytes = self._head_read = 0
        self._in_message = True
        self._whole = self._by_close = self.reusable = False
        assert self.transport is not None
        self.transport.write(request)

    def data_received(self, data: bytes) -> None:
        parser, listener = self._parser, self._listener
        if parser is None or listener is None:
            self.close()  # bytes nobody asked for: the connection is not usable
            return
        extra = False
        try:
            parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            if not isinstance(exc.__context__, _Extra):
                self._fail(exc.__context__ or exc)
                return
            extra = True
        except httptools.HttpParserUpgrade:
            self._fail(UpstreamMalformed("the upstream switched protocols"))
            return
        except httptools.HttpParserError as exc:
            self._fail(UpstreamMalformed(f"the upstream's response is not HTTP/1.1 ({exc})"))
            return
        if self._head_bytes >= 0:  # no whole head yet: httptools holds a line until its end
            self._head_read += len(data)
            if self._head_read > MAX_HEAD_BYTES:
                self._fail(UpstreamMalformed(f"the response head passed {MAX_HEAD_BYTES} bytes"))
                return
        pieces = self._pieces
        if pieces:
            self._pieces = []
            try:
                listener.body(pieces[0] if len(pieces) == 1 else b"".join(pieces))
            except Exception as exc:  # the listener's own failure: the response goes
                self._fail(exc)
                return
        if self._whole:
            self._end(None)
            if extra:
                self.close()  # bytes past the response's end: not a connection to reuse

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._pool._lost(self)
        if self._in_message:
            if self._by_close and not self._pieces:
                self._end(None)  # a body delimited by the connection's close: whole
            else:
                self._end(UpstreamClosed("the upstream closed the connection"))

    # httptools' callbacks

    def on_message_begin(self) -> None:
        if self._whole:  # a second response, unasked for, in the read that ended the first
            raise _Extra

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_bytes += len(name) + len(value) + 4
        if self._head_bytes > MAX_HEAD_BYTES:
            raise UpstreamMalformed(f"the response head passed {MAX_HEAD_BYTES} bytes")
        if len(self._headers) >= MAX_HEADERS:
            raise UpstreamMalformed(f"the response head passed {MAX_HEADERS} headers")
        self._headers.add(name.decode("latin-1"), value.decode("latin-1"))

    def on_headers_complete(self) -> None:
        parser = self._parser
        assert parser is not None and self._listener is not None
        status = parser.get_status_code()
        if status < 200:  # an interim response (100 Continue): the real one follows
            self._headers = CIMultiDict()
            self._head_bytes = self._head_read = 0
            return
        self._head_bytes = -1  # whole: the body is not counted
        headers = self._headers
        self.reusable = parser.should_keep_alive()
        self._by_close = "Content-Length" not in headers and "chunked" not in (
            headers.get("Transfer-Encoding", "").lower()
        )
        self._listener.head(status, headers)

    def on_body(self, body: bytes) -> None:
        self._pieces.append(body)

    def on_message_complete(self) -> None:
        parser = self._parser
        if parser is not None and parser.get_status_code() >= 200:
            self._whole = True

    def _end(self, error: BaseException | None) -> None:
        listener = self._listener
        self._in_message = False
        self._listener = self._parser = None
        if error is not None or self._by_close:
            self.reusable = False
        if listener is not None:
            listener.ended(error)

    def _fail(self, error: BaseException) -> None:
        self._pieces = []
        self.reusable = False
        self._end(error)
        self.close()

    def pause_reading(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def close(self) -> None:
        """Drop the connection (its listener, if any, is not told: it asked)."""
        self._listener = None
        self._in_message = False
        self.reusable = False
        if self.transport is not None and not self.closed:
            self.closed = True
            self.transport.close()


class ConnectionPool:
    """The connections to one upstream origin: see the module docstring.

    ``tls``: the context ``https`` connections are made with (default: the system's trust
    store, the host's name checked).

    :meth:`acquire` is called with the caller's deadline around it; ``queued`` and
    ``dequeued`` (loop times) tell the caller when a wait for a free connection begins and
    ends, so that the wait can have a deadline of its own (``pool_timeout_s``)."""

    def __init__(
        self, url: str, limit: int, connect_timeout_s: float, tls: ssl.SSLContext | None = None
    ) -> None:
        parts = urlsplit(url)
        secure = parts.scheme == "https"
        if parts.hostname is None:
            raise ValueError("an upstream URL needs a host")
        self.host = parts.hostname
        self.port = parts.port or (443 if secure else 80)
        default = parts.port is None or parts.port == (443 if secure else 80)
        name = f"[{self.host}]" if ":" in self.host else self.host
        self.host_header = name if default else f"{name}:{self.port}"
        self._ssl = (tls or ssl.create_default_context()) if secure else None
        self.limit = limit  # 0: no limit
        self.connect_timeout_s = connect_timeout_s
        self._idle: list[Connection] = []  # the most recently used last
        self._busy = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._open: set[Connection] = set()
        self._addrs: list[AddrInfo] | None = None
        self._addrs_at = 0.0

    @property
    def busy(self) -> int:
        return self._busy

    async def acquire(self, waiting: WaitWatcher | None = None) -> Connection:
        """A connection for one request: an idle one, else a new one; when ``limit`` are in
        use, after a wait in line for one of them (cancel the call to give up)."""
        loop = asyncio.get_running_loop()
        if self.limit and self._busy >= self.limit:
            waiter: asyncio.Future[None] = loop.create_future()
            self._waiters.append(waiter)
            if waiting is not None:
                waiting.queued(loop.time())
            try:
                await waiter
            except BaseException:
                if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                    self._free()  # handed a place as it gave up: pass it on
                else:
                    self._waiters.remove(waiter)
                raise
            finally:
                if waiting is not None:
                    waiting.dequeued(loop.time())
        else:
            self._busy += 1
        try:
            return self._idle_one(loop.time()) or await self._connect(loop)
        except BaseException:
            self._free()
            raise

    def _idle_one(self, now: float) -> Connection | None:
        idle = self._idle
        while idle:
            connection = idle.pop()
            if not connection.closed and now - connection.idle_since < KEEPALIVE_S:
                return connection
            connection.close()
        return None

    async def _connect(self, loop: asyncio.AbstractEventLoop) -> Connection:
        async with asyncio.timeout(self.connect_timeout_s):
            sock = await aiohappyeyeballs.start_connection(
                await self._addresses(loop), happy_eyeballs_delay=0.25, loop=loop
            )
            try:
                _, connection = await loop.create_connection(
                    lambda: Connection(self),
                    sock=sock,
                    ssl=self._ssl,
                    server_hostname=self.host if self._ssl is not None else None,
                )
            except BaseException:
                sock.close()
                raise
        self._open.add(connection)
        return connection

    async def _addresses(self, loop: asyncio.AbstractEventLoop) -> list[AddrInfo]:
        """The host's addresses, looked up at most every :data:`DNS_TTL_S` (a lookup is a
        thread's call: a burst of new streams must not queue thousands of them)."""
        now = loop.time()
        if self._addrs is None or now - self._addrs_at >= DNS_TTL_S:
            self._addrs = await loop.getaddrinfo(
                self.host, self.port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP
            )
            self._addrs_at = now
        return self._addrs

    def request_head(self, target: str, headers: Mapping[str, str], length: int) -> bytes:
        """A POST's line and headers for ``target`` and a body of ``length`` bytes. A name
        or value with a line break (or NUL) is refused, never written: it would be a header
        of its own (a key from the environment cannot add one); the value is not quoted."""
        lines = [f"POST {target} HTTP/1.1", f"Host: {self.host_header}"]
        lines.append(f"Content-Length: {length}")
        for name, value in headers.items():
            if not _TOKEN.fullmatch(name) or _BREAK.search(value):
                raise HeaderRefused(
                    f"the header {name[:64]!r} cannot be sent (a line break, or a character "
                    "HTTP does not allow there)"
                )
            lines.append(f"{name}: {value}")
        lines.append("\r\n")
        return "\r\n".join(lines).encode()

    def release(self, connection: Connection, reuse: bool) -> None:
        """Give ``connection`` back: kept for the next request when ``reuse`` and its last
        response allows it, else closed."""
        now = asyncio.get_running_loop().time()
        if reuse and connection.reusable and not connection.closed:
            connection.idle_since = now
            self._idle.append(connection)
            idle = self._idle
            while idle and now - idle[0].idle_since >= KEEPALIVE_S:
                idle.pop(0).close()
        else:
            connection.close()
        self._free()

    def _free(self) -> None:
        """A place in use is free: the first in line takes it, else it is counted free."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self._busy -= 1

    def _lost(self, connection: Connection) -> None:
        self._open.discard(connection)
        if connection in self._idle:
            self._idle.remove(connection)

    def close(self) -> None:
        """Close every connection, idle or in use, and fail the requests waiting for one
        (the provider stops)."""
        for connection in list(self._open):
            connection.close()
        self._idle.clear()
        waiters, self._waiters = self._waiters, collections.deque()
        for waiter in waiters:
            if not waiter.done():
                waiter.set_exception(UpstreamClosed("the provider is closing"))


class WaitWatcher(Protocol):
    """Told when a request starts and stops waiting in line for a connection."""

    def queued(self, now: float) -> None: ...

    def dequeued(self, now: float) -> None: ...
