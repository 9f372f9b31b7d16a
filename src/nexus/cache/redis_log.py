"""A stream's log in Redis, and the two shared channels that move it.

**Layout.** A log is a Redis Stream of batches: an entry holds the events appended in one
go, in the field ``e`` (:func:`~nexus.cache.codec.dumps_events`), and its ID is
``0-{end}``, ``end`` being the log index after its last event. The entry holding index
``i`` is the first with an ID above ``0-{i}``: a reader resumes at any index with
``XRANGE``, then follows with ``XREAD``. Writing an entry again is safe: Redis refuses
the same ID, and the reader cuts an entry that overlaps the one before it (a retry that
carries more events). The store writes entries with :data:`APPEND` (every log of a
mirror turn in one script) and ends an appended log with :data:`FINISH`.

**Commands** go through the store's one pipeline (:mod:`nexus.cache.redis_pipeline`); a
mirror turn's entries as one command already in RESP (:class:`Appends`).

**Catching up** (:func:`page`): a reader pages through a log with ``XRANGE``, each page
sized from the entries of the one before to about :data:`PAGE_BYTES` (:func:`page_count`),
sent alone on one of :data:`PAGE_CONNECTIONS` connections of their own
(:func:`~nexus.cache.redis_pipeline.send`),
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
from redis.exceptions import RedisError

from ..errors import StreamIncomplete
from ..events import Done, Error, StreamEvent
from .codec import loads_events
from .redis_pipeline import Command, bulk

__all__ = [
    "APPEND",
    "FINISH",
    "FIRST_PAGE",
    "FOLLOW_COUNT",
    "IDLE_READ_S",
    "KEYS_PER_READ",
    "PAGE_CONNECTIONS",
    "Appends",
    "Followers",
    "LiveLog",
    "decode",
    "page",
    "page_count",
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
IDLE_READ_S = 30.0
"""A follower's connection that followed nothing for this long is closed: the spike of
followers that opened it has passed (the next one opens another)."""


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


_APPEND_HEAD = b"$4\r\nEVAL\r\n" + bulk(APPEND.encode())
# An entry's XADD arguments before its ID, by (NOMKSTREAM, trimmed): their count, then them.
_XADD_HEADS = {
    (exists, trim): bulk(b"%d" % (3 + exists + 3 * trim))
    + (bulk(b"NOMKSTREAM") if exists else b"")
    + (bulk(b"MINID") + bulk(b"~") if trim else b"")
    for exists in (False, True)
    for trim in (False, True)
}


class LiveLog:
    """A live log this process writes: its TTL in ms, its bytes in Redis so far, its size
    as ``max_log_bytes`` counts it (:func:`~nexus.cache.codec.dump_entry`), and its key
    in RESP, made once per stream rather than once per entry."""

    __slots__ = ("counted", "key", "size", "ttl")

    def __init__(self, key: str, ttl: int) -> None:
        self.key = bulk(key.encode())
        self.ttl = ttl
        self.size = 0
        self.counted = 0


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

    def add(self, key: bytes, end: int, payload: bytes, exists: bool, trim: int) -> None:
        """An entry of the log whose key, in RESP, is ``key`` (:attr:`LiveLog.key`): its
        events' ``payload``, ID ``0-{end}``; ``exists``: NOMKSTREAM (appended to a log that
        must be there); ``trim`` > 0: the entries below ``0-{trim}`` trimmed (``MINID ~``)."""
        self._keys.append(key)
        head = _XADD_HEADS[exists, trim > 0]
        if trim > 0:
            head += bulk(b"0-%d" % trim)
        entry_id = b"0-%d" % end
        self._args.append(
            b"%b$%d\r\n%b\r\n$1\r\ne\r\n$%d\r\n%b\r\n"
            % (head, len(entry_id), entry_id, len(payload), payload)
        )
        self._count += 4 + exists + 3 * (trim > 0)

    def command(self) -> bytes:
        """``EVAL APPEND numkeys keys... args...`` in RESP."""
        keys = len(self._keys)
        head = b"*%d\r\n%b%b" % (3 + keys + self._count, _APPEND_HEAD, bulk(b"%d" % keys))
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
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(IDLE_READ_S):
                        await self.woken.wait()
                if not self.waiting and not self.woken.is_set():
                    # Idle: no longer offered to readers (they are placed synchronously,
                    # so none can be added after this), then closed.
                    self.owner.retire(self)
                    with contextlib.suppress(RedisError, OSError):
                        await self.client.aclose()
                    return
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
        self._retired: set[asyncio.Task[None]] = set()  # closing their connections

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

    def retire(self, read: _Read) -> None:
        """``read`` followed nothing for :data:`IDLE_READ_S`: it takes no more readers."""
        if read in self._reads:
            self._reads.remove(read)
            self._retired.add(read.task)
            read.task.add_done_callback(self._retired.discard)

    async def close(self) -> None:
        reads, self._reads = self._reads, []
        if self._retired:
            await asyncio.wait(self._retired, timeout=2.0)
        for read in reads:
            read.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, RedisError, OSError):
                await read.task
            with contextlib.suppress(RedisError, OSError):
                await read.client.aclose()
