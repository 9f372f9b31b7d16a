"""Per-key limits in Redis: shared by every replica and worker on one store.

Keys, under the store's ``{prefix}:``::

    limits:rate:{key}      hash    the key's token bucket: tokens "t", last refill "at" (ms)
    limits:streams:{key}   zset    one member per stream running, scored by its lease deadline
    limits:held:{key}      hash    a running stream's budget hold (USD), by its slot's member
    spend:{key}:{window}   string  the window's spend in USD; expires a day after the window
    charged:{id}           string  a charge that was added (15 minutes): sent again, it adds nothing

One Lua script (:data:`_ADMIT`) checks and takes a request's budget (with its hold),
token (refilled on Redis's clock) and slot at once, atomically: two replicas cannot both
take the last one. A request of a key with a budget always takes a slot, which its hold
lives and goes with (a hold whose slot's lease ran out counts no more). A slot's score is
its lease deadline: this process renews all its slots on one tick (every third of
``[limits] stream_lease_s``, one pipeline), each with its hold (:data:`_RENEW`); a slot
goes as its stream ends, before the end reaches its clients (:meth:`RedisLimits.end`),
or, for a replica that died, at the next admission past its lease. An admission whose
reply was lost (the script may have taken the slot) removes its slot too, rather than
hold it for a lease.

A slot and its hold come back together. A replica that stalled past its lease (a pause,
a partition), or a Redis that lost the keys, finds its slots and holds gone, perhaps
after another replica was admitted in their place; its next renewal puts both back, so
that its streams, still running, count against the key's streams and budget again.
Together they may then be past either: what runs cannot be undone, but nothing more is
admitted until enough of them end.

Redis failing is never a 500: rate and concurrency fail open to this process
(:class:`~nexus.cache.limits.LocalLimits`, a warning a minute at most); a key with a
budget fails closed (503 ``store_unavailable``: spend that cannot be checked is not
spent); a charge that fails is retried on the tick under its id, so a charge whose reply
was lost counts once; a release that fails is left to its lease. At shutdown, charges
are retried until the shutdown's deadline; any still not in Redis then is logged at
ERROR, its key name, USD and the command that adds it, to be reconciled by hand.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import time
from typing import Any

from ..auth import ApiKey
from ..budgets import window
from .limits import (
    KeyLimits,
    LocalLimits,
    Slot,
    StoreUnavailable,
    budget_exceeded,
    rate_limited,
    too_many_streams,
)
from .redis import RedisStore

__all__ = ["RedisLimits"]

log = logging.getLogger("nexus.limits")

# KEYS: the rate bucket, the stream slots, the spend, the holds.
# ARGV: rate per second (0: none), bucket capacity, slot limit (0: none), slot id ("": no
#       slot), lease ms, budget (negative: none), hold USD.
# Returns {0, ""} admitted; {1, wait ms} no token; {2, ""} no slot; {3, spend, held}
# budget spent, or its rest held.
_ADMIT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local slot = ARGV[4]
if slot ~= '' then redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now) end
local budget = tonumber(ARGV[6])
local hold = tonumber(ARGV[7])
if budget >= 0 then
  local spent = tonumber(redis.call('GET', KEYS[3]) or '0') or 0
  local held = 0
  local holds = redis.call('HGETALL', KEYS[4])
  for i = 1, #holds, 2 do
    if redis.call('ZSCORE', KEYS[2], holds[i]) then
      held = held + tonumber(holds[i + 1])
    else
      redis.call('HDEL', KEYS[4], holds[i])
    end
  end
  if spent >= budget or spent + held + hold > budget then
    return {3, tostring(spent), tostring(held)}
  end
end
local rate = tonumber(ARGV[1])
if rate > 0 then
  local capacity = tonumber(ARGV[2])
  local bucket = redis.call('HMGET', KEYS[1], 't', 'at')
  local tokens = tonumber(bucket[1]) or capacity
  local at = tonumber(bucket[2]) or now
  if now > at then
    tokens = math.min(capacity, tokens + (now - at) * rate / 1000)
    at = now
  end
  local ok = tokens >= 1
  if ok then tokens = tokens - 1 end
  redis.call('HSET', KEYS[1], 't', tostring(tokens), 'at', tostring(at))
  redis.call('PEXPIRE', KEYS[1], math.ceil(capacity / rate * 1000) + 1000)
  if not ok then return {1, tostring(math.ceil((1 - tokens) * 1000 / rate))} end
end
if slot ~= '' then
  local limit = tonumber(ARGV[3])
  local lease = tonumber(ARGV[5])
  if limit > 0 and redis.call('ZCARD', KEYS[2]) >= limit then return {2, ''} end
  redis.call('ZADD', KEYS[2], now + lease, slot)
  redis.call('PEXPIRE', KEYS[2], lease * 2)
  if hold > 0 then
    redis.call('HSET', KEYS[4], slot, ARGV[7])
    redis.call('PEXPIRE', KEYS[4], lease * 2)
  end
end
return {0, ''}
"""

# KEYS: a key's stream slots, its holds. ARGV: lease ms, then for each slot held here its
# id and its hold (USD; 0: none, or charged already).
# Not XX: a slot Redis lost (it restarted, or was unreachable past the set's TTL, or this
# process stalled past the lease and another admission dropped it) comes back, since its
# stream still runs, and its hold with it: a slot back without its hold would let the key
# spend that hold twice. Until those streams end the key may be over its limits, which
# then refuse it, never the reverse.
_RENEW = """
local t = redis.call('TIME')
local lease = tonumber(ARGV[1])
local deadline = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + lease
for i = 2, #ARGV, 2 do
  redis.call('ZADD', KEYS[1], deadline, ARGV[i])
  if tonumber(ARGV[i + 1]) > 0 then redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1]) end
end
redis.call('PEXPIRE', KEYS[1], lease * 2)
redis.call('PEXPIRE', KEYS[2], lease * 2)
return 0
"""

# KEYS: the spend, the charge's marker, the key's holds. ARGV: USD, the spend's TTL ms
# (0: none), the marker's TTL ms, the slot whose hold the charge replaces ("": none). A
# charge sent again (its reply was lost: redis-py and the tick retry it) finds its marker
# and adds nothing.
_CHARGE = """
if redis.call('SET', KEYS[2], '1', 'NX', 'PX', ARGV[3]) then
  redis.call('INCRBYFLOAT', KEYS[1], ARGV[1])
  local ttl = tonumber(ARGV[2])
  if ttl > 0 then redis.call('PEXPIRE', KEYS[1], ttl) end
end
if ARGV[4] ~= '' then redis.call('HDEL', KEYS[3], ARGV[4]) end
return 0
"""

_RECONCILE = (
    "if redis.call('SET', KEYS[2], '1', 'NX', 'PX', 86400000) then "
    "return redis.call('INCRBYFLOAT', KEYS[1], ARGV[1]) end"
)
"""A lost charge added by hand (its ERROR line's command): once, under the charge's marker,
whether or not the charge itself landed after all (within :data:`_CHARGE_MARK_MS`)."""

_CHARGE_MARK_MS = 900_000
"""How long a charge's marker outlives it: longer than its retries, short enough that the
markers of a busy gateway stay small (100 charges a second: ~90,000 keys). A charge
whose reply was lost just before an outage longer than this may count twice."""

_WARN_EVERY_S = 60.0

_END_WAIT_S = 1.0
"""How long a stream's end waits for its slot to leave Redis before its clients see it:
a Redis that is slow delays ends by no more than this (the slot then goes a little later,
or with its lease)."""


class RedisLimits(KeyLimits):
    """:class:`KeyLimits` in the Redis of ``store`` (see the module docstring).

    ``fallback`` is what admits while Redis fails (rate and concurrency only).
    """

    def __init__(
        self,
        store: RedisStore,
        *,
        rate: float,
        per_key: int | None,
        lease_s: float,
        fallback: LocalLimits,
    ) -> None:
        self.store = store
        self.rate = rate
        self.capacity = max(rate, 1.0)
        self.per_key = per_key
        self.lease_ms = max(1, round(lease_s * 1000))
        self.fallback = fallback
        self._held: dict[str, dict[str, Slot]] = {}
        """Key name -> slot id -> the slots held here: what the tick renews."""
        self._ids = itertools.count()
        self._unsent: dict[str, tuple[str, str, float, float | None, str]] = {}
        """Charge id -> (key, window, USD, TTL, the slot whose hold it replaces) of
        charges not yet sent or that failed, retried on the tick under the same id
        (counted once however often sent)."""
        self._sending: dict[str, tuple[str, str, float, float | None, str]] = {}
        """Charges being sent (out of ``_unsent`` until they fail)."""
        self._tasks: set[asyncio.Task[Any]] = set()
        self._ticker: asyncio.Task[None] | None = None
        self._warned = -math.inf

    def _key(self, *parts: str) -> str:
        return ":".join((self.store.prefix, *parts))

    async def start(self) -> None:
        self._ticker = asyncio.get_running_loop().create_task(self._tick())

    async def close(self, *, deadline: float | None = None) -> None:
        loop = asyncio.get_running_loop()
        stop_by = loop.time() + 10.0 if deadline is None else deadline

        def left(most: float) -> float:
            return max(min(most, stop_by - loop.time()), 0.0)

        ticker, self._ticker = self._ticker, None
        if ticker is not None:
            ticker.cancel()
            await asyncio.wait((ticker,), timeout=left(2.0))
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=left(2.0))
        try:
            async with asyncio.timeout_at(stop_by):
                # Charges not yet in Redis: retried until the deadline (no tick follows).
                while True:
                    await self._flush_charges(closing=True)
                    if not self._unsent and not self._sending:
                        break
                    await asyncio.sleep(0.2)
                # Slots still held (streams cut by the shutdown) go now, not at their
                # lease's end.
                held, self._held = self._held, {}
                freed = [cmd for name, ids in held.items() for cmd in self._freed(name, *ids)]
                await self._send("release", freed)
        except TimeoutError:
            log.warning("per-key limits: Redis did not answer before the shutdown deadline")
        # What is still not charged is lost unless someone adds it: one line each, with a
        # command that adds it once, under its charge's own marker: one sent before Redis
        # stalled may still land when it resumes, and then the command adds nothing.
        charges = {**self._sending, **self._unsent}
        for charge_id, (name, win_id, usd, _, _) in charges.items():
            log.error(
                "spend not charged (Redis failed at shutdown): key %r, %s USD; add it once "
                "with: EVAL %s 2 %s %s %s",
                name,
                repr(usd),
                json.dumps(_RECONCILE),
                self._key("spend", name, win_id),
                self._key("charged", charge_id),
                repr(usd),
            )
        self._unsent.clear()

    async def _send(self, op: str, commands: list[tuple[Any, ...]]) -> bool:
        """``commands`` through the store's pipeline; a failure warned (and counted)."""
        try:
            if commands:
                await self.store.call(op, *commands)
            return True
        except StoreUnavailable as exc:
            self._warn(exc.__cause__ or exc)
            return False

    def _freed(self, name: str, *ids: str) -> list[tuple[Any, ...]]:
        """The commands that let slots ``ids`` of key ``name`` go, and their holds."""
        return [
            ("ZREM", self._key("limits", "streams", name), *ids),
            ("HDEL", self._key("limits", "held", name), *ids),
        ]

    async def admit(
        self, key: ApiKey, *, stream: bool, rate: bool = True, hold: float = 0.0
    ) -> Slot | None:
        name = key.name
        slot = None
        budget = key.budget_usd if stream else None
        if stream and (self.per_key is not None or budget is not None):
            slot = Slot(name, f"{self.store.replica_id}-{next(self._ids)}", hold)
        per_second = self.rate if rate else 0.0
        if slot is None and budget is None and per_second <= 0:
            return None  # nothing to count: no round trip
        win_id = window(key.budget_period, time.time()).id if budget is not None else ""
        try:
            ((code, value, *held),) = await self.store.call(
                "admit",
                (
                    "EVAL",
                    _ADMIT,
                    4,
                    self._key("limits", "rate", name),
                    self._key("limits", "streams", name),
                    self._key("spend", name, win_id),
                    self._key("limits", "held", name),
                    repr(per_second),
                    repr(self.capacity),
                    self.per_key if slot is not None and self.per_key is not None else 0,
                    slot.id if slot is not None else "",
                    self.lease_ms,
                    repr(budget) if budget is not None else -1,
                    repr(hold) if budget is not None else 0,
                ),
            )
        except StoreUnavailable as exc:
            if slot is not None:  # the script may have run, its reply lost: give it back
                self._release_later(name, slot.id)
            if budget is not None:
                raise StoreUnavailable(
                    f"The spend of the API key {name!r} cannot be checked: the store is "
                    "unavailable; retry shortly.",
                    headers={"Retry-After": "1"},
                ) from None
            self._warn(exc.__cause__ or exc)
            self.fallback.check(key, stream=stream, budget=False, rate=rate)
            return None
        except asyncio.CancelledError:
            # The client left while the script was in flight: it may have run and taken
            # the slot, which nobody here holds or renews (it would stay for its lease).
            if slot is not None:
                self._release_later(name, slot.id)
            raise
        code = int(code)
        if code == 1:
            raise rate_limited(name, self.rate, int(value) / 1000)
        if code == 2:
            assert self.per_key is not None
            raise too_many_streams(name, self.per_key)
        if code == 3:
            raise budget_exceeded(key, float(value), time.time(), float(held[0]), hold)
        if slot is not None:
            self._held.setdefault(name, {})[slot.id] = slot
        return slot

    async def end(self, slot: Slot) -> None:
        if self._forget(slot):
            await asyncio.wait((self._release_later(slot.key, slot.id),), timeout=_END_WAIT_S)

    def release(self, slot: Slot) -> None:
        if self._forget(slot):
            self._release_later(slot.key, slot.id)

    def _forget(self, slot: Slot) -> bool:
        """Stop renewing ``slot``: True if it was held here (released once, however often
        asked)."""
        held = self._held.get(slot.key)
        if held is None or held.pop(slot.id, None) is None:
            return False
        if not held:
            del self._held[slot.key]
        return True

    def _release_later(self, name: str, slot_id: str) -> asyncio.Task[bool]:
        """Remove a slot from Redis in the background; if that fails, its lease runs out."""
        task = asyncio.get_running_loop().create_task(
            self._send("release", self._freed(name, slot_id))
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def charge(self, key: ApiKey, usd: float, slot: Slot | None = None) -> None:
        now = time.time()
        win = window(key.budget_period, now)
        charge_id = f"{self.store.replica_id}-{next(self._ids)}"
        held = "" if slot is None else slot.id
        self._unsent[charge_id] = (key.name, win.id, usd, win.ttl_s(now), held)
        if slot is not None:
            slot.hold = 0.0
        await self._flush_charges()

    async def _flush_charges(self, *, closing: bool = False) -> None:
        sending, self._unsent = self._unsent, {}
        commands = [
            (
                "EVAL",
                _CHARGE,
                3,
                self._key("spend", name, win_id),
                self._key("charged", charge_id),
                self._key("limits", "held", name),
                repr(usd),
                0 if ttl is None else max(1, round(ttl * 1000)),
                _CHARGE_MARK_MS,
                held,
            )
            for charge_id, (name, win_id, usd, ttl, held) in sending.items()
        ]
        self._sending.update(sending)  # (close() reports them if they never arrive)
        try:
            sent = await self._send("charge", commands)
        except BaseException:  # cancelled (a hook call past its timeout): sent again later
            self._unsent.update(sending)
            raise
        finally:
            for charge_id in sending:
                self._sending.pop(charge_id, None)
        if not sent:
            if not closing:
                log.warning("charging spend failed: retried on the next tick")
            self._unsent.update(sending)

    async def spent(self, key: ApiKey) -> float:
        win = window(key.budget_period, time.time())
        raw: Any = await self.store.client.get(self._key("spend", key.name, win.id))
        return 0.0 if raw is None else float(raw)

    async def _tick(self) -> None:
        """Renew the leases of the slots held here; retry charges that failed."""
        while True:
            await asyncio.sleep(self.lease_ms / 3000)
            await self._renew()
            await self._flush_charges()

    async def _renew(self) -> None:
        """The leases of the slots held here, each with its hold, in one pipeline (their
        commands queued before any charge or release that follows, which Redis then
        carries out after them)."""
        leases = [
            (
                "EVAL",
                _RENEW,
                2,
                self._key("limits", "streams", name),
                self._key("limits", "held", name),
                self.lease_ms,
                *itertools.chain.from_iterable((id, repr(slot.hold)) for id, slot in slots.items()),
            )
            for name, slots in self._held.items()
        ]
        await self._send("renew", leases)

    def _warn(self, exc: BaseException) -> None:
        now = time.monotonic()
        if now - self._warned >= _WARN_EVERY_S:
            self._warned = now
            log.warning(
                "per-key limits: Redis failed (%s); rate and concurrency are held per "
                "process until it is back",
                type(exc).__name__,
            )
