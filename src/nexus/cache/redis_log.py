"""A stream's log in Redis, and the two shared channels that move it: one pipeline in flight
for every command of the process, and blocking reads shared by every follower.

**Layout.** A log is a Redis Stream of batches. An entry holds the events appended in
one go, in the field ``e`` (:func:`~nexus.cache.codec.dumps_events`: a JSON array), and
its ID is ``0-{end}``, ``end`` being the log index after its last event. IDs grow with
the log, and the entry holding index ``i`` is the first with an ID above ``0-{i}``: a
reader resumes at any index with ``XRANGE``, then follows with ``XREAD`` from the last
ID it saw. Writing an entry again is safe: the same ID is refused by Redis (the caller
ignores that), and an entry that overlaps the one before it (a retry that carries more
events) is cut by the reader (:func:`decode`).

**Commands** (:class:`Pipeliner`): every task's commands join one pipeline; while it is
in flight the next ones gather and go together in the next. A thousand streams
mirroring their logs cost a round trip per turn, not one per stream, on one
connection of the pool.

**Followers** (:class:`Followers`): one blocking ``XREAD`` per connection follows up to
:data:`KEYS_PER_READ` logs for every reader of this process, routing each reply to the
readers waiting on its keys. A reader that brings a new key interrupts the blocked read
(``CLIENT UNBLOCK``), so that the next one includes it. 5,000 followed streams take 20
connections, not 5,000.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine, Iterable, Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from ..errors import StoreUnavailable, StreamIncomplete
from ..events import Done, Error, StreamEvent
from .codec import loads_events

__all__ = ["KEYS_PER_READ", "Followers", "Pipeliner", "decode"]

KEYS_PER_READ = 250
"""Logs one blocking XREAD follows: past it, a reader's key goes to another connection."""

Command = tuple[Any, ...]


def decode(
    stream_id: str, entries: Sequence[Any], after: int
) -> tuple[list[StreamEvent], int, bool]:
    """Entries read after log index ``after`` -> (their events up to a terminal, the index
    of the last one, terminal seen).

    Raises :class:`StreamIncomplete` when an entry starts past ``after + 1``: the
    entries between were trimmed or lost (see :mod:`nexus.cache.redis`).
    """
    events: list[StreamEvent] = []
    for entry_id, fields in entries:
        end = int(entry_id.partition(b"-")[2])
        batch = loads_events(fields[b"e"])
        first = end - len(batch)
        if first > after + 1:
            raise StreamIncomplete(
                f"Stream {stream_id!r} is missing entries from {after + 1} in the store "
                "(trimmed past [streams] max_log_bytes, or lost while the store was "
                "unreachable); it cannot be resumed from there."
            )
        if end <= after + 1:
            continue  # read already
        events += batch[after + 1 - first :]
        after = end - 1
        if isinstance(batch[-1], Done | Error):
            return events, after, True
    return events, after, False


class Pipeliner:
    """Sends commands in pipelines, one at a time; see the module docstring.

    A group of commands that waits longer than ``wait_s`` for its pipeline (or whose
    pipeline waits that long for a connection of the pool) fails, with the errors of
    Redis, as :class:`RedisError`.
    """

    def __init__(self, client: aioredis.Redis, wait_s: float) -> None:
        self._client = client
        self._wait_s = wait_s
        self._queue: list[tuple[Sequence[Command], asyncio.Future[list[Any]], float]] = []
        self._task: asyncio.Task[None] | None = None

    async def run(self, commands: Sequence[Command]) -> list[Any]:
        """Each command's reply, in order; a command that Redis refused has its error as
        its reply. Raises :class:`RedisError` or ``OSError`` when Redis cannot be reached."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[list[Any]] = loop.create_future()
        self._queue.append((commands, future, loop.time()))
        if self._task is None:
            self._task = loop.create_task(self._flush())
        return await future

    async def _flush(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self._queue:
                groups, self._queue = self._queue, []
                late = loop.time() - self._wait_s
                pipe = self._client.pipeline(transaction=False)
                sent: list[tuple[asyncio.Future[list[Any]], int]] = []
                for commands, future, queued in groups:
                    if future.done():
                        continue  # its caller left
                    if queued < late:
                        future.set_exception(RedisError("no pipeline free in time"))
                        continue
                    for command in commands:
                        pipe.execute_command(*command)
                    sent.append((future, len(commands)))
                if not sent:
                    continue
                try:
                    replies = await pipe.execute(raise_on_error=False)
                except (RedisError, OSError) as exc:
                    for future, _ in sent:
                        if not future.done():
                            future.set_exception(exc)
                    continue
                at = 0
                for future, count in sent:
                    if not future.done():
                        future.set_result(replies[at : at + count])
                    at += count
        finally:
            self._task = None
            for _, future, _ in self._queue:  # cancelled: nobody is left to send them
                future.cancel()

    async def close(self) -> None:
        task = self._task
        if task is not None:
            task.cancel()
            await asyncio.wait((task,), timeout=2.0)


class _Read:
    """One blocking XREAD connection and the readers waiting on it, by key."""

    def __init__(self, followers: Followers) -> None:
        self.owner = followers
        self.client = followers.connect()
        self.waiting: dict[bytes, list[tuple[int, asyncio.Future[list[Any]]]]] = {}
        self.woken = asyncio.Event()
        self.blocked = False
        self.unblocking = False
        self.id: int | None = None
        self.task = asyncio.get_running_loop().create_task(self._loop())

    def add(self, key: bytes, waiter: tuple[int, asyncio.Future[list[Any]]]) -> None:
        waiters = self.waiting.get(key)
        if waiters is not None:
            waiters.append(waiter)
            return
        self.waiting[key] = [waiter]
        if not self.blocked:
            self.woken.set()
        elif not self.unblocking and self.id is not None:
            self.unblocking = True  # the read under way lacks this key: restart it
            asyncio.get_running_loop().create_task(self._unblock(self.id))

    def remove(self, key: bytes, waiter: tuple[int, asyncio.Future[list[Any]]]) -> None:
        waiters = self.waiting.get(key)
        if waiters is not None and waiter in waiters:
            waiters.remove(waiter)
            if not waiters:
                del self.waiting[key]

    async def _unblock(self, client_id: int) -> None:
        try:
            await self.owner.call("unblock", ("CLIENT UNBLOCK", client_id))
        except StoreUnavailable:
            pass  # the read ends at its block time anyway
        finally:
            self.unblocking = False

    async def _loop(self) -> None:
        while True:
            if not self.waiting:
                self.woken.clear()
                await self.woken.wait()
                continue
            try:
                if self.id is None:
                    self.id = int(await self.client.client_id())
                streams = {
                    key: f"0-{min(after for after, _ in waiters) + 1}"
                    for key, waiters in self.waiting.items()
                }
                self.blocked = True
                try:
                    reply = await self.client.xread(
                        streams,  # type: ignore[arg-type]
                        count=self.owner.page,
                        block=self.owner.block_ms,
                    )
                finally:
                    self.blocked = False
            except (RedisError, OSError) as exc:
                self.id = None
                waiting, self.waiting = self.waiting, {}
                for waiters in waiting.values():
                    for _, future in waiters:
                        if not future.done():
                            future.set_exception(exc)
                continue
            for key, entries in _by_key(reply):
                for after, future in self.waiting.pop(key, ()):
                    if not future.done():
                        future.set_result(
                            [e for e in entries if int(e[0].partition(b"-")[2]) > after + 1]
                        )


def _by_key(reply: Any) -> Iterable[tuple[bytes, list[Any]]]:
    """(key, entries) of an XREAD reply, RESP2 (``[[key, entries]]``) or RESP3."""
    if not reply:
        return ()
    if isinstance(reply, dict):
        return ((key, value[0]) for key, value in reply.items())
    return ((key, entries) for key, entries in reply)


class Followers:
    """Blocking reads shared by every reader of a store; see the module docstring.

    ``connect`` gives a client of one connection for each blocking read; ``call`` sends
    other commands (``call(op, *commands)``: :meth:`~nexus.cache.redis.RedisStore._call`).
    """

    def __init__(
        self,
        connect: Callable[[], aioredis.Redis],
        call: Callable[..., Coroutine[Any, Any, list[Any]]],
        block_ms: int,
        page: int,
    ) -> None:
        self.connect = connect
        self.call = call
        self.block_ms = block_ms
        self.page = page
        self._reads: list[_Read] = []

    def __len__(self) -> int:
        """Connections blocking for followers."""
        return len(self._reads)

    async def next(self, key: str, after: int) -> list[Any]:
        """Entries of the log at ``key`` past log index ``after``, or none after a block
        time without any. Raises :class:`RedisError` or ``OSError`` when Redis cannot be
        reached."""
        raw = key.encode()
        read = self._place(raw)
        future: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        waiter = (after, future)
        read.add(raw, waiter)
        try:
            async with asyncio.timeout(self.block_ms / 1000):
                return await future
        except TimeoutError:
            return []
        finally:
            read.remove(raw, waiter)

    def _place(self, key: bytes) -> _Read:
        """The read that follows ``key`` already, else the least busy one with room."""
        best = None
        for read in self._reads:
            if key in read.waiting:
                return read
            if len(read.waiting) < KEYS_PER_READ and (
                best is None or len(read.waiting) < len(best.waiting)
            ):
                best = read
        if best is None:
            best = _Read(self)
            self._reads.append(best)
        return best

    async def close(self) -> None:
        reads, self._reads = self._reads, []
        for read in reads:
            read.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, RedisError, OSError):
                await read.task
            with contextlib.suppress(RedisError, OSError):
                await read.client.aclose()
