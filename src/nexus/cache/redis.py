"""The Redis store: shared by replicas, so a stream started on one can be followed from another.

Keys, all under ``{prefix}:``, each with a TTL::

    stream:{id}:info    string   JSON of the StreamInfo           live: begin's ttl_s,
    stream:{id}:log     stream   the log (nexus.cache.redis_log)   renewed by keep_alive;
    stream:{id}:owner   string   the replica running it             finished: the resume TTL
    stream:{id}:lease   string   clients on other replicas follow it  (redis_holds)
    stream:{id}:resumable  string  a join elsewhere made it resumable (1), or its owner
                                   ends it for want of clients (0)  live, renewed
    rec:{key}           string   JSON of a Recording               [cache] ttl_s
    claim:{key}         string   the stream holding an in-flight claim
    prepaid:{name}/{id}  string  a read of it the 202 of API key {name} paid for  (redis_holds)
    replica:{id}        string   this replica is alive             OWNER_TTL_S, renewed
    replica:{id}:beat   string   the beat's alone (gone: Redis lost it)  OWNER_TTL_S, renewed

(The limits' keys are in :mod:`nexus.cache.redis_limits`; what each API key holds, counted
and bounded, in :mod:`nexus.cache.redis_quota`; leases, resumable flags, prepaid reads and
claims in :mod:`nexus.cache.redis_holds`; the channel ``asks:{replica id}``, on which a
replica is asked how far a stream it runs is, in :mod:`nexus.cache.redis_asks`.) When the
owner of a live log dies, its followers get :class:`~nexus.errors.StreamLost` once its
keep-alive lapsed.

Holes. A log may lack entries a reader wants: trimmed (past ``max_log_bytes`` an append
trims the oldest with ``XADD MINID ~``; counted as the run counts its log, by
:func:`~nexus.cache.codec.dump_entry`, so only a log the run ended as
``stream_too_large`` ever is), or lost (Redis restarted without persistence).
Appends after the first use ``NOMKSTREAM``, so a log that vanished is noticed
(:meth:`RedisStore.mirror` says so: the keeper begins it again from entry 0), never
re-created without its start; :meth:`RedisStore.end` rewrites it whole itself. A reader
that meets a gap raises :class:`~nexus.errors.StreamIncomplete`, never serves a hole.

Connections: commands share one pipeline, on one connection of the pool (``[store]
max_connections``; :mod:`nexus.cache.redis_pipeline`); the pages of readers catching up on
logs, bounded in bytes, go alone on connections of their own, and followers share blocking
reads on theirs (:mod:`nexus.cache.redis_log`). A command not sent within ``[store]
pool_timeout_s`` fails. Every failure of Redis, unreachable or refusing (``OOM``, ``NOPERM``,
``READONLY``), is raised as :class:`~nexus.errors.StoreUnavailable` (503, ``Retry-After``),
counted through :attr:`Store.on_error` and warned about (:class:`.redis_url.Failures`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any, cast

import orjson
import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from ..errors import StoreUnavailable, StreamLost, StreamNotFound
from ..events import StreamEvent
from .codec import dump_entry, dump_event, load_event
from .redis_asks import Asks
from .redis_holds import RedisHolds, ms
from .redis_log import (
    FINISH,
    FIRST_PAGE,
    FOLLOW_COUNT,
    PAGE_CONNECTIONS,
    Appends,
    Followers,
    LiveLog,
    decode,
    page,
    page_count,
)
from .redis_pipeline import Command, Pipeliner, busy, send
from .redis_quota import Quota
from .redis_url import Failures, connect, redact_url, scrub
from .store import MIRROR_INTERVAL_S, OWNER_TTL_S, Recording, StreamInfo, Write

log = logging.getLogger("nexus.store")

__all__ = ["RedisStore", "RedisUnavailable", "redact_url"]

_ENTRY = 500
"""Events per log entry at most (a log written whole is cut into entries of this size)."""
_RENEWED = ("info", "log", "owner", "resumable")
"""A live stream's keys, renewed by :meth:`RedisStore.keep_alive` (the info first: its
renewal tells whether the store still has the stream)."""


class RedisUnavailable(ConnectionError):
    """Redis could not be reached at start-up. The message names the URL without credentials."""


class RedisStore(RedisHolds):
    """A :class:`Store` in Redis. See the module docstring for the key layout.

    ``client``, if given, is used instead of connecting to ``url``; it must have
    ``decode_responses=False`` and stays the caller's to close. Followers connect to ``url``
    either way."""

    shared = True

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        prefix: str = "nexus",
        *,
        client: aioredis.Redis | None = None,
        max_connections: int = 128,
        pool_timeout_s: float = 5.0,
        block_s: float = 1.0,
        max_log_bytes: int | None = None,
        max_bytes_per_key: int | None = None,
        mirror_interval_s: float = MIRROR_INTERVAL_S,
    ) -> None:
        super().__init__()
        self.mirror_interval_s = mirror_interval_s
        self.url = url
        self.prefix = prefix
        self.max_connections = max_connections
        self.pool_timeout_s = pool_timeout_s
        self.block_ms = ms(block_s)
        """How long one XREAD blocks: also how soon a follower notices its log expired."""
        self.socket_timeout_s = max(5.0, 2 * block_s)
        """How long Redis may take to answer: a round trip of the pipeline, a read (above
        ``block_s``, so a blocking XREAD is not cut short)."""
        self._client = client
        self._owns_client = client is None
        self.failures = Failures(url)
        self.max_log_bytes = max_log_bytes
        """A live log past this size (:func:`~nexus.cache.codec.dump_entry`, the measure
        the run bounds it by: no log the run let finish) is trimmed (``XADD MINID ~``)."""
        self.quota = Quota(prefix, max_bytes_per_key)
        """What each owner's logs and recordings hold, bounded (:mod:`.redis_quota`)."""
        self._live: dict[str, LiveLog] = {}
        """Live streams begun here -> their logs."""
        self.replica_id = os.urandom(8).hex()
        """This process: its keep-alive key says its live streams are still running."""
        self._heartbeat: asyncio.Task[None] | None = None
        self._pipeliner: Pipeliner | None = None
        self._pages: aioredis.Redis | None = None
        """Log pages: connections of their own, never queued behind other commands or
        ahead of them (:mod:`nexus.cache.redis_log`)."""
        self.followers = Followers(self._connect, self.call, self.block_ms, FOLLOW_COUNT)
        self.asks = Asks(self._connect, self.call, self._unavailable, prefix, self.replica_id, url)
        self.asks.entries = lambda stream_id: self.live_entries(stream_id)

    @property
    def client(self) -> aioredis.Redis:
        if self._client is None:
            raise RuntimeError("RedisStore used before start()")
        return self._client

    def _connect(self, max_connections: int | None = None, *, timed: bool = True) -> aioredis.Redis:
        """A client of its own pool. ``timed=False``: no ``socket_timeout`` (redis-py's is
        one timer per reply read); the pipeline bounds its whole round trip instead."""
        return connect(
            self.url,
            max_connections=max_connections or 1,
            pool_timeout_s=self.pool_timeout_s,
            socket_timeout_s=self.socket_timeout_s if timed else None,
            client_name=f"nexus-{self.replica_id}",
        )

    async def start(self) -> None:
        """Connect and PING. Raises :class:`RedisUnavailable` (no credentials in it)."""
        if self._client is None:
            self._client = self._connect(self.max_connections, timed=False)
        try:
            async with asyncio.timeout(self.socket_timeout_s):
                await self._client.ping()
                key = self._replica_key(self.replica_id)
                await self._client.set(key, b"1", px=ms(OWNER_TTL_S))
                await self._client.set(key + ":beat", b"1", px=ms(OWNER_TTL_S))
        except (RedisError, OSError) as exc:
            if self._owns_client:
                await self._client.aclose()
                self._client = None
            where, why = redact_url(self.url), scrub(str(exc), self.url)
            raise RedisUnavailable(f"Redis not reachable at {where}: {why}") from None
        await self.asks.start()
        self._heartbeat = asyncio.get_running_loop().create_task(self._beat())

    async def close(self) -> None:
        beating = self._heartbeat is not None
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            await asyncio.wait((self._heartbeat,), timeout=2.0)
            self._heartbeat = None
        await self.followers.close()
        await self.asks.close()
        if self._pipeliner is not None:
            await self._pipeliner.close()  # its connection back to the pool, for the DEL
            self._pipeliner = None
        if beating:
            with contextlib.suppress(RedisError, OSError):
                async with asyncio.timeout(self.socket_timeout_s):
                    key = self._replica_key(self.replica_id)
                    await self.client.delete(key, key + ":beat")
        pages, self._pages = self._pages, None
        if pages is not None:
            with contextlib.suppress(RedisError, OSError):
                await pages.aclose()
        if self._client is not None and self._owns_client:
            await self._client.aclose()
            self._client = None

    async def call(self, op: str, *commands: Command, allow: str = "") -> list[Any]:
        """The replies to ``commands``, sent together. Refusals raise, but those that
        say ``allow``; Redis failing raises :class:`StoreUnavailable`, counted as ``op``."""
        if self._pipeliner is None:  # (a store given its client works unstarted)
            self._pipeliner = Pipeliner(self.client, self.pool_timeout_s, self.socket_timeout_s)
        try:
            replies = await self._pipeliner.run(commands)
            for reply in replies:
                if isinstance(reply, Exception) and not (allow and allow in str(reply)):
                    raise reply
        except (RedisError, OSError) as exc:
            raise self._unavailable(op, exc) from exc
        return replies

    def _unavailable(self, op: str, exc: BaseException | None = None) -> StoreUnavailable:
        """Redis failed (``exc``): counted as ``op`` and its cause, ``busy`` (no turn of the
        pipeline, or no connection, within ``pool_timeout_s``), ``refused`` (an error reply:
        OOM, NOPERM, READONLY) or ``unreachable``, and warned about; to be raised."""
        cause = "unreachable"
        if exc is not None:
            cause = "busy" if busy(exc) else "refused" if isinstance(exc, ResponseError) else cause
            self.failures.failed(op, cause, exc)
        for count in self.on_error:
            count(op, cause)
        return StoreUnavailable(
            "The stream store cannot be reached right now; retry shortly.",
            headers={"Retry-After": "1"},
        )

    # Logs.
    async def begin(self, info: StreamInfo, ttl_s: float) -> None:
        try:
            await self.call("begin", *self._begin(info, ms(ttl_s)))
        except StoreUnavailable:
            self._live.pop(info.id, None)  # not begun: nothing of it to renew
            raise

    def _begin(self, info: StreamInfo, ttl_ms: int) -> list[Command]:
        self._live[info.id] = LiveLog(self._key(info.id, "log"), ttl_ms)
        self.quota.counted.pop(info.id, None)  # (written again from its start: counted so)
        return [
            ("SET", self._key(info.id, "owner"), self.replica_id, "PX", ttl_ms),
            ("SET", self._key(info.id, "info"), info.to_json(), "PX", ttl_ms),
            # Also here, not only on the heartbeat: after a restart that lost it, this
            # replica's streams, begun again, must not look orphaned until the next beat.
            ("SET", self._replica_key(self.replica_id), b"1", "PX", ms(OWNER_TTL_S)),
        ]

    async def keep_alive(self, stream_ids: Iterable[str]) -> list[str]:
        """Renew the live logs' TTLs, in one round trip: an idle stream must not expire
        while it runs. Those whose info is gone (Redis restarted) are returned."""
        ids = [stream_id for stream_id in stream_ids if stream_id in self._live]
        commands = [
            ("PEXPIRE", self._key(stream_id, part), self._live[stream_id].ttl)
            for stream_id in ids
            for part in _RENEWED
        ]
        if not commands:
            return []
        replies = await self.call("keep_alive", *commands)
        return [
            stream_id
            for stream_id, renewed in zip(ids, replies[:: len(_RENEWED)], strict=True)
            if not renewed
        ]

    async def end(
        self,
        info: StreamInfo,
        events: Sequence[StreamEvent],
        start: int,
        ttl_s: float,
        size: int | None = None,
    ) -> None:
        try:
            if not (await self.mirror([Write(info, events[start:], start, end=True)], ttl_s))[0]:
                await self.mirror([Write(info, events, 0, end=True)], ttl_s)  # lost: all again
        finally:
            self.forget(info.id)  # ended here, written or not

    def forget(self, stream_id: str) -> None:
        self._live.pop(stream_id, None)
        self.quota.counted.pop(stream_id, None)

    async def mirror(self, writes: Sequence[Write], ttl_s: float) -> list[bool]:
        """Per write: XADD its events from log index ``start``, all writes' entries in one
        script (:data:`~nexus.cache.redis_log.APPEND`: one reply); at its end, then its info,
        TTLs and the owner dropped, after the entries: a reader that sees the finished info
        has the whole log. The first entries set the live TTLs too (and find a log Redis
        lost). Then, in the round trip, the owners' counts (:mod:`nexus.cache.redis_quota`)."""
        ttl_ms = ms(ttl_s)
        begun = [command for w in writes if w.begin for command in self._begin(w.info, ttl_ms)]
        appends = Appends()
        after: list[Command] = []
        owners: list[int] = []
        grown: list[tuple[LiveLog, int, int]] = []  # applied once the write went through
        checked: list[tuple[int, int]] = []  # (index in after of an info's PEXPIRE, write)
        limit = self.max_log_bytes
        tally = self.quota.tally() if self.quota.limit is not None else None
        live_logs = self._live
        add = appends.add
        for at, write in enumerate(writes):
            start, events = write.start, write.events
            stream_id = write.info.meta.id
            live = live_logs.get(stream_id)
            begun_here = live is not None
            if live is None:  # not begun here (a log written whole at its end)
                live = LiveLog(self._key(stream_id, "log"), ttl_ms)
                if not write.end:
                    live_logs[stream_id] = live
            size, counted = live.size, live.counted
            ttl = ttl_ms if write.end else live.ttl
            count = len(events)
            # Entries of at most _ENTRY events (mostly one: a turn's tokens of one stream).
            for first in range(0, count, _ENTRY) if count > _ENTRY else (0,) if count else ():
                chunk = events if count <= _ENTRY else events[first : first + _ENTRY]
                payload, chunk_size = dump_entry(chunk)
                end = start + min(first + _ENTRY, count)
                size += len(payload)
                counted += chunk_size
                # Past the bound, keep as many entries as fit, at the log's mean entry size.
                trim = 0
                if limit is not None and counted > limit:
                    trim = end - end * limit // counted + 1
                add(live.key, end, payload, start > 0, trim)
                owners.append(at)
            if tally is not None:
                # Its bytes in Redis: once trimmed, about the share of them the trim kept.
                kept = size if limit is None or counted <= limit else size * limit // counted
                tally.log(write.info.owner, stream_id, kept, ttl, write.end)
            if not write.end:
                grown.append((live, size, counted))
                if start == 0:
                    # Its info's renewal says whether the store still has it: lost since
                    # begin (a restart), the stream is begun again (the write "failed").
                    log = self._key(stream_id, "log")
                    if begun_here:
                        checked.append((len(after) + 1, at))
                    after += [("PEXPIRE", log, ttl), ("PEXPIRE", self._key(stream_id, "info"), ttl)]
            elif start > 0 and events:
                owner = self._key(stream_id, "owner")
                info = write.info.to_json()
                log, info_key = self._key(stream_id, "log"), self._key(stream_id, "info")
                after.append(("EVAL", FINISH, 3, log, info_key, owner, info, ttl))
            else:
                log, info_key = self._key(stream_id, "log"), self._key(stream_id, "info")
                after += [
                    ("SET", info_key, write.info.to_json(), "PX", ttl),
                    ("PEXPIRE", log, ttl),
                    ("PEXPIRE", info_key, ttl),
                    ("DEL", self._key(stream_id, "owner")),
                ]
        counting = tally.commands() if tally is not None else []
        replies: list[Any] = []
        if not appends:
            if begun or after or counting:
                replies = await self.call("mirror", *begun, *after, *counting)
            lost, first_after = [], len(begun)
        else:
            replies = await self.call("mirror", *begun, appends.command(), *after, *counting)
            lost, first_after = replies[len(begun)], len(begun) + 1
        if tally is not None:
            if counting:
                self._evicted("key_limit", int(replies[-1]))  # the count's reply: its deletions
            tally.sent()
        # Only now: a write that failed is retried from the same entry, and must not count
        # its bytes twice (a log counted past max_log_bytes is trimmed).
        for live, size, counted in grown:
            live.size, live.counted = size, counted
        for write in writes:
            if write.end:
                live_logs.pop(write.info.id, None)
        written = [True] * len(writes)
        for entry in lost:
            written[owners[entry - 1]] = False
        for index, at in checked:
            if not replies[first_after + index]:
                written[at] = False
        return written

    async def info(self, stream_id: str) -> StreamInfo | None:
        """Its info; resumable too once a join on another replica made it so."""
        raw, made = await self.call(
            "info",
            ("GET", self._key(stream_id, "info")),
            ("GET", self._key(stream_id, "resumable")),
        )
        if raw is None:
            return None
        info = StreamInfo.from_json(orjson.loads(raw))
        if made == b"1":
            info.resumable = True
        return info

    async def read(self, stream_id: str, start: int = 0) -> AsyncIterator[list[StreamEvent]]:
        """Catch up with XRANGE, then follow with the shared XREADs until the terminal entry,
        or, after a quiet spell, until the info says it ended and nothing is left.

        Raises :class:`~nexus.errors.StreamNotFound` when neither info nor log exists (at
        the start or after a quiet spell), :class:`~nexus.errors.StreamLost` when its
        replica stopped before it ended."""
        log = self._key(stream_id, "log")
        finished = await self._finished(stream_id)
        after = start - 1  # index of the last entry read
        following = False
        count = FIRST_PAGE
        while True:
            if following:
                try:
                    entries = await self.followers.next(log, after)
                except (RedisError, OSError) as exc:
                    raise self._unavailable("read", exc) from exc
                # Behind (a slow client): pages, bounded in bytes, until caught up.
                following = len(entries) < FOLLOW_COUNT
            else:
                entries = await self._page(log, after, count)
                following = len(entries) < count
                count = page_count(entries)
            if entries:
                events, after, terminal = decode(stream_id, entries, after)
                if events:
                    yield events
                if terminal:
                    return
            if finished and following:
                return
            if following and not entries:  # quiet: did it end (catch up once more) or stop?
                finished = await self._finished(stream_id)
                if not finished and not await self.alive(stream_id):
                    finished = await self._finished(stream_id)  # it may have ended just now
                    if not finished:
                        raise StreamLost(
                            f"The replica running stream {stream_id!r} stopped before it "
                            "ended; retry the request."
                        )
                following = not finished

    async def _page(self, log: str, after: int, count: int) -> list[Any]:
        """Up to ``count`` entries of the log past index ``after``, on a connection for
        pages (waiting at most ``pool_timeout_s`` for one)."""
        if self._pages is None:
            self._pages = self._connect(PAGE_CONNECTIONS)
        try:
            (entries,) = await send(self._pages, [page(log, after, count)])
            if isinstance(entries, Exception):
                raise entries
        except (RedisError, OSError) as exc:
            raise self._unavailable("read", exc) from exc
        return cast(list[Any], entries or [])

    async def _finished(self, stream_id: str) -> bool:
        """Whether the stream ended; raises StreamNotFound if neither info nor log exists."""
        raw, exists = await self.call(
            "read",
            ("GET", self._key(stream_id, "info")),
            ("EXISTS", self._key(stream_id, "log")),
        )
        if raw is None:
            if not exists:
                raise StreamNotFound(f"No stream {stream_id!r}: unknown, or expired.")
            return False  # a log without info (a race at expiry): the terminal ends it
        status = orjson.loads(raw)["status"]
        return bool(status != "in_progress")

    # Recordings.
    async def get_recording(self, key: str) -> Recording | None:
        (raw,) = await self.call("get_recording", ("GET", f"{self.prefix}:rec:{key}"))
        if raw is None:
            return None
        data = orjson.loads(raw)
        return Recording(
            events=[load_event(item) for item in data["events"]],
            offsets=data["offsets"],
            provider=data["provider"],
            upstream_model=data["upstream_model"],
        )

    async def put_recording(
        self, key: str, recording: Recording, ttl_s: float, owner: str | None = None
    ) -> None:
        value = orjson.dumps(
            {
                "events": [dump_event(event) for event in recording.events],
                "offsets": recording.offsets,
                "provider": recording.provider,
                "upstream_model": recording.upstream_model,
            }
        )
        tally = self.quota.tally()
        tally.recording(owner, key, len(value), ms(ttl_s))
        set_ = ("SET", f"{self.prefix}:rec:{key}", value, "PX", ms(ttl_s))
        counting = tally.commands()
        replies = await self.call("put_recording", set_, *counting)
        if counting:
            self._evicted("key_limit", int(replies[-1]))
