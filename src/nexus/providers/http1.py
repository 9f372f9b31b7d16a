"""One HTTP/1.1 connection to an upstream: the socket's protocol, its response parsed by
llhttp (through ``httptools``) and handed, as it arrives, to a :class:`Listener`.

The body of each socket read goes to the listener in that read's callback, its chunked
framing taken off, in one call however many chunks the read held; the head is bounded
(:data:`MAX_HEAD_BYTES`, :data:`MAX_HEADERS`, a line that never ends included) so a hostile
upstream cannot grow the gateway's memory before its first event; interim ``1xx``
responses are skipped, trailers not read, and bytes past a response's end (a second
response unasked for) end the connection. The pool that makes and reuses connections is
:mod:`nexus.providers.connections`.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Protocol

import httptools
from multidict import CIMultiDict

if TYPE_CHECKING:
    from .connections import ConnectionPool

__all__ = [
    "MAX_HEADERS",
    "MAX_HEAD_BYTES",
    "Connection",
    "Listener",
    "UpstreamClosed",
    "UpstreamMalformed",
]

MAX_HEAD_BYTES = 64 * 1024
MAX_HEADERS = 128


class UpstreamClosed(ConnectionError):
    """The upstream closed the connection (or it failed) before the response's end."""


class UpstreamMalformed(ValueError):
    """The upstream's response is not HTTP/1.1 as it may be spoken, or past a bound."""


class _Extra(Exception):
    """Raised in the parser's callback to stop it at bytes past a response's end."""


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
        "heard",
        "idle_since",
        "reusable",
        "reused",
        "sent",
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
        self.sent = 0  # requests written
        self.reused = False  # the request in flight is not the connection's first
        self.heard = False  # a byte of its response came

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
        self._whole = self._by_close = self.reusable = self.heard = False
        self.reused = self.sent > 0
        self.sent += 1
        assert self.transport is not None
        self.transport.write(request)

    def data_received(self, data: bytes) -> None:
        self.heard = True
        parser, listener = self._parser, self._listener
        if parser is None or listener is None:
            self.close()  # bytes nobody asked for: the connection is not usable
            return
        extra = False
        try:
            parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            if not isinstance(exc.__context__, _Extra):
                self.fail(exc.__context__ or exc)
                return
            extra = True
        except httptools.HttpParserUpgrade:
            self.fail(UpstreamMalformed("the upstream switched protocols"))
            return
        except httptools.HttpParserError as exc:
            self.fail(UpstreamMalformed(f"the upstream's response is not HTTP/1.1 ({exc})"))
            return
        pieces = self._pieces
        if not pieces and not self._whole:
            # No body from this read: a head, trailers or framing still coming. httptools
            # holds a line until its end, so a line that never ends must be cut here.
            self._head_read += len(data)
            if self._head_read > MAX_HEAD_BYTES:
                self.fail(UpstreamMalformed(f"{MAX_HEAD_BYTES} bytes came without a head or body"))
                return
        elif pieces:
            self._head_read = 0
            self._pieces = []
            try:
                listener.body(pieces[0] if len(pieces) == 1 else b"".join(pieces))
            except Exception as exc:  # the listener's own failure: the response goes
                self.fail(exc)
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
        if self._head_bytes < 0:
            return  # a trailer, after a chunked body: not read
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

    def fail(self, error: BaseException) -> None:
        """End the response in flight with ``error`` (its listener is told), and drop the
        connection."""
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
        self._parser = None  # it holds this connection's callbacks: a cycle, once closed
        self._in_message = False
        self.reusable = False
        if self.transport is not None and not self.closed:
            self.closed = True
            self.transport.close()
