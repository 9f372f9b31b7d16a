"""The writing side of a client connection, timed by the watchdog.

The HTTP pump (:class:`~nexus.server.streaming.StreamPump`) and the WebSocket
connection (:class:`~nexus.server.routes.realtime.RealtimeConnection`) share it:
the same write timeout, the same heartbeat timer, one tick of
:mod:`~nexus.watchdog` for all.
"""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from collections.abc import Awaitable

from aiohttp import web

from ..watchdog import Watchdog
from .access import exchange
from .connection import Connection, kernel_queued

__all__ = ["Writer"]

log = logging.getLogger("nexus.server")


class Writer(ABC):
    """Writes to one client, timed by the watchdog (see the module docstring).

    Writes go through :meth:`_timed`. At each tick (:meth:`check`), a socket full
    without taking a byte for ``write_timeout_s`` gets the connection aborted;
    else, when :meth:`_beat_due`, a task runs :meth:`_heartbeat` (within
    ``write_timeout_s``). A heartbeat that fails otherwise (an encoder's bug) is logged
    once and handed to :meth:`_beat_failed`."""

    name = "a connection"
    """What the log calls the client's connection when it is dropped."""

    # Slots, as :class:`~nexus.server.streaming.StreamPump`'s (one per stream).
    __slots__ = (
        "_beat", "_buffered", "_last_write", "_loop", "_stalled", "_watchdog", "_watched",
        "_writes", "_writes_seen", "_writing", "heartbeat_s", "request", "write_timeout_s"
    )  # fmt: skip

    def __init__(
        self,
        request: web.Request,
        *,
        heartbeat_s: float,
        write_timeout_s: float,
        watchdog: Watchdog | None,
    ) -> None:
        self.request = request
        self.heartbeat_s = heartbeat_s
        self.write_timeout_s = write_timeout_s
        self._watchdog = watchdog if watchdog is not None else Watchdog()
        self._watched = False
        self._loop = asyncio.get_running_loop()
        self._last_write = self._loop.time()  # as of the tick that saw the last write
        self._writes = 0  # writes done (no clock per write: the tick reads the count)
        self._writes_seen = 0
        self._writing = 0  # writes under way (a frame's slices count as one)
        self._beat: asyncio.Task[None] | None = None
        self._stalled = 0.0  # since when the full socket has taken no byte (0: not full)
        self._buffered = 0  # the transport's write buffer when last looked at

    def _watch(self, on: bool) -> None:
        """Start (or stop) the watchdog's checks, and tell the connection (``nexus
        serve``'s) that its writes are timed here (or no longer)."""
        if on and not self._watched:
            self._watchdog.add(self, min(self.heartbeat_s, self.write_timeout_s) / 4)
        elif not on and self._watched:
            self._watchdog.discard(self)
            if self._beat is not None:
                self._beat.cancel()
        else:
            return
        self._watched = on
        connection = self.request.protocol
        if isinstance(connection, Connection):
            connection.timed_elsewhere = on

    async def _timed(self, write: Awaitable[None]) -> None:
        """Await ``write`` (one write, or several with no heartbeat between them)."""
        self._writing += 1
        try:
            await write
        finally:
            self._writing -= 1
        self._wrote()

    def _wrote(self) -> None:
        """A write is done: the socket took what it had, a new wait is timed afresh (from
        the next tick, which sees the count move)."""
        self._writes += 1

    def check(self, now: float) -> None:
        """The watchdog's tick: abort a client that does not read, start a heartbeat due.
        A write since the last tick counts as made now: a heartbeat is never earlier, and
        at most a tick later, than after the write itself."""
        if self._writes != self._writes_seen:
            self._writes_seen = self._writes
            self._last_write = now
            self._stalled = 0.0
        stalled = self._stalled_for(now)
        if stalled >= self.write_timeout_s:
            self._abort(f"a write stalled for {stalled:.1f}s")
        elif self._beat is None and self._beat_due(now):
            self._beat = self._loop.create_task(self._beat_once())

    def _stalled_for(self, now: float) -> float:
        """How long the socket has been full without taking a byte (0.0: not full),
        from the first tick that saw it full. Progress (less waiting at a tick, the end of
        a write's wait) starts the clock again; more waiting is none.

        What waits is the transport's buffer and, where the system tells, the kernel's
        send queue: a slow reader drains the kernel's queue first, and the transport's
        buffer moves only once that queue has room for more (on loopback, seconds later
        for a reader taking 100 KB a second)."""
        transport = self.request.transport
        protocol = self.request.protocol
        if transport is None or not protocol.writing_paused:
            self._stalled = 0.0
            return 0.0
        size = transport.get_write_buffer_size() + kernel_queued(transport)
        if not self._stalled or size < self._buffered:
            self._stalled = now
        self._buffered = size
        return now - self._stalled

    def _beat_due(self, now: float) -> bool:
        return not self._writing and now - self._last_write >= self.heartbeat_s

    async def _beat_once(self) -> None:
        try:
            async with asyncio.timeout(self.write_timeout_s):
                await self._heartbeat()
        except (TimeoutError, ConnectionError):
            self._abort("a heartbeat could not be written")
        except Exception as exc:
            # Not the client's doing: raised from this task, it would be retried, and
            # logged unretrieved, at every tick.
            log.exception("the heartbeat of %s failed", self.name)
            self._beat_failed(exc)
        finally:
            self._beat = None

    def _beat_failed(self, exc: Exception) -> None:
        """A heartbeat raised ``exc`` (logged): no other comes; the connection is dropped."""
        self._abort("its heartbeat failed", "internal_error")

    @abstractmethod
    async def _heartbeat(self) -> None:
        """Write this connection's keepalive (an SSE comment, a WebSocket ping)."""

    def _abort(self, why: str, cause: str = "write_timeout") -> None:
        """Drop the client (abort: a close could not reach a peer that does not read);
        ``cause``: the access line's reason."""
        log.warning("dropping client of %s: %s", self.name, why)
        exchange(self.request).cancelled = cause
        transport = self.request.transport
        if transport is not None:
            transport.abort()
