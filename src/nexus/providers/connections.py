"""HTTP/1.1 connections to one upstream, pooled: the client Nexus streams providers with.

Why not aiohttp's client, which the gateway serves with: its body reader buffers each
socket read in a ``StreamReader`` and wakes the task that reads it, one future and one
task step per read; for a stream that arrives one token per read, that wake-up was half of
the gateway's CPU per chunk above a byte-copy proxy's (``bench/README.md``). Here the
socket's ``data_received`` (:mod:`nexus.providers.http1`) hands the body to the provider's
exchange, which decodes it and, once its stream is under way, pushes the events on in the
same call: no task is woken per read.

What a client owes an upstream and the gateway, kept here: keep-alive connections reused
(last in, first out) and dropped after :data:`KEEPALIVE_S` idle; at most ``limit`` in use,
the wait for one in a FIFO queue (its bound is the caller's: ``pool_timeout_s``); a connect
deadline, IPv6 and IPv4 raced, a host's addresses looked up once at a time; TLS with the
system's trust store (or a provider's ``ca_file``) and the host's name checked; the request
line's target percent-encoded; header values with a line break refused before they are
written (a key read from the environment cannot smuggle a header in); no redirects,
proxies or decompression (see :mod:`nexus.providers.http`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import re
import socket
import ssl
from collections.abc import Iterator, Mapping
from typing import Any, Protocol
from urllib.parse import quote, urlsplit

import aiohappyeyeballs

from ..errors import (
    UpstreamConnectError,
    UpstreamDisconnected,
    UpstreamProtocolError,
    UpstreamTimeout,
)
from .http1 import Connection, UpstreamClosed, UpstreamMalformed

__all__ = [
    "KEEPALIVE_S",
    "POOL_WAITS",
    "STALE_CLOSE_S",
    "ConnectionPool",
    "HeaderRefused",
    "PoolWaits",
    "map_upstream_errors",
    "request_target",
    "trusting",
]

STALE_CLOSE_S = 0.5
"""A reused connection closed unanswered this soon after the request went out was closed by
the upstream's keep-alive, not by a failure while it worked: sent again (once, on a new
connection). Later, the upstream may have read it: an error, never a second copy."""
KEEPALIVE_S = 15.0
"""An idle connection older than this is closed instead of reused (aiohttp's default too):
upstreams close theirs after a while, and a request on a half-closed one fails."""
DNS_TTL_S = 10.0
"""How long a host's addresses are reused (aiohttp's default too)."""
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # a header's name (RFC 9110)
_BREAK = re.compile(r"[\r\n\x00]")


AddrInfo = tuple[Any, Any, int, str, Any]


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
        self._lookup: asyncio.Task[list[AddrInfo]] | None = None  # one under way
        self._closed = False

    @property
    def busy(self) -> int:
        return self._busy

    async def acquire(self, waiting: WaitWatcher | None = None) -> Connection:
        """A connection for one request: an idle one, else a new one; when ``limit`` are in
        use, after a wait in line for one of them (cancel the call to give up)."""
        loop = asyncio.get_running_loop()
        if self._closed:
            raise UpstreamClosed("the provider is closing")
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
                elif waiter in self._waiters:  # (not when skipped, or the pool closed)
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
        made: list[Connection] = []

        def connection() -> Connection:
            made.append(Connection(self))
            return made[0]

        async with asyncio.timeout(self.connect_timeout_s):
            sock = await aiohappyeyeballs.start_connection(
                await self._addresses(loop), happy_eyeballs_delay=0.25, loop=loop
            )
            try:
                await loop.create_connection(
                    connection,
                    sock=sock,
                    ssl=self._ssl,
                    server_hostname=self.host if self._ssl is not None else None,
                )
            except BaseException:
                # Once the protocol is made, a transport owns the socket (and closes it):
                # closed under it, the loop would go on watching its number, which the
                # next socket opened gets.
                if not made:
                    sock.close()
                elif made[0].transport is not None:
                    made[0].transport.abort()
                raise
        if self._closed:  # closed while this one connected: it must not outlive the pool
            made[0].close()
            raise UpstreamClosed("the provider is closing")
        self._open.add(made[0])
        return made[0]

    async def _addresses(self, loop: asyncio.AbstractEventLoop) -> list[AddrInfo]:
        """The host's addresses, looked up at most every :data:`DNS_TTL_S` and once at a
        time (a lookup is a thread's call: a burst of new streams waits for one)."""
        if self._addrs is not None and loop.time() - self._addrs_at < DNS_TTL_S:
            return self._addrs
        if self._lookup is None:
            self._lookup = loop.create_task(self._look_up(loop))
            self._lookup.add_done_callback(_retrieved)
        return await asyncio.shield(self._lookup)

    async def _look_up(self, loop: asyncio.AbstractEventLoop) -> list[AddrInfo]:
        try:
            addrs = await loop.getaddrinfo(
                self.host, self.port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP
            )
            self._addrs, self._addrs_at = addrs, loop.time()
            return addrs
        finally:
            self._lookup = None

    def request_head(self, target: str, headers: Mapping[str, str], length: int) -> bytes:
        """A POST's line and headers for ``target`` and a body of ``length`` bytes (see
        :meth:`check_headers`)."""
        self.check_headers(headers)
        lines = [f"POST {target} HTTP/1.1", f"Host: {self.host_header}"]
        lines.append(f"Content-Length: {length}")
        lines += [f"{name}: {value}" for name, value in headers.items()]
        lines.append("\r\n")
        return "\r\n".join(lines).encode()

    @staticmethod
    def check_headers(headers: Mapping[str, str]) -> None:
        """HeaderRefused for a name or value with a line break (or NUL), or a name HTTP
        does not allow: it would be a header of its own (a key from the environment
        cannot add one). The value is not quoted."""
        for name, value in headers.items():
            if not _TOKEN.fullmatch(name) or _BREAK.search(value):
                raise HeaderRefused(
                    f"the header {name[:64]!r} cannot be sent (a line break, or a character "
                    "HTTP does not allow there)"
                )

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

    async def renew(self, stale: Connection) -> Connection:
        """A new connection in place of ``stale`` (closed), in its place among those in use:
        not behind the requests waiting for one."""
        stale.close()
        try:
            return await self._connect(asyncio.get_running_loop())
        except BaseException:
            self._free()
            raise

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
        (the provider stops); a connect under way is dropped as it ends."""
        self._closed = True
        for connection in list(self._open):
            connection.fail(UpstreamClosed("the provider is closing"))
        self._idle.clear()
        waiters, self._waiters = self._waiters, collections.deque()
        for waiter in waiters:
            if not waiter.done():
                waiter.set_exception(UpstreamClosed("the provider is closing"))


def request_target(base_url: str, path: str) -> str:
    """The request line's target: ``base_url``'s path, then ``path``, then its query (an
    ``?api-version=`` stays last), percent-encoded as a URL must be. ValueError for a
    ``base_url`` with credentials: they would not be sent (a key goes in ``api_key_env``)."""
    url = urlsplit(base_url)
    if url.username is not None or url.password is not None:
        raise ValueError("base_url: credentials in the URL are not sent; use api_key_env")
    target = quote(url.path.rstrip("/") + path, safe=_URL_SAFE)
    return target + (f"?{quote(url.query, safe=_URL_SAFE + '?')}" if url.query else "")


_URL_SAFE = "/%:@!$&'()*+,;=-._~"


def trusting(ca_file: str) -> ssl.SSLContext:
    """A TLS context trusting the CA certificates in ``ca_file`` (only those); ValueError
    saying why when it cannot be read."""
    try:
        return ssl.create_default_context(cafile=ca_file)
    except (OSError, ssl.SSLError) as exc:
        reason = getattr(exc, "strerror", None) or getattr(exc, "reason", None) or exc
        raise ValueError(f"ca_file: cannot load {ca_file!r} ({reason})") from None


def _retrieved(task: asyncio.Task[Any]) -> None:
    """A lookup's failure is its waiters'; with none left, it is not an unhandled one."""
    if not task.cancelled():
        task.exception()


class WaitWatcher(Protocol):
    """Told when a request starts and stops waiting in line for a connection."""

    def queued(self, now: float) -> None: ...

    def dequeued(self, now: float) -> None: ...


@contextlib.contextmanager
def map_upstream_errors(provider: str, phase: str) -> Iterator[None]:
    """Connection and timeout errors as :mod:`nexus.errors` (a GatewayError as it is)."""
    try:
        yield
    except TimeoutError as exc:
        raise UpstreamTimeout(f"provider {provider!r} timed out {phase}") from exc
    except UpstreamClosed as exc:
        raise UpstreamDisconnected(f"provider {provider!r} closed the connection {phase}") from exc
    except UpstreamMalformed as exc:
        raise UpstreamProtocolError(f"provider {provider!r}: {exc}") from exc
    except ssl.SSLError as exc:
        raise UpstreamConnectError(
            f"cannot connect to provider {provider!r}: TLS failed ({exc.reason or exc})"
        ) from exc
    except OSError as exc:
        raise UpstreamConnectError(
            f"cannot connect to provider {provider!r}: {exc.strerror or type(exc).__name__}"
        ) from exc
