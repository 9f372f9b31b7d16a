"""The open connections of one process: how many, and when each one's phase ends.

:mod:`nexus.server.connection` describes the phases and who moves a connection between
them; this module keeps the books. All HEAD deadlines have the same length, as have all
IDLE ones, so a dict per phase in insertion order (a connection is re-inserted as it
enters the phase) is in deadline order: a :class:`~nexus.watchdog.Watchdog` tick closes
the expired ones at the front and stops at the first that is not. Only paused
connections are checked for stalled writes (no byte left the buffer, the transport's
and the kernel's, for three times ``write_timeout_s``); those a stream pump times itself
(``timed_elsewhere``) are left to it. Sans-I/O but for the watchdog: every transition takes ``now``.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Callable
from typing import Protocol

import orjson

from ..errors import GatewayError
from ..watchdog import Watchdog
from .state import response_headers

__all__ = ["REJECT_LINGER_S", "ConnectionRegistry", "Phase", "Tracked"]

log = logging.getLogger("nexus.server")

REJECT_LINGER_S = 1.0
"""How long a rejected connection may stay open to read its request and see the 503."""


class Phase(enum.Enum):
    HEAD = "head"
    BUSY = "busy"
    IDLE = "idle"
    UPGRADED = "upgraded"
    REJECTED = "rejected"
    CLOSED = "closed"


class Tracked(Protocol):
    """What the registry needs of a connection (a :class:`Connection`, or a test's fake)."""

    phase: Phase
    timed_elsewhere: bool

    def expire(self, reason: str) -> None:
        """Close at once, dropping what the client has not read: a deadline passed."""

    def hang_up(self) -> None:
        """Close after what is written went out: an idle connection, at shutdown."""

    def write_buffer_size(self) -> int:
        """The bytes its transport holds for the client."""


class ConnectionRegistry:
    """The open connections of one process: their count and their phase deadlines."""

    def __init__(
        self,
        *,
        header_timeout_s: float,
        keepalive_timeout_s: float,
        max_connections: int,
        write_timeout_s: float,
    ) -> None:
        self.header_timeout_s = header_timeout_s
        self.keepalive_timeout_s = keepalive_timeout_s
        self.stall_timeout_s = 3 * write_timeout_s
        """How long a paused connection may go without a byte leaving its buffer."""
        self.max_connections = max_connections
        self.open = 0
        """Connections admitted and not yet lost (rejected ones are not counted)."""
        self.heads: dict[Tracked, float] = {}  # connection -> deadline, in deadline order
        self.idle: dict[Tracked, float] = {}
        self.lingering: dict[Tracked, tuple[float, asyncio.BaseTransport]] = {}
        self.paused: dict[Tracked, tuple[float, int]] = {}
        """Connections whose writes wait -> (since when no byte left the buffer, its size)."""
        self.refusal = GatewayError(
            f"The server is at its limit of {max_connections} connections; retry shortly.",
            code="too_many_connections",
            status=503,
            retryable=True,
        )
        """What a connection past the cap is told (:meth:`rejection`)."""
        self.tick = (
            min(header_timeout_s, keepalive_timeout_s, self.stall_timeout_s, REJECT_LINGER_S * 4)
            / 4
        )
        self.watchdog = Watchdog()
        self.warned_at = -1e9
        self.on_refused: list[Callable[[], None]] = []
        """Called for each connection refused at the cap (the metrics count them)."""
        self.refused = 0  # connections refused since the last warning
        self.closing = False
        """The server stops: a connection is closed once idle (:meth:`close_idle`)."""

    def rejection(self, request_id: str) -> bytes:
        """The 503 a connection past the cap gets, as bytes: it never reaches aiohttp. It
        carries what every response does (its ``request_id``, in its body too; ``nosniff``)."""
        body = orjson.dumps(self.refusal.openai_body(request_id))
        stamp = "".join(
            f"{name}: {value}\r\n" for name, value in response_headers(request_id).items()
        )
        head = (
            "HTTP/1.1 503 Service Unavailable\r\n"
            "Content-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n"
            f"{stamp}"
            "Retry-After: 1\r\n"
            "x-should-retry: true\r\n"
            "Connection: close\r\n\r\n"
        )
        return head.encode() + body

    # Transitions ------------------------------------------------------------

    def admit(self, conn: Tracked, now: float) -> bool:
        """A new connection: False when it is one too many (it is then REJECTED)."""
        if self.open >= self.max_connections:
            conn.phase = Phase.REJECTED
            for refused in self.on_refused:
                refused()
            self.refused += 1
            self._warn_refused(now)
            return False
        self.open += 1
        conn.phase = Phase.HEAD
        self.heads[conn] = now + self.header_timeout_s
        return True

    def linger(self, conn: Tracked, transport: asyncio.BaseTransport, now: float) -> bool:
        """Keep a rejected connection open briefly; False when too many already are."""
        if len(self.lingering) >= self.max_connections:
            return False
        self.lingering[conn] = (now + min(REJECT_LINGER_S, self.header_timeout_s), transport)
        return True

    def head_begun(self, conn: Tracked, now: float) -> None:
        """An IDLE connection's first byte of its next request."""
        self.idle.pop(conn, None)
        conn.phase = Phase.HEAD
        self.heads[conn] = now + self.header_timeout_s

    def request_started(self, conn: Tracked) -> None:
        """The request head is complete and the app handles it."""
        if conn.phase is Phase.HEAD:
            del self.heads[conn]
        elif conn.phase is Phase.IDLE:  # a pipelined request, read while the last one ran
            del self.idle[conn]
        else:
            return
        conn.phase = Phase.BUSY

    def response_done(self, conn: Tracked, now: float) -> None:
        """The response is written; the connection waits for its next request (or,
        once the server stops, is closed)."""
        if conn.phase is Phase.BUSY and self.closing:
            self._forget(conn)
            conn.hang_up()
        elif conn.phase is Phase.BUSY:
            conn.phase = Phase.IDLE
            self.idle[conn] = now + self.keepalive_timeout_s

    def upgraded(self, conn: Tracked) -> None:
        """Now a WebSocket: no longer timed here."""
        self.heads.pop(conn, None)
        self.idle.pop(conn, None)
        self.paused.pop(conn, None)
        conn.phase = Phase.UPGRADED

    def write_paused(self, conn: Tracked, now: float) -> None:
        """Its transport's buffer is full: the client reads nothing, or slowly."""
        if conn.phase in (Phase.HEAD, Phase.BUSY, Phase.IDLE):
            self.paused[conn] = (now, conn.write_buffer_size())

    def write_resumed(self, conn: Tracked) -> None:
        """Its buffer drained: the client reads."""
        self.paused.pop(conn, None)

    def lost(self, conn: Tracked) -> None:
        if conn.phase is Phase.REJECTED:
            self.lingering.pop(conn, None)
            conn.phase = Phase.CLOSED
        elif conn.phase is not Phase.CLOSED:
            self._forget(conn)

    def _warn_refused(self, now: float) -> None:
        """The connections refused at the cap since the last warning, in one warning every
        10 s at most (not a line each: a client could flood the log at connect speed)."""
        if self.refused and now - self.warned_at > 10:
            self.warned_at = now
            log.warning(
                "at [server] max_connections (%d): %d new connections refused (503) since the "
                "last such warning",
                self.max_connections,
                self.refused,
            )
            self.refused = 0

    # Deadlines --------------------------------------------------------------

    def check(self, now: float) -> None:
        """Close every connection whose phase deadline is past (the watchdog's tick), and
        warn of the connections refused meanwhile (:meth:`_warn_refused`)."""
        self._warn_refused(now)
        for table, reason in (
            (self.heads, f"no complete request head within {self.header_timeout_s:g}s"),
            (self.idle, f"idle for {self.keepalive_timeout_s:g}s"),
        ):
            for conn in _expired(table, now):
                self._close(conn, reason)
        for conn, (since, size) in list(self.paused.items()):
            if conn.timed_elsewhere:  # its writer (a stream pump) drops it, its own way
                self.paused[conn] = (now, size)
                continue
            buffered = conn.write_buffer_size()
            if buffered < size:  # bytes left the buffer: slow, not stalled
                self.paused[conn] = (now, buffered)
            elif now - since < self.stall_timeout_s:
                self.paused[conn] = (since, buffered)  # more queued is no progress
            else:
                self._close(conn, f"the client read nothing for {self.stall_timeout_s:g}s")
        if self.lingering:
            late = [c for c, (deadline, _) in self.lingering.items() if deadline <= now]
            for conn in late:
                _, transport = self.lingering.pop(conn)
                transport.close()

    def _close(self, conn: Tracked, reason: str) -> None:
        self._forget(conn)
        conn.expire(reason)

    def _forget(self, conn: Tracked) -> None:
        """An admitted connection is closed: out of every table and the count."""
        self.heads.pop(conn, None)
        self.idle.pop(conn, None)
        self.paused.pop(conn, None)
        conn.phase = Phase.CLOSED
        self.open -= 1

    def close_idle(self) -> None:
        """The server stops: close the idle connections now, and each busy one when its
        response is written. Those still waiting for their request head are let finish
        it (their request is refused, the connection closed after its answer)."""
        self.closing = True
        for conn in list(self.idle):
            self._forget(conn)
            conn.hang_up()

    def start(self) -> None:
        """Start checking (in the running loop)."""
        self.watchdog.add(self, self.tick)

    def stop(self) -> None:
        """Stop checking, and close the rejected connections still lingering."""
        self.watchdog.discard(self)
        for _, transport in self.lingering.values():
            transport.close()
        self.lingering.clear()


def _expired(table: dict[Tracked, float], now: float) -> list[Tracked]:
    expired = []
    for conn, deadline in table.items():
        if deadline > now:
            break
        expired.append(conn)
    return expired
