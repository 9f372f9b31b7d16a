"""What one API key holds in Redis: a byte count per owner, shared by every replica, and
past ``[store] max_bytes_per_key`` that owner's own finished entries deleted, nearest
their expiry first.

Without it, Redis held whatever a key made for its TTL: one key repeating a cached
3.5 MB request 100 times (no upstream call) left 100 logs, 358 MiB, for ``resume_ttl_s``;
at Redis's ``maxmemory`` every tenant's streams then fail. The memory store bounds a key
the same way (:mod:`nexus.cache.memory`).

Keys, under ``{prefix}:quota:{owner}:``::

    sizes   hash   member -> its bytes; field ``*``: their sum (the count)
    live    zset   logs of running streams, scored by when they expire (ms, Redis's clock)
    done    zset   finished logs and recordings, scored by when they expire

A member is ``log:{stream id}`` (its ``:log`` and ``:info`` keys) or ``rec:{cache key}``.
The three keys expire with the last entry they count, so a count never outlives what it
counts, and an entry that expired leaves the count at the next write.

**One command per round trip** (:class:`Tally`): the count rides on the writes that add
bytes, after them in the same pipeline (the mirror's appends and ends, a recording's
``SET``), as one script for every owner in it; no command per event, no round trip of
its own. A live log is counted as it starts, at every :data:`STEP` bytes and at its end,
so what a key's running streams hold is known to within 64 kB each. A log is counted at
its size so far (the bytes the mirror has written; of a log trimmed past ``[streams]
max_log_bytes``, about those the trim kept), not by increments: a write retried after a
failure, or a log written again from its start, sets the same count, never twice.

**Who goes.** Past the limit, the owner's finished logs and recordings, those nearest
their expiry first (for entries of one kind, the oldest), are deleted; never another
owner's, never a running stream's log, never the entries of the write that passed the
limit (a stream that just ended can be resumed, a recording just made replayed). When
only those remain, the owner stays over its limit until its streams end: a running
stream is never cut or stopped from mirroring (its clients on other replicas and its
resume rely on its log), and what running streams hold is bounded by ``[streams]
max_log_bytes`` each and ``[limits] max_concurrent_streams_per_key``. Entries of no owner
(no keys configured) are not counted: as in the memory store, they are bounded by their
TTL only.

A live log renewed by its keep-alive but not written for its whole TTL (a stream idle
for ``resume_ttl_s``) leaves the count until its next write, which counts it whole again.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ENTRY_OVERHEAD", "STEP", "Quota", "Tally"]

ENTRY_OVERHEAD = 256
"""Bytes an entry costs beyond its payload (its info, the keys): counted as the memory
store counts them."""
STEP = 64 * 1024
"""A live log is counted again once it grew this much: a stream of small tokens costs
one count per 64 kB, not one per mirror turn (which took Redis 3.5x the CPU per token)."""

# KEYS: per owner its sizes, live and done (see the module docstring). ARGV: the prefix,
# the limit, then per owner the count of its entries and, per entry, its member, bytes,
# TTL in ms and 1 if it is finished. Returns how many entries it deleted.
_COUNT = """
local prefix, limit = ARGV[1], tonumber(ARGV[2])
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local function keys_of(member)
  local name = string.sub(member, 5)
  if string.sub(member, 1, 4) == 'rec:' then return {prefix .. ':rec:' .. name} end
  return {prefix .. ':stream:' .. name .. ':log', prefix .. ':stream:' .. name .. ':info'}
end
local deleted, at = 0, 3
for owner = 1, #KEYS, 3 do
  local sizes, live, done = KEYS[owner], KEYS[owner + 1], KEYS[owner + 2]
  local total = tonumber(redis.call('HGET', sizes, '*') or '0')
  local function forget(member)
    total = total - tonumber(redis.call('HGET', sizes, member) or '0')
    redis.call('HDEL', sizes, member)
    redis.call('ZREM', live, member)
    redis.call('ZREM', done, member)
  end
  for _, set in ipairs({live, done}) do  -- expired: no longer held
    for _, member in ipairs(redis.call('ZRANGEBYSCORE', set, '-inf', now)) do
      forget(member)
    end
  end
  local ended = {}
  for _ = 1, tonumber(ARGV[at]) do
    local member, bytes = ARGV[at + 1], tonumber(ARGV[at + 2])
    local expires, finished = now + tonumber(ARGV[at + 3]), ARGV[at + 4] == '1'
    at = at + 4
    if not finished and redis.call('ZSCORE', live, member) then  -- a live log grows
      total = total + bytes - tonumber(redis.call('HGET', sizes, member) or '0')
      redis.call('HSET', sizes, member, bytes)
      redis.call('ZADD', live, expires, member)
    else
      forget(member)
      if redis.call('EXISTS', keys_of(member)[1]) == 1 then  -- (else lost, or never written)
        total = total + bytes
        redis.call('HSET', sizes, member, bytes)
        if finished then
          table.insert(ended, {expires, member})
        else
          redis.call('ZADD', live, expires, member)
        end
      end
    end
  end
  at = at + 1
  while total > limit do  -- its own finished entries, nearest their expiry first
    local first = redis.call('ZPOPMIN', done)
    if #first == 0 then break end
    total = total - tonumber(redis.call('HGET', sizes, first[1]) or '0')
    redis.call('HDEL', sizes, first[1])
    redis.call('DEL', unpack(keys_of(first[1])))
    deleted = deleted + 1
  end
  for _, entry in ipairs(ended) do redis.call('ZADD', done, entry[1], entry[2]) end
  local last = 0
  for _, set in ipairs({live, done}) do
    local top = redis.call('ZRANGE', set, -1, -1, 'WITHSCORES')
    if top[2] and tonumber(top[2]) > last then last = tonumber(top[2]) end
  end
  if last == 0 then
    redis.call('DEL', sizes, live, done)
  else
    redis.call('HSET', sizes, '*', total)
    for _, key in ipairs({sizes, live, done}) do redis.call('PEXPIREAT', key, last) end
  end
end
return deleted
"""


class Quota:
    """A store's counting: :meth:`tally` gathers what one round trip writes."""

    def __init__(self, prefix: str, limit: int | None) -> None:
        self.prefix = prefix
        self.limit = limit
        """An owner's bytes (``[store] max_bytes_per_key``); None counts nothing."""
        self.counted: dict[str, int] = {}
        """Live logs of this process -> the size they were last counted at."""

    def tally(self) -> Tally:
        return Tally(self)


class Tally:
    """The entries one round trip writes, by owner: :meth:`commands` counts them, and
    :meth:`sent` notes them counted once the round trip went through."""

    __slots__ = ("entries", "logs", "quota")

    def __init__(self, quota: Quota) -> None:
        self.quota = quota
        self.entries: dict[str, list[Any]] = {}
        self.logs: dict[str, int] = {}

    def log(self, owner: str | None, stream_id: str, size: int, ttl_ms: int, end: bool) -> None:
        """A log that holds ``size`` bytes so far. A live one is counted as it starts,
        then every :data:`STEP` bytes, and at its end."""
        quota = self.quota
        if owner is None or quota.limit is None:
            return
        if not end:
            if size - quota.counted.get(stream_id, -STEP) < STEP:
                return
            self.logs[stream_id] = size
        else:
            self.logs[stream_id] = -1
        self._add(owner, "log:" + stream_id, size, ttl_ms, end)

    def recording(self, owner: str | None, key: str, size: int, ttl_ms: int) -> None:
        if owner is not None and self.quota.limit is not None:
            self._add(owner, "rec:" + key, size, ttl_ms, True)

    def _add(self, owner: str, member: str, size: int, ttl_ms: int, end: bool) -> None:
        entry = (member, size + ENTRY_OVERHEAD, ttl_ms, 1 if end else 0)
        self.entries.setdefault(owner, []).append(entry)

    def commands(self) -> list[tuple[Any, ...]]:
        """The script that counts the entries (none when there are none), to send after
        the writes themselves, in their round trip."""
        if not self.entries:
            return []
        prefix = self.quota.prefix
        keys: list[str] = []
        args: list[Any] = [prefix, self.quota.limit]
        for owner, entries in self.entries.items():
            base = f"{prefix}:quota:{owner}:"
            keys += (base + "sizes", base + "live", base + "done")
            args.append(len(entries))
            for entry in entries:
                args += entry
        return [("EVAL", _COUNT, len(keys), *keys, *args)]

    def sent(self) -> None:
        """The round trip went through: its live logs are counted at their sizes (a
        failed one counts them again, with their next write)."""
        counted = self.quota.counted
        for stream_id, size in self.logs.items():
            if size < 0:
                counted.pop(stream_id, None)
            else:
                counted[stream_id] = size
