"""Who holds a live stream in the Redis store, and who may start one: the replicas'
keep-alives, the leases of clients that follow a stream from another replica, the flag a
resumable join on another replica sets, prepaid reads, and in-flight claims; and how far a
live stream is, asked of the replica running it (:mod:`nexus.cache.redis_asks`).
:class:`~nexus.cache.redis.RedisStore` is one.

A lease is one key per stream for all its followers: each renews it while it reads
(``SET PX``), and one that leaves sets it to lapse when the stream may end for its sake
(:meth:`RedisHolds.unlease`): at once (1 s) for a plain stream, ``detach_timeout_s`` for a
resumable one. Those still reading renew it sooner than that, so the key lapses when the
last client elsewhere has been gone as long as it may be; the owner asks once its own last
client left (:meth:`RedisHolds.held`) and again when the lease would lapse.

A prepaid read is one key per stream and API key (``SET PX`` as the ``202`` is sent), taken
with ``DEL``: Redis deletes a key once, so of concurrent reads on any replicas, one gets it.
"""

from __future__ import annotations

import asyncio
import logging
from abc import abstractmethod
from collections.abc import Sequence
from typing import Any, cast

from ..errors import StoreUnavailable
from .redis_asks import Asks
from .redis_log import LiveLog
from .redis_url import scrub
from .store import OWNER_TTL_S, Store

__all__ = ["RedisHolds", "ms"]

log = logging.getLogger("nexus.store")


def ms(ttl_s: float) -> int:
    """A TTL for PX / PEXPIRE, which take whole milliseconds above zero."""
    return max(1, round(ttl_s * 1000))


# Whether the replica a stream's owner key names still has its keep-alive.
_ALIVE = """
local owner = redis.call('GET', KEYS[1])
if not owner then return 0 end
return redis.call('EXISTS', ARGV[1] .. ':replica:' .. owner)
"""
# Scripts (EVAL: Redis keeps them compiled). A claim is atomic, so no window between "it
# is taken" and "by whom"; its holder claiming again renews it, as in MemoryStore.
_CLAIM = """
local held = redis.call('GET', KEYS[1])
if held and held ~= ARGV[1] then return held end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return false
"""
# Deleted only if still ours: it may have expired and been taken since.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
return 0
"""
# The owner's question once its last local client left (KEYS: lease, resumable flag; ARGV:
# 1 if its run is resumable, the flag's TTL): the lease's ms left and whether a join elsewhere
# made it resumable; held by nothing, it is marked as ending in the same step, so that no
# join elsewhere can make it resumable after the owner decided to cancel it.
_HELD = """
local left = redis.call('PTTL', KEYS[1])
if left < 0 then left = 0 end
local made = redis.call('GET', KEYS[2]) == '1'
if left == 0 and (ARGV[1] == '1' or not made) then
  redis.call('SET', KEYS[2], '0', 'PX', ARGV[2])
end
if made then return {left, 1} end
return {left, 0}
"""
# A resumable join from another replica (KEYS: resumable flag, lease; ARGV: the flag's TTL,
# the hold): refused once the owner decided to end the stream; else the flag, and the lease
# lasts the hold at least.
_MAKE_RESUMABLE = """
if redis.call('GET', KEYS[1]) == '0' then return 0 end
redis.call('SET', KEYS[1], '1', 'PX', ARGV[1])
if redis.call('PTTL', KEYS[2]) < tonumber(ARGV[2]) then
  redis.call('SET', KEYS[2], '1', 'PX', ARGV[2])
end
return 1
"""
# A plain join from another replica (KEYS: resumable flag, lease; ARGV: the hold): refused
# once the owner decided to end the stream; else the lease lasts the hold at least.
_JOIN = """
if redis.call('GET', KEYS[1]) == '0' then return 0 end
if redis.call('PTTL', KEYS[2]) < tonumber(ARGV[1]) then
  redis.call('SET', KEYS[2], '1', 'PX', ARGV[1])
end
return 1
"""
# A client elsewhere left (KEYS: lease, resumable flag; ARGV: its hold, its hold once resumable).
_UNLEASE = """
local hold = ARGV[1]
if redis.call('GET', KEYS[2]) == '1' then hold = ARGV[2] end
redis.call('PEXPIRE', KEYS[1], hold)
return 0
"""


class RedisHolds(Store):
    """Leases, resumable flags and claims, for :class:`~nexus.cache.redis.RedisStore`
    (see the module docstring)."""

    prefix: str
    url: str
    replica_id: str
    _live: dict[str, LiveLog]
    """Live streams begun here -> their logs."""
    asks: Asks

    @abstractmethod
    async def call(self, op: str, *commands: tuple[Any, ...], allow: str = "") -> list[Any]:
        """The replies to ``commands``, sent together (the store's pipeline)."""

    def _key(self, stream_id: str, part: str) -> str:
        return f"{self.prefix}:stream:{stream_id}:{part}"

    # Replicas.
    async def alive(self, stream_id: str) -> bool:
        """Whether the replica that runs ``stream_id`` still renews its keep-alive."""
        owner = self._key(stream_id, "owner")
        (alive,) = await self.call("alive", ("EVAL", _ALIVE, 1, owner, self.prefix))
        return bool(alive)

    def _replica_key(self, replica_id: str) -> str:
        return f"{self.prefix}:replica:{replica_id}"

    async def _beat(self) -> None:
        """This replica is alive: one key for all its streams, renewed every third of its
        TTL. Beside it, a key only the beat writes: found missing, Redis lost what it held
        (a restart) or the beats lapsed past its TTL, and the hub checks its live streams
        (:attr:`on_lost`) rather than leave the quiet ones unfound until their next event
        or the periodic renewal. (Not the replica's key: a request's begin writes it too.)"""
        key, ttl_ms = self._replica_key(self.replica_id), ms(OWNER_TTL_S)
        beat = key + ":beat"
        while True:
            await asyncio.sleep(OWNER_TTL_S / 3)  # (start() set both)
            try:
                _, was = await self.call(
                    "beat",
                    ("SET", key, b"1", "PX", ttl_ms),
                    ("SET", beat, b"1", "PX", ttl_ms, "GET"),
                )
            except StoreUnavailable as exc:
                cause = exc.__cause__  # (a timeout says nothing but its class)
                said = f"{type(cause).__name__}: {scrub(str(cause), self.url)}".rstrip(": ")
                log.warning("renewing this replica's keep-alive failed: %s", said)
                continue
            if was is None:
                log.warning(
                    "the store lost this replica's keys (Redis restarted?): checking its streams"
                )
                self.on_lost()

    # Leases.
    async def lease(self, stream_id: str, ttl_s: float) -> None:
        await self.call("lease", ("SET", self._key(stream_id, "lease"), b"1", "PX", ms(ttl_s)))

    async def unlease(self, stream_id: str, hold_s: float, resumable_hold_s: float) -> None:
        keys = (self._key(stream_id, "lease"), self._key(stream_id, "resumable"))
        await self.call("lease", ("EVAL", _UNLEASE, 2, *keys, ms(hold_s), ms(resumable_hold_s)))

    async def leased(self, stream_id: str) -> bool:
        (found,) = await self.call("leased", ("EXISTS", self._key(stream_id, "lease")))
        return bool(found)

    async def held(self, stream_id: str, resumable: bool) -> tuple[float, bool]:
        keys = (self._key(stream_id, "lease"), self._key(stream_id, "resumable"))
        live = self._live.get(stream_id)
        ttl = ms(OWNER_TTL_S) if live is None else live.ttl
        ((left, made),) = await self.call(
            "leased", ("EVAL", _HELD, 2, *keys, 1 if resumable else 0, ttl)
        )
        return int(left) / 1000, bool(made)

    async def make_resumable(self, stream_id: str, ttl_s: float, hold_s: float) -> bool:
        keys = (self._key(stream_id, "resumable"), self._key(stream_id, "lease"))
        (made,) = await self.call(
            "lease", ("EVAL", _MAKE_RESUMABLE, 2, *keys, ms(ttl_s), ms(hold_s))
        )
        return bool(made)

    async def hold_for_join(self, stream_id: str, hold_s: float) -> bool:
        keys = (self._key(stream_id, "resumable"), self._key(stream_id, "lease"))
        (held,) = await self.call("lease", ("EVAL", _JOIN, 2, *keys, ms(hold_s)))
        return bool(held)

    async def leased_among(self, stream_ids: Sequence[str]) -> set[str]:
        if not stream_ids:
            return set()
        found = await self.call("leased", *(("EXISTS", self._key(i, "lease")) for i in stream_ids))
        return {stream_id for stream_id, hit in zip(stream_ids, found, strict=True) if hit}

    async def reached(self, stream_id: str, entries: int) -> bool:
        log, owner = self._key(stream_id, "log"), self._key(stream_id, "owner")
        return await self.asks.reached(log, owner, stream_id, entries)

    # Prepaid reads.
    def _prepaid(self, stream_id: str, key: str) -> str:
        # The key's name first: it has no "/", so no id a client sends names another's.
        return f"{self.prefix}:prepaid:{key}/{stream_id}"

    async def prepay_read(self, stream_id: str, key: str, ttl_s: float) -> None:
        await self.call("prepay", ("SET", self._prepaid(stream_id, key), b"1", "PX", ms(ttl_s)))

    async def take_prepaid_read(self, stream_id: str, key: str) -> bool:
        (taken,) = await self.call("prepay", ("DEL", self._prepaid(stream_id, key)))
        return bool(taken)

    # In-flight claims.
    async def claim(self, key: str, stream_id: str, ttl_s: float) -> str | None:
        claim = f"{self.prefix}:claim:{key}"
        (held,) = await self.call("claim", ("EVAL", _CLAIM, 1, claim, stream_id, ms(ttl_s)))
        return None if held is None else cast(bytes, held).decode()

    async def release(self, key: str, stream_id: str) -> None:
        await self.call("release", ("EVAL", _RELEASE, 1, f"{self.prefix}:claim:{key}", stream_id))
