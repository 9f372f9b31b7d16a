"""A stream's log in Redis, and the two shared channels that move it.

**Layout.** A log is a Redis Stream of batches: an entry holds the events appended in one
go, in the field ``e`` (:func:`~nexus.cache.codec.dumps_events`), and its ID is
``0-{end}``, ``end`` being the log index after its last event. The entry holding index
``i`` is the first with an ID above ``0-{i}``: a reader resumes at any index with
``XRANGE``, then follows with ``XREAD``. Writing an entry again is safe: Redis refuses
the same ID, and the reader cuts an entry that overlaps the one before it (a retry that
carries more events). The store writes entries with :data:`APPEND` (every log of a
mirror turn in one script) and ends an appended log with :data:`FINISH`.

**Commands** (:class:`Pipeliner`): every task's commands join one pipeline; while it is
in flight the next ones gather for the next. A thousand streams mirroring their logs
cost a round trip per turn, on one connection of the pool.

**Catching up** (:func:`page`): a reader pages through a log with ``XRANGE``, each page
sized from the entries of the one before to about :data:`PAGE_BYTES` (:func:`page_count`),
sent alone on one of :data:`PAGE_CONNECTIONS` connections of their own (:func:`send`),
never in the commands' pipeline: sixty readers of a 30 MB log in it, 100 entries a page,
held an admission's PING 9 s behind their pages (then 503).

**Followers** (:class:`Followers`): one blocking ``XREAD`` per connection follows up to
:data:`KEYS_PER_READ` logs for every reader of the process, and routes each reply to
the readers of its keys; a reader that brings a new key interrupts it (``CLIENT
UNBLOCK``) so that the next read includes it. 5,000 followed streams take 20 connections.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, cast

import redis.asyncio as aioredis
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ConnectionError, RedisError, ResponseError

from ..errors import StreamIncomplete
from ..events import Done, Error, StreamEvent
from .codec import loads_events

__all__ = [
    "APPEND",
    "FINISH",
    "FIRST_PAGE",
    "FOLLOW_COUNT",
    "KEYS_PER_READ",
    "PAGE_CONNECTIONS",
    "Appends",
    "Command",
    "Followers",
    "Pipeliner",
    "decode",
    "page",
    "page_count",
    "send",
]

KEYS_PER_READ = 250
"""Logs one blocking XREAD follows: past it, a reader's key goes to another connection."""
FOLLOW_COUNT = 16
"""Entries of one log per XREAD: a follower gets more only when it fell behind, and then
goes back to pages (which are bounded in bytes, where XREAD's COUNT is not)."""
PAGE_BYTES = 1 << 20
"""What one page of a catch-up aims at, in bytes of entries (an entry is never split)."""
PAGE_ENTRIES = 100
"""Entries per page at most: larger pages of small entries read no faster (redis-py's
parser costs per item), and a 200,000-event resume took as long at 1,000."""
FIRST_PAGE = 1
"""Entries of a reader's first page (one may be a whole log): its size sets the next count."""
PAGE_CONNECTIONS = 4
"""Connections for pages, per process: so many pages at once, the next ones wait."""

Command = tuple[Any, ...] | bytes
"""A command's arguments, or the whole command already in RESP (:meth:`Appends.command`)."""

# Log entries: per log in KEYS, in ARGV the count of its XADD arguments, then them. An
# entry added again is refused (its ID is not above the top one), which is fine. Returns
# the positions in KEYS of the entries not added because their log is gone (NOMKSTREAM).
APPEND = """
local lost, at = {}, 1
for i, key in ipairs(KEYS) do
  local n = tonumber(ARGV[at])
  local added = redis.pcall('XADD', key, unpack(ARGV, at + 1, at + n))
  if not added then
    table.insert(lost, i)
  elseif added.err and not string.find(added.err, 'equal or smaller', 1, true) then
    return added
  end
  at = at + n + 1
end
return lost
"""
# The end of a log appended to (NOMKSTREAM), after its entries: only if the log is there
# (else they were refused, and the keeper writes it again from entry 0, its end with it).
FINISH = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('PEXPIRE', KEYS[2], ARGV[2])
redis.call('DEL', KEYS[3])
return 1
"""


def _bulk(arg: bytes) -> bytes:
    return b"$%d\r\n%b\r\n" % (len(arg), arg)


_APPEND_HEAD = b"$4\r\nEVAL\r\n" + _bulk(APPEND.encode())
# An entry's XADD arguments before its ID, by (NOMKSTREAM, trimmed): their count, then them.
_XADD_HEADS = {
    (exists, trim): _bulk(b"%d" % (3 + exists + 3 * trim))
    + (_bulk(b"NOMKSTREAM") if exists else b"")
    + (_bulk(b"MINID") + _bulk(b"~") if trim else b"")
    for exists in (False, True)
    for trim in (False, True)
}


class Appends:
    """One mirror turn's entries as the :data:`APPEND` script's command, written in RESP
    as they are added: per entry one ``%`` of bytes, where packing its six arguments one by
    one (as redis-py does) was most of what the mirror cost per stream."""

    __slots__ = ("_args", "_count", "_keys")

    def __init__(self) -> None:
        self._keys: list[bytes] = []
        self._args: list[bytes] = []
        self._count = 0  # arguments in _args

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, log: bytes, end: int, payload: bytes, *, exists: bool, trim: int) -> None:
        """An entry of the log at ``log``: its events' ``payload``, ID ``0-{end}``;
        ``exists``: NOMKSTREAM (appended to a log that must be there); ``trim`` > 0: the
        entries below ``0-{trim}`` trimmed (``MINID ~``)."""
        self._keys.append(b"$%d\r\n%b\r\n" % (len(log), log))
        head = _XADD_HEADS[exists, trim > 0]
        if trim > 0:
            head += _bulk(b"0-%d" % trim)
        entry_id = b"0-%d" % end
        self._args.append(
            b"%b$%d\r\n%b\r\n$1\r\ne\r\n$%d\r\n%b\r\n"
            % (head, len(entry_id), entry_id, len(payload), payload)
        )
        self._count += 4 + exists + 3 * (trim > 0)

    def command(self) -> bytes:
        """``EVAL APPEND numkeys keys... args...`` in RESP."""
        keys = len(self._keys)
        head = b"*%d\r\n%b%b" % (3 + keys + self._count, _APPEND_HEAD, _bulk(b"%d" % keys))
        return b"".join((head, *self._keys, *self._args))


def page(log: str, after: int, count: int) -> Command:
    """XRANGE of up to ``count`` entries of the log at ``log`` past log index ``after``."""
    return ("XRANGE", log, f"0-{after + 2}", "+", "COUNT", count)


def page_count(entries: Sequence[Any]) -> int:
    """The count of the page after ``entries``: as many entries as the largest of them
    fit in :data:`PAGE_BYTES` (XRANGE's COUNT bounds entries, not bytes), and at most
    twice as many as these: small entries followed by big ones (a log's head, then long
    batches) would otherwise come as one reply of up to :data:`PAGE_ENTRIES` big ones."""
    largest = max((len(_payload(fields)) for _, fields in entries), default=0)
    return max(1, min(PAGE_ENTRIES, 2 * len(entries), PAGE_BYTES // max(largest, 1)))


def _payload(fields: Any) -> bytes:
    """An entry's field ``e``: its fields are a map in RESP3, a list in RESP2."""
    return cast(bytes, fields[b"e"] if type(fields) is dict else fields[1])


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
        batch = loads_events(_payload(fields))
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
    """Sends commands in pipelines, one at a time (see the module docstring). A group
    not sent within ``wait_s`` (its pipeline waited for the pool) fails."""

    def __init__(self, client: aioredis.Redis, wait_s: float) -> None:
        self._client = client
        self._wait_s = wait_s
        self._connection: AbstractConnection | None = None
        """Taken from the pool once and kept (pipelines go one at a time), checked before
        each pipeline as the pool checks what it hands out: taking one per pipeline cost a
        lock, a timeout and the pool's metrics each, a third of the store's CPU in a
        request."""
        self._queue: list[tuple[Sequence[Command], asyncio.Future[list[Any]], float]] = []
        self._task: asyncio.Task[None] | None = None

    async def run(self, commands: Sequence[Command]) -> list[Any]:
        """Each command's reply, in order (a refusal as its error). Raises
        :class:`RedisError` or ``OSError`` when Redis cannot be reached."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[list[Any]] = loop.create_future()
        self._queue.append((commands, future, loop.time()))
        if self._task is None:
            self._task = loop.create_task(self._flush())
        return await future

    async def _flush(self) -> None:
        loop = asyncio.get_running_loop()
        sent: list[tuple[asyncio.Future[list[Any]], int]] = []
        try:
            while self._queue:
                groups, self._queue = self._queue, []
                late = loop.time() - self._wait_s
                commands: list[Command] = []
                sent = []
                for group, future, queued in groups:
                    if queued < late and not future.done():
                        future.set_exception(RedisError("no pipeline free in time"))
                    if not future.done():  # (else: its caller left)
                        commands += group
                        sent.append((future, len(group)))
                failed: BaseException | None = None
                try:
                    replies = []
                    if commands:
                        pool = self._client.connection_pool
                        connection = self._connection
                        if connection is None:
                            connection = await pool.get_connection()  # type: ignore[no-untyped-call]
                            self._connection = connection
                        else:  # closed by Redis while kept (a restart): connected again
                            await pool.ensure_connection(connection)
                        replies = await exchange(connection, commands)
                except (RedisError, OSError) as exc:
                    failed = exc
                at = 0
                for future, count in sent:
                    if future.done():
                        pass
                    elif failed is not None:
                        future.set_exception(failed)
                    else:
                        future.set_result(replies[at : at + count])
                    at += count
            sent = []
        finally:
            self._task = None
            # Closed (or broken) with groups sent or queued: each caller gets an error it
            # handles (StoreUnavailable), never a wait without end or a CancelledError
            # that is not its own.
            stopped = RedisError("the store's pipeline stopped")
            for future in [f for f, _ in sent] + [f for _, f, _ in self._queue]:
                if not future.done():
                    future.set_exception(stopped)
            self._queue = []

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait((self._task,), timeout=2.0)
            if self._task is not None:
                return  # still on its connection (Redis not answering): closed with the pool
        connection, self._connection = self._connection, None
        if connection is not None:
            await self._client.connection_pool.release(connection)


async def send(client: aioredis.Redis, commands: Sequence[Command]) -> list[Any]:
    """``commands`` in one go on one connection of ``client``'s pool (:func:`exchange`)."""
    pool = client.connection_pool
    connection = await pool.get_connection()  # type: ignore[no-untyped-call]
    try:
        return await exchange(connection, commands)
    finally:
        await pool.release(connection)


async def exchange(connection: AbstractConnection, commands: Sequence[Command]) -> list[Any]:
    """``commands`` in one go on ``connection``, each reply in order (a refusal as its
    error); a connection that broke since its last use (Redis restarted) is connected
    again once; one that fails midway is left disconnected (a reply may be unread)."""
    try:
        for retry in (True, False):
            try:
                await connection.send_packed_command(_pack(commands))
                break
            except (ConnectionError, OSError):
                await connection.disconnect()
                if not retry:
                    raise
        replies: list[Any] = []
        for _ in commands:
            try:
                replies.append(await connection.read_response())
            except ResponseError as exc:
                replies.append(exc)
        return replies
    except BaseException:
        await connection.disconnect()  # a reply may be left unread
        raise


def _pack(commands: Sequence[Command]) -> bytes:
    """``commands`` in RESP: what redis-py's packing makes, at less than half its cost."""
    out = []
    for command in commands:
        if type(command) is bytes:  # packed already
            out.append(command)
            continue
        out.append(b"*%d\r\n" % len(command))
        for arg in command:
            if type(arg) is not bytes:
                arg = b"%d" % arg if type(arg) is int else str(arg).encode()
            out.append(b"$%d\r\n%b\r\n" % (len(arg), arg))
    return b"".join(out)


Waiter = tuple[int, asyncio.Future[list[Any]]]


class _Read:
    """One blocking XREAD connection and its readers, by key."""

    def __init__(self, followers: Followers) -> None:
        self.owner = followers
        self.client = followers.connect()
        self.waiting: dict[bytes, list[Waiter]] = {}
        self.woken = asyncio.Event()
        self.blocked = False
        self.unblocking: asyncio.Task[Any] | None = None
        self.reading: dict[bytes, int] = {}
        """The read under way: key -> the index it reads past."""
        self.missed = 0  # CLIENT UNBLOCKs that found the read under way not blocked yet
        self.refresh = False  # ask the connection's id again before the next read
        self.id: int | None = None
        self.task = asyncio.get_running_loop().create_task(self._loop())

    def add(self, key: bytes, waiter: Waiter) -> None:
        if key in self.waiting:
            self.waiting[key].append(waiter)
            if waiter[0] >= self.reading.get(key, waiter[0]):
                return
            # Behind the read under way on its key (a slower reader of the same log):
            # that read starts past what this one wants, so it must include it afresh.
        else:
            self.waiting[key] = [waiter]
        self.woken.set()
        self._interrupt()

    def _interrupt(self) -> None:
        """End the read under way if it lacks a waiter's key or position (it ends at its
        block time anyway)."""
        if self.blocked and self.unblocking is None and self.id is not None:
            command = ("CLIENT", "UNBLOCK", self.id)
            self.unblocking = asyncio.ensure_future(self.owner.call("unblock", command))
            self.unblocking.add_done_callback(self._unblocked)

    def _stale(self) -> bool:
        """Whether the read under way lacks a waiter's key or starts past its position."""
        reading = self.reading
        return any(
            key not in reading or min(after for after, _ in waiters) < reading[key]
            for key, waiters in self.waiting.items()
        )

    def _unblocked(self, task: asyncio.Task[Any]) -> None:
        self.unblocking = None
        if task.cancelled() or task.exception() is not None:
            return  # (an error is counted by the call: retrieved, not raised)
        if task.result() == [0]:
            # Nobody was blocked: the XREAD, sent on another connection, was still on
            # its way and is blocking now without the new key. Again, shortly (5 ms,
            # doubling up to 100 ms, while the read lasts). Missed thrice, the id may be
            # stale (redis-py's retry reconnected): asked again before the next read.
            self.missed += 1
            self.refresh = self.refresh or self.missed >= 3
            delay = min(0.005 * 2 ** (self.missed - 1), 0.1)
            asyncio.get_running_loop().call_later(delay, self._again)

    def _again(self) -> None:
        if self.blocked and self._stale():
            self._interrupt()

    def remove(self, key: bytes, waiter: Waiter) -> None:
        waiters = self.waiting.get(key, [])
        if waiter in waiters:
            waiters.remove(waiter)
            if not waiters:
                del self.waiting[key]

    async def _loop(self) -> None:
        while True:
            self.woken.clear()
            if not self.waiting:
                await self.woken.wait()
                continue
            try:
                if self.id is None or self.refresh:
                    self.refresh = False
                    self.id = int(await self.client.client_id())
                self.reading = {
                    key: min(after for after, _ in waiters) for key, waiters in self.waiting.items()
                }
                streams = {key: f"0-{after + 1}" for key, after in self.reading.items()}
                self.missed = 0
                self.blocked = True
                try:
                    reply: Any = await self.client.xread(
                        streams,  # type: ignore[arg-type]
                        count=self.owner.page,
                        block=self.owner.block_ms,
                    )
                finally:
                    self.blocked = False
            except (RedisError, OSError) as exc:
                self.id = None
                waiting, self.waiting = self.waiting, {}
                for _, future in (waiter for waiters in waiting.values() for waiter in waiters):
                    if not future.done():
                        future.set_exception(exc)
                continue
            if isinstance(reply, dict):  # RESP3; RESP2 is [[key, entries], ...]
                reply = [(key, value[0]) for key, value in reply.items()]
            for key, entries in reply or ():
                behind = []  # came while it blocked, wanting entries before its start
                for after, future in self.waiting.pop(key, ()):
                    if after < self.reading[key]:
                        behind.append((after, future))
                    elif not future.done():
                        future.set_result(
                            [e for e in entries if int(e[0].partition(b"-")[2]) > after + 1]
                        )
                if behind:
                    self.waiting[key] = behind


class Followers:
    """Blocking reads shared by every reader of a store; see the module docstring.
    ``connect`` gives a client of one connection for each; ``call(op, *commands)`` sends
    other commands (:meth:`~nexus.cache.redis.RedisStore.call`)."""

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
        time. Raises :class:`RedisError` or ``OSError`` when Redis cannot be reached."""
        raw = key.encode()
        read = self._place(raw)
        future: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        read.add(raw, (after, future))
        try:
            async with asyncio.timeout(self.block_ms / 1000):
                return await future
        except TimeoutError:
            return []
        finally:
            read.remove(raw, (after, future))

    def _place(self, key: bytes) -> _Read:
        """The read that follows ``key`` already, else the least busy one with room."""
        free = [read for read in self._reads if len(read.waiting) < KEYS_PER_READ]
        for read in self._reads:
            if key in read.waiting:
                return read
        if free:
            return min(free, key=lambda read: len(read.waiting))
        self._reads.append(_Read(self))
        return self._reads[-1]

    async def close(self) -> None:
        reads, self._reads = self._reads, []
        for read in reads:
            read.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, RedisError, OSError):
                await read.task
            with contextlib.suppress(RedisError, OSError):
                await read.client.aclose()
