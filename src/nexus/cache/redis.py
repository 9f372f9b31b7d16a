"""The Redis store: shared by replicas, so a stream started on one can be followed from another.

Keys, all under ``{prefix}:``::

    stream:{id}:info    string   JSON of StreamInfo.to_json()
    stream:{id}:log     stream   entry i has the ID 0-{i+1}, one field "e": the event's codec form
    stream:{id}:owner   string   the replica running the live stream (deleted at its end)
    stream:{id}:lease   string   set while a client on another replica follows the stream
    rec:{key}           string   JSON of a Recording (events in codec form)
    claim:{key}         string   the id of the stream that holds an in-flight claim
    replica:{id}        string   this replica is alive (renewed every third of its TTL)

Every one has a TTL: a live log and its info and owner the ``ttl_s`` given to
:meth:`RedisStore.begin` (renewed while it runs), a finished one the resume TTL,
a recording ``[cache] ttl_s``, a claim and a lease theirs, a replica's keep-alive
``OWNER_TTL_S``. (The limits' keys are in :mod:`nexus.cache.redis_limits`.)

A log is a Redis Stream whose entry IDs *are* the log indices (``0-1`` is entry
0), so a reader resumes from any index with ``XRANGE`` and then follows with a
blocking ``XREAD`` from the last ID it saw. Explicit IDs must grow, which also
makes :meth:`RedisStore.append` safe to replay: an entry already written is
refused by Redis, and the refusal is ignored.

While a stream is live, every append renews the TTL of its info and log to the
``ttl_s`` given to :meth:`RedisStore.begin`; if the owning replica dies, the
log expires and its followers get :class:`~nexus.errors.StreamNotFound`.
:meth:`RedisStore.end` sets both to the resume TTL.

Holes. A log mirrored here may lack entries a reader wants: trimmed (a log past
``max_log_bytes`` is appended with ``XADD MAXLEN ~``, keeping about that many
bytes of its newest entries), or lost (Redis restarted without persistence
while the stream ran). Appends after the first one use ``NOMKSTREAM``, so a log
that vanished is noticed (:meth:`RedisStore.append` returns False: the keeper
begins again and rewrites it from entry 0, which it still holds), never
re-created with its start missing; :meth:`RedisStore.end` rewrites it whole
itself. And a reader checks that the entries it gets follow each other from
where it started: one that does not (trimmed, or restored from a stale
snapshot) raises :class:`~nexus.errors.StreamIncomplete`, never a stream with
a hole.

Connections come from one bounded pool (``[store] max_connections``): a
command holds one for its round trip, a blocked reader for up to ``block_s``. A
command that finds them all busy waits up to ``[store] pool_timeout_s`` for one
(redis-py's ``BlockingConnectionPool``), then fails. Every failure to reach
Redis, that one included, is raised as
:class:`~nexus.errors.StoreUnavailable` (503 ``store_unavailable``,
``Retry-After``), never as redis-py's own errors, and counted through
:attr:`Store.on_error`. A reader cancelled mid-``XREAD`` has its connection
closed by redis-py before it returns to the pool, so no stale reply is left
for the next command.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any, cast
from urllib.parse import parse_qs, urlsplit

import orjson
import redis.asyncio as aioredis
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import RedisError, ResponseError
from redis.retry import Retry

from ..errors import StoreUnavailable, StreamIncomplete, StreamLost, StreamNotFound
from ..events import Done, Error, StreamEvent
from .codec import dump_event, load_event
from .store import OWNER_TTL_S, Recording, Store, StreamInfo

log = logging.getLogger("nexus.store")

__all__ = ["RedisStore", "RedisUnavailable", "redact_url"]

_PAGE = 1000
"""Entries per XRANGE / XREAD reply: bounds one reply's size."""

# Atomic, so no window between "it is taken" and "by whom" (the holder may
# expire in between). Re-claiming by the holder renews it, as in MemoryStore.
_CLAIM = """
local held = redis.call('GET', KEYS[1])
if not held then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return false
end
if held == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return false
end
return held
"""

# Delete only if still ours: the claim may have expired and been taken since.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class RedisUnavailable(ConnectionError):
    """Redis could not be reached at start-up. The message names the URL without credentials."""


def redact_url(url: str) -> str:
    """``url`` without user, password and query (which may hold ``password=``): fit for logs."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        if ":" in host:
            host = f"[{host}]"
        if parts.port is not None:
            host = f"{host}:{parts.port}"
    except ValueError:
        return "<unparseable Redis URL>"
    return f"{parts.scheme}://{host}{parts.path}"  # urlunsplit would drop unix:// 's slashes


def _ms(ttl_s: float) -> int:
    """A TTL for PX / PEXPIRE, which take whole milliseconds above zero."""
    return max(1, round(ttl_s * 1000))


def _index(entry_id: bytes | str) -> int:
    """The log index of entry ID ``0-{i+1}``."""
    raw = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(raw.partition("-")[2]) - 1


def _is_terminal(event: StreamEvent) -> bool:
    return isinstance(event, Done | Error)


def _decode(
    stream_id: str, entries: Sequence[Any], after: int
) -> tuple[list[StreamEvent], int, bool]:
    """XRANGE / XREAD entries following entry ``after`` -> (events up to a terminal, index
    of the last one, terminal seen).

    Raises :class:`StreamIncomplete` when they do not follow on from ``after`` one by
    one: the entries between were trimmed or lost (see the module docstring).
    """
    events: list[StreamEvent] = []
    last = after
    for entry_id, fields in entries:
        index = _index(entry_id)
        if index != last + 1:
            raise StreamIncomplete(
                f"Stream {stream_id!r} is missing entries from {last + 1} in the store "
                "(trimmed past [streams] max_log_bytes, or lost while the store was "
                "unreachable); it cannot be resumed from there."
            )
        last = index
        event = load_event(orjson.loads(fields[b"e"]))
        events.append(event)
        if _is_terminal(event):
            return events, last, True
    return events, last, False


class RedisStore(Store):
    """A :class:`Store` in Redis. See the module docstring for the key layout.

    ``client``, if given, is used instead of connecting to ``url``; it must
    have ``decode_responses=False`` and stays the caller's to close.
    """

    shared = True

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        prefix: str = "nexus",
        *,
        client: aioredis.Redis | None = None,
        max_connections: int = 128,
        pool_timeout_s: float = 5.0,
        block_s: float = 1.5,
        max_log_bytes: int | None = None,
    ) -> None:
        super().__init__()
        self.url = url
        self.prefix = prefix
        self.max_connections = max_connections
        self.pool_timeout_s = pool_timeout_s
        self.block_ms = _ms(block_s)
        """How long one XREAD blocks: also how soon a follower notices its log expired."""
        self._client = client
        self._owns_client = client is None
        self._live_ttl_ms: dict[str, int] = {}
        """Live streams begun here -> the TTL each append renews."""
        self.max_log_bytes = max_log_bytes
        """A live log past this many bytes (in codec form) is trimmed (``XADD MAXLEN ~``)."""
        self._live_bytes: dict[str, int] = {}
        """Live streams begun here -> the bytes of their entries mirrored so far."""
        self.replica_id = os.urandom(8).hex()
        """This process: its keep-alive key says its live streams are still running."""
        self._heartbeat: asyncio.Task[None] | None = None
        self._stopping = False

    @property
    def client(self) -> aioredis.Redis:
        if self._client is None:
            raise RuntimeError("RedisStore used before start()")
        return self._client

    async def start(self) -> None:
        """Connect and PING. Raises :class:`RedisUnavailable` (no credentials in it)."""
        if self._client is None:
            # Bounded: past it, a command waits up to pool_timeout_s, then fails.
            pool = aioredis.BlockingConnectionPool.from_url(
                self.url,
                decode_responses=False,
                max_connections=self.max_connections,
                timeout=self.pool_timeout_s,
                # Above block_ms, so a blocking XREAD is not cut short.
                socket_timeout=max(5.0, 2 * self.block_ms / 1000),
                socket_connect_timeout=5.0,
                retry=Retry(ExponentialWithJitterBackoff(base=0.01, cap=0.25), retries=3),
            )
            self._client = aioredis.Redis.from_pool(pool)  # closes the pool with it
        try:
            await self._client.ping()
            await self._client.set(self._replica_key(self.replica_id), b"1", px=_ms(OWNER_TTL_S))
        except (RedisError, OSError) as exc:
            if self._owns_client:
                await self._client.aclose()
                self._client = None
            where = redact_url(self.url)
            raise RedisUnavailable(
                f"Redis not reachable at {where}: {_scrub(str(exc), self.url)}"
            ) from None
        self._alive = self._client.register_script(_ALIVE)
        self._stopping = False
        self._heartbeat = asyncio.get_running_loop().create_task(self._beat())

    async def close(self) -> None:
        if self._heartbeat is not None:
            # redis-py may turn the cancellation of a command into a ConnectionError, which
            # _beat survives: the flag ends it for sure.
            self._stopping = True
            self._heartbeat.cancel()
            await asyncio.wait((self._heartbeat,), timeout=2.0)
            self._heartbeat = None
            with contextlib.suppress(RedisError, OSError):
                await self.client.delete(self._replica_key(self.replica_id))
        if self._client is not None and self._owns_client:
            await self._client.aclose()
            self._client = None

    @contextlib.contextmanager
    def _reaching(self, op: str) -> Iterator[None]:
        """Redis errors inside become :class:`StoreUnavailable`, counted as ``op``."""
        try:
            yield
        except (RedisError, OSError) as exc:
            for count in self.on_error:
                count(op)
            raise StoreUnavailable(
                "The stream store cannot be reached right now; retry shortly.",
                headers={"Retry-After": "1"},
            ) from exc

    # Keys.
    def _key(self, stream_id: str, part: str) -> str:
        return f"{self.prefix}:stream:{stream_id}:{part}"

    # Logs.
    async def begin(self, info: StreamInfo, ttl_s: float) -> None:
        ttl_ms = _ms(ttl_s)
        self._live_ttl_ms[info.id] = ttl_ms
        self._live_bytes[info.id] = 0
        pipe = self.client.pipeline(transaction=False)
        pipe.set(self._key(info.id, "owner"), self.replica_id.encode(), px=ttl_ms)
        pipe.set(self._key(info.id, "info"), orjson.dumps(info.to_json()), px=ttl_ms)
        # Also here, not only on the heartbeat: after a restart that lost it, this
        # replica's streams, begun again, must not look orphaned until the next beat.
        pipe.set(self._replica_key(self.replica_id), b"1", px=_ms(OWNER_TTL_S))
        try:
            with self._reaching("begin"):
                await pipe.execute()
        except StoreUnavailable:
            self._live_ttl_ms.pop(info.id, None)  # not begun: nothing of it to renew
            self._live_bytes.pop(info.id, None)
            raise

    async def keep_alive(self, stream_id: str) -> None:
        """Renew the live log's TTL: an idle stream must not expire while it runs."""
        ttl_ms = self._live_ttl_ms.get(stream_id)
        if ttl_ms is None:
            return
        pipe = self.client.pipeline(transaction=False)
        for part in ("info", "log", "owner"):
            pipe.pexpire(self._key(stream_id, part), ttl_ms)
        with self._reaching("keep_alive"):
            await pipe.execute()

    async def alive(self, stream_id: str) -> bool:
        """Whether the replica that runs ``stream_id`` still renews its keep-alive."""
        with self._reaching("alive"):
            owner = self._key(stream_id, "owner")
            return bool(await self._alive(keys=[owner], args=[self.prefix]))

    def _replica_key(self, replica_id: str) -> str:
        return f"{self.prefix}:replica:{replica_id}"

    async def _beat(self) -> None:
        """This replica is alive: one key for all its streams, renewed every third of its TTL."""
        key, ttl_ms = self._replica_key(self.replica_id), _ms(OWNER_TTL_S)
        while not self._stopping:
            try:
                await self.client.set(key, b"1", px=ttl_ms)
            except (RedisError, OSError) as exc:
                log.warning("renewing this replica's keep-alive failed: %s", type(exc).__name__)
            await asyncio.sleep(OWNER_TTL_S / 3)

    async def append(self, stream_id: str, start: int, events: Sequence[StreamEvent]) -> bool:
        """Entries ``start``... in one round trip, renewing the live TTL set by :meth:`begin`.

        False when the log is gone from Redis (``start`` > 0 and no log: lost in a
        restart, or expired while Redis was unreachable): nothing was written, and the
        caller begins again and appends from entry 0. Raises ``RuntimeError`` if
        :meth:`begin` was not called here: the log would otherwise be written without
        a TTL and never expire.
        """
        if not events:
            return True
        ttl_ms = self._live_ttl_ms.get(stream_id)
        if ttl_ms is None:
            raise RuntimeError(f"append() to stream {stream_id!r} before begin()")
        with self._reaching("append"):
            return await self._write(stream_id, start, events, ttl_ms, None)

    async def end(
        self,
        info: StreamInfo,
        events: Sequence[StreamEvent],
        start: int,
        ttl_s: float,
        size: int | None = None,
    ) -> None:
        self._live_ttl_ms.pop(info.id, None)
        ttl_ms = _ms(ttl_s)
        try:
            with self._reaching("end"):
                if not await self._write(info.id, start, events[start:], ttl_ms, info):
                    self._live_bytes[info.id] = 0
                    await self._write(info.id, 0, events, ttl_ms, info)  # lost: all of it again
                await self.client.delete(self._key(info.id, "owner"))
        finally:
            self._live_bytes.pop(info.id, None)

    async def _write(
        self,
        stream_id: str,
        start: int,
        events: Sequence[StreamEvent],
        ttl_ms: int,
        info: StreamInfo | None,
    ) -> bool:
        """XADD ``events`` as entries ``start``..., then (re)write ``info``, then set both TTLs.

        One pipeline, in this order: a reader that sees the finished info has
        the whole log. Entries already present (a replayed pipeline) are skipped.
        Past ``max_log_bytes`` the log is trimmed to about that size. False when
        ``start`` > 0 and the log is gone (``NOMKSTREAM``: nothing was added).
        """
        log, info_key = self._key(stream_id, "log"), self._key(stream_id, "info")
        payloads = [orjson.dumps(dump_event(event)) for event in events]
        size = self._live_bytes.get(stream_id, 0) + sum(map(len, payloads))
        self._live_bytes[stream_id] = size
        limit = self.max_log_bytes
        # Entries to keep: as many as fit in the limit, at the log's mean entry size.
        maxlen = (
            None
            if limit is None or size <= limit
            else max(1, (start + len(events)) * limit // size)
        )
        after_first = start > 0
        pipe = self.client.pipeline(transaction=False)
        for i, payload in enumerate(payloads, start + 1):
            pipe.xadd(
                log,
                {b"e": payload},
                id=f"0-{i}",
                maxlen=maxlen,
                approximate=True,
                nomkstream=after_first,
            )
        if info is not None:
            pipe.set(info_key, orjson.dumps(info.to_json()), px=ttl_ms)
        pipe.pexpire(log, ttl_ms)
        pipe.pexpire(info_key, ttl_ms)
        results = await pipe.execute(raise_on_error=False)
        for result in results:
            # "The ID specified in XADD is equal or smaller than the target stream top item"
            if isinstance(result, ResponseError) and "equal or smaller" not in str(result):
                raise result
        return not (after_first and payloads and results[0] is None)

    async def info(self, stream_id: str) -> StreamInfo | None:
        with self._reaching("info"):
            raw = await self.client.get(self._key(stream_id, "info"))
        return None if raw is None else StreamInfo.from_json(orjson.loads(raw))

    async def read(self, stream_id: str, start: int = 0) -> AsyncIterator[list[StreamEvent]]:
        """Catch up with XRANGE, then follow with blocking XREAD until the terminal entry.

        Also stops when the info says the stream ended and nothing is left to
        read (a start past the end, or a log without a terminal). Raises
        :class:`~nexus.errors.StreamNotFound` when neither info nor log exists,
        at the start or after an XREAD that timed out.
        """
        log = self._key(stream_id, "log")
        finished = await self._finished(stream_id)
        after = start - 1  # index of the last entry read
        while True:
            # Catch up, in pages.
            while True:
                with self._reaching("read"):
                    entries = await self.client.xrange(log, min=f"0-{after + 2}", count=_PAGE)
                entries = entries or []
                if entries:
                    events, after, terminal = _decode(stream_id, entries, after)
                    yield events
                    if terminal:
                        return
                if len(entries) < _PAGE:
                    break
            if finished:
                return
            # Follow. A quiet spell: did it end (catch up once more, then stop) or expire?
            while not finished:
                with self._reaching("read"):
                    reply = await self.client.xread(
                        {log: f"0-{after + 1}"}, count=_PAGE, block=self.block_ms
                    )
                entries = _xread_entries(reply)
                if entries:
                    events, after, terminal = _decode(stream_id, entries, after)
                    yield events
                    if terminal:
                        return
                else:
                    finished = await self._finished(stream_id)
                    if not finished and not await self.alive(stream_id):
                        # Catch up once more: it may have ended just now.
                        if await self._finished(stream_id):
                            finished = True
                            continue
                        raise StreamLost(
                            f"The replica running stream {stream_id!r} stopped before it "
                            "ended; retry the request."
                        )

    async def _finished(self, stream_id: str) -> bool:
        """Whether the stream ended; raises StreamNotFound if neither info nor log exists."""
        pipe = self.client.pipeline(transaction=False)
        pipe.get(self._key(stream_id, "info"))
        pipe.exists(self._key(stream_id, "log"))
        with self._reaching("read"):
            raw, exists = await pipe.execute()
        if raw is None:
            if not exists:
                raise StreamNotFound(f"No stream {stream_id!r}: unknown, or expired.")
            return False  # a log without info (a race at expiry): the terminal ends it
        status = orjson.loads(raw)["status"]
        return bool(status != "in_progress")

    # Leases.
    async def lease(self, stream_id: str, ttl_s: float) -> None:
        with self._reaching("lease"):
            await self.client.set(self._key(stream_id, "lease"), b"1", px=_ms(ttl_s))

    async def leased(self, stream_id: str) -> bool:
        with self._reaching("leased"):
            return bool(await self.client.exists(self._key(stream_id, "lease")))

    # Recordings.
    async def get_recording(self, key: str) -> Recording | None:
        with self._reaching("get_recording"):
            raw = await self.client.get(f"{self.prefix}:rec:{key}")
        if raw is None:
            return None
        data = orjson.loads(raw)
        return Recording(
            events=[load_event(item) for item in data["events"]],
            offsets=data["offsets"],
            provider=data["provider"],
            upstream_model=data["upstream_model"],
        )

    async def put_recording(self, key: str, recording: Recording, ttl_s: float) -> None:
        value = orjson.dumps(
            {
                "events": [dump_event(event) for event in recording.events],
                "offsets": recording.offsets,
                "provider": recording.provider,
                "upstream_model": recording.upstream_model,
            }
        )
        with self._reaching("put_recording"):
            await self.client.set(f"{self.prefix}:rec:{key}", value, px=_ms(ttl_s))

    # In-flight claims.
    async def claim(self, key: str, stream_id: str, ttl_s: float) -> str | None:
        script = self.client.register_script(_CLAIM)
        with self._reaching("claim"):
            held = await script(keys=[f"{self.prefix}:claim:{key}"], args=[stream_id, _ms(ttl_s)])
        return None if held is None else cast(bytes, held).decode()

    async def release(self, key: str, stream_id: str) -> None:
        script = self.client.register_script(_RELEASE)
        with self._reaching("release"):
            await script(keys=[f"{self.prefix}:claim:{key}"], args=[stream_id])


_ALIVE = """
local owner = redis.call('GET', KEYS[1])
if not owner then return 0 end
return redis.call('EXISTS', ARGV[1] .. ':replica:' .. owner)
"""
"""Whether the replica a stream's ``owner`` key names still has its keep-alive."""


def _xread_entries(reply: Any) -> list[Any]:
    """The entries of a one-stream XREAD reply, RESP2 (``[[key, entries]]``) or RESP3."""
    if not reply:
        return []
    if isinstance(reply, dict):
        (value,) = reply.values()
        return cast(list[Any], value[0])
    return cast(list[Any], reply[0][1])


def _scrub(message: str, url: str) -> str:
    """``message`` with the URL's credentials cut out, should a driver ever echo them."""
    try:
        parts = urlsplit(url)
        query = parse_qs(parts.query)
        secrets = [parts.password, parts.username, *query.get("password", ())]
    except ValueError:
        return "(details withheld)"
    for secret in secrets:
        if secret:
            message = message.replace(secret, "***")
    return message
