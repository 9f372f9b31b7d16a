"""Per-key limits in Redis: shared by every replica and worker on one store.

Keys, under the store's ``{prefix}:``::

    limits:rate:{key}      hash    the key's token bucket: tokens "t", last refill "at" (ms)
    limits:streams:{key}   zset    one member per stream running, scored by its lease deadline
    limits:sockets:{key}   zset    one member per realtime socket open, as a stream's slot
    limits:readers:{key}   zset    one member per HTTP reader without a slot, as a stream's slot
    limits:held:{key}      hash    a running stream's budget hold (USD), by its slot's member
    spend:{key}:{window}   string  the window's spend in USD; expires a day after the window
    charged:{id}           string  a charge that was added (15 minutes): sent again, it adds nothing

One Lua script (:data:`~nexus.cache.redis_limit_scripts.ADMIT`; the scripts are in
:mod:`nexus.cache.redis_limit_scripts`) checks and takes a request's budget (with its
hold), token (refilled on Redis's clock) and slot at once, atomically: two replicas
cannot both take the last one. A request of a key with a budget always takes a slot,
which its hold lives and goes with (a hold whose slot's lease ran out counts no more). A
slot's score is its lease deadline: this process renews all its slots on one tick (every
third of ``[limits] stream_lease_s``, one pipeline), each with its hold (``RENEW``); a
slot goes as its stream ends, before the end reaches its clients
(:meth:`RedisLimits.end`), or, for a replica that died, at the next admission past its
lease. An admission whose reply was lost (the script may have taken the slot, or may yet:
a stalled Redis runs what it was sent once it resumes) removes its slot, again until a
removal lands, rather than hold it for a lease.

Sockets and readers (:meth:`RedisLimits.enter`) are slots of the same kind, in sets of
their own: taken by the same script (without rate or budget), renewed on the same tick,
let go as their holder leaves (in the background), with their lease, or at shutdown.

A slot and its hold come back together. A replica that stalled past its lease, or a Redis
that lost the keys, finds its slots and holds gone, perhaps after another replica was
admitted in their place; its next renewal puts both back, so that its streams, still
running, count again (past the limit, perhaps: nothing more is admitted until enough end).
So do the slots taken while Redis failed (admitted by this process's own count): held
here as any other, the next renewal that reaches Redis puts them in it. After any failure,
a key's next admission of a kind puts back first, in the same pipeline, the slots of that
kind held here, so that a replica back from an outage does not admit the key's whole
limit again beside them. Replicas cut off together may each have admitted the whole limit.

Redis failing is never a 500: rate and concurrency (streams, sockets, readers) fail open
to this process (:class:`~nexus.cache.limits.LocalLimits`, which counts every place held
here; a warning a minute at most), its places counted in Redis once it is back (above);
a key with a budget fails closed (503 ``store_unavailable``: spend that cannot be
checked is not spent); a charge that fails is retried on the tick under its id, so a
charge whose reply was lost counts once; a release that fails is left to its lease. At
shutdown, charges are retried until the shutdown's deadline; any still not in Redis then
is logged at ERROR, its key name, USD and the command that adds it, to be reconciled by
hand.
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
    STREAMS,
    KeyLimits,
    LocalLimits,
    Slot,
    StoreUnavailable,
    budget_exceeded,
    rate_limited,
    too_many_streams,
)
from .redis import RedisStore
from .redis_limit_scripts import ADMIT, CHARGE, RECONCILE, RENEW

__all__ = ["RedisLimits"]

log = logging.getLogger("nexus.limits")

_CHARGE_MARK_MS = 900_000
"""How long a charge's marker outlives it: longer than its retries, short enough that the
markers of a busy gateway stay small (100 charges a second: ~90,000 keys). A charge
whose reply was lost just before an outage longer than this may count twice."""

_WARN_EVERY_S = 60.0

_RETRY_S = 0.25  # the first pause before a failed admission's slot goes again (then 2x)

_END_WAIT_S = 1.0
"""How long a stream's end waits for its charge to be in Redis, then for its slot to
leave, before its clients see it (then the charge is retried on the tick)."""


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
        self._held: dict[tuple[str, str], dict[str, Slot]] = {}
        """(slot kind, key name) -> slot id -> the slots held here: what the tick renews,
        those taken while Redis failed included."""
        self._failures = 0
        """How often Redis failed (or a slot was taken while it did): from then, Redis may
        lack the slots held here (a restart loses them; one taken meanwhile was never in)."""
        self._synced: dict[tuple[str, str], int] = {}
        """(slot kind, key name) -> the ``_failures`` as of which Redis has every slot of it
        held here; fewer than now: its next admission puts them back first (:meth:`_ahead`)."""
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
            for task in self._tasks:  # removals still retried: the leases end them
                task.cancel()
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
                freed = [cmd for at, ids in held.items() for cmd in self._freed(*at, *ids)]
                await self._send("release", freed)
        except TimeoutError:
            log.warning("per-key limits: Redis did not answer before the shutdown deadline")
        # What is still not charged is lost unless someone adds it: one line each, with a
        # command that adds it once, under its charge's own marker: one sent before Redis
        # stalled may still land when it resumes, and then the command adds nothing.
        charges = {**self._sending, **self._unsent}
        for charge_id, (name, win_id, usd, ttl, _) in charges.items():
            log.error(
                "spend not charged (Redis failed at shutdown): key %r, %s USD; add it once "
                "with: EVAL %s 2 %s %s %s %d",
                name,
                repr(usd),
                json.dumps(RECONCILE),
                self._key("spend", name, win_id),
                self._key("charged", charge_id),
                repr(usd),
                0 if ttl is None else round((time.time() + ttl) * 1000),
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

    def _freed(self, kind: str, name: str, *ids: str) -> list[tuple[Any, ...]]:
        """The commands that let slots ``ids`` (and their holds) of ``kind``, ``name`` go."""
        freed: list[tuple[Any, ...]] = [("ZREM", self._key("limits", kind, name), *ids)]
        if kind == STREAMS:
            freed.append(("HDEL", self._key("limits", "held", name), *ids))
        return freed

    def _admit(
        self,
        name: str,
        slot: Slot | None,
        *,
        limit: int | None,
        rate: float = 0.0,
        budget: float | None = None,
        hold: float = 0.0,
        win_id: str = "",
    ) -> tuple[Any, ...]:
        """The script's command: a token of ``rate``, ``budget`` checked with ``hold``
        held, ``slot`` taken (one of ``limit`` of its kind) as far as each is asked for."""
        return (
            "EVAL",
            ADMIT,
            4,
            self._key("limits", "rate", name),
            self._key("limits", STREAMS if slot is None else slot.kind, name),
            self._key("spend", name, win_id),
            self._key("limits", "held", name),
            repr(rate),
            repr(self.capacity),
            limit if slot is not None and limit is not None else 0,
            slot.id if slot is not None else "",
            self.lease_ms,
            repr(budget) if budget is not None else -1,
            repr(hold) if budget is not None else 0,
        )

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
        ahead, mark = self._ahead((STREAMS, name))
        try:
            *_, (code, value, *held) = await self.store.call(
                "admit",
                *ahead,
                self._admit(
                    name,
                    slot,
                    limit=self.per_key,
                    rate=per_second,
                    budget=budget,
                    hold=hold,
                    win_id=win_id,
                ),
            )
        except StoreUnavailable as exc:
            if budget is not None:
                self._failed()
                if slot is not None:  # the script may have run, its reply lost: give it back
                    self._release_later(slot, surely=True)
                raise StoreUnavailable(
                    f"The spend of the API key {name!r} cannot be checked: the store is "
                    "unavailable; retry shortly.",
                    headers={"Retry-After": "1"},
                ) from None
            self._warn(exc.__cause__ or exc)
            try:
                self.fallback.check(key, stream=stream, budget=False, rate=rate)
            except BaseException:
                if slot is not None:  # (as above: the script may have run)
                    self._release_later(slot, surely=True)
                raise
            if slot is not None:  # in Redis already if the script ran; else, once it is back
                self._hold(slot, mark, lost=True)
            return slot
        except asyncio.CancelledError:
            # The client left while the script was in flight: it may have run and taken
            # the slot, which nobody here holds or renews (it would stay for its lease).
            if slot is not None:
                self._release_later(slot, surely=True)
            raise
        if ahead:
            self._caught_up((STREAMS, name), mark)
        code = int(code)
        if code == 1:
            raise rate_limited(name, self.rate, int(value) / 1000)
        if code == 2:
            assert self.per_key is not None
            raise too_many_streams(name, self.per_key)
        if code == 3:
            raise budget_exceeded(key, float(value), time.time(), float(held[0]), hold)
        if slot is not None:
            self._hold(slot, mark)
        return slot

    async def enter(self, kind: str, name: str, limit: int) -> Slot | None:
        place = Slot(name, f"{self.store.replica_id}-{next(self._ids)}", kind=kind)
        ahead, mark = self._ahead((kind, name))
        try:
            *_, (code, *_) = await self.store.call(
                "admit", *ahead, self._admit(name, place, limit=limit)
            )
        except StoreUnavailable as exc:
            self._warn(exc.__cause__ or exc)
            if not self.fallback.hold(place, limit):
                self._release_later(place, surely=True)  # (as admit's: it may have run)
                return None
            self._hold(place, mark, lost=True)  # (as admit's: in Redis once it is back)
            return place
        except asyncio.CancelledError:
            self._release_later(place, surely=True)
            raise
        if ahead:
            self._caught_up((kind, name), mark)
        if int(code) != 0:
            return None
        self._hold(place, mark)
        self.fallback.hold(place, None)  # what this process holds, should Redis fail
        return place

    def _hold(self, slot: Slot, mark: int, *, lost: bool = False) -> None:
        """Hold ``slot`` here (renewed on the tick until it goes), taken by an admission
        built at ``mark`` (the ``_failures`` then); ``lost``: while Redis failed, so that
        Redis lacks it until it is put back."""
        at = (slot.kind, slot.key)
        held = self._held.get(at)
        if held is None:
            held = self._held[at] = {}
            self._synced[at] = mark
        held[slot.id] = slot
        if lost:  # (a renewal built before it does not carry it)
            self._failures += 1

    def _ahead(self, at: tuple[str, str]) -> tuple[list[tuple[Any, ...]], int]:
        """What to send before an admission of ``at`` (slot kind, key name), in its
        pipeline: the renewal of its slots held here if Redis may lack them, so that the
        admission counts them; and the ``_failures`` now, the mark of what it finds."""
        mark = self._failures
        held = self._held.get(at)
        if held is None or self._synced[at] >= mark:
            return [], mark
        return [self._lease(*at, held)], mark

    def _caught_up(self, at: tuple[str, str], mark: int) -> None:
        """Redis has the slots of ``at`` held here as of ``mark`` (sent as of then)."""
        if at in self._held and self._synced.get(at, -1) < mark:
            self._synced[at] = mark

    def _failed(self) -> None:
        """Redis failed: it may have lost the slots held here (each key's next admission
        puts its own back first)."""
        self._failures += 1

    def leave(self, place: Slot) -> None:
        self.fallback.leave(place)
        self.release(place)

    async def end(self, slot: Slot) -> None:
        if self._forget(slot):
            await asyncio.wait((self._release_later(slot),), timeout=_END_WAIT_S)

    def release(self, slot: Slot) -> None:
        if self._forget(slot):
            self._release_later(slot)

    def _forget(self, slot: Slot) -> bool:
        """Stop renewing ``slot``: True if it was held here (released once)."""
        at = (slot.kind, slot.key)
        held = self._held.get(at)
        if held is None or held.pop(slot.id, None) is None:
            return False
        if not held:
            del self._held[at]
            self._synced.pop(at, None)
        return True

    def _release_later(self, slot: Slot, *, surely: bool = False) -> asyncio.Task[bool]:
        """Remove a slot from Redis in the background; if that fails, its lease runs out.
        ``surely``: its admission failed and may yet run (a stalled Redis runs it as it
        resumes): tried again, backing off, until a removal lands within the lease (else
        retries through a stall fill the key's limit with phantom slots for a lease)."""
        freed = self._freed(slot.kind, slot.key, slot.id)
        sent = self._send_surely(freed) if surely else self._send("release", freed)
        task = asyncio.get_running_loop().create_task(sent)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _send_surely(self, freed: list[tuple[Any, ...]]) -> bool:
        loop = asyncio.get_running_loop()
        give_up = loop.time() + self.lease_ms / 1000
        pause = _RETRY_S
        while not await self._send("release", freed):
            if loop.time() + pause > give_up:
                return False  # (its lease has run out by then)
            await asyncio.sleep(pause)
            pause = min(pause * 2, 2.0)
        return True

    async def charge(self, key: ApiKey, usd: float, slot: Slot | None = None) -> None:
        now = time.time()
        win = window(key.budget_period, now)
        charge_id = f"{self.store.replica_id}-{next(self._ids)}"
        held = "" if slot is None else slot.id
        self._unsent[charge_id] = (key.name, win.id, usd, win.ttl_s(now), held)
        if slot is not None:
            slot.hold = 0.0
        flush = asyncio.get_running_loop().create_task(self._flush_charges())
        self._tasks.add(flush)
        flush.add_done_callback(self._tasks.discard)
        await asyncio.wait((flush,), timeout=_END_WAIT_S)
        if flush.done():
            flush.result()  # (what it raised, the hook's caller logs)

    async def _flush_charges(self, *, closing: bool = False) -> None:
        sending, self._unsent = self._unsent, {}
        commands = [
            (
                "EVAL",
                CHARGE,
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
        carries out after them); those Redis lacked are back."""
        mark, renewed = self._failures, list(self._held)
        leases = [self._lease(kind, name, slots) for (kind, name), slots in self._held.items()]
        if await self._send("renew", leases):
            for at in renewed:
                self._caught_up(at, mark)

    def _lease(self, kind: str, name: str, slots: dict[str, Slot]) -> tuple[Any, ...]:
        """The command that renews ``slots`` (of kind ``kind`` of key ``name``), each with
        its hold, putting back any Redis lacks (``RENEW``)."""
        return (
            "EVAL",
            RENEW,
            *(
                (2, self._key("limits", kind, name), self._key("limits", "held", name))
                if kind == STREAMS
                else (1, self._key("limits", kind, name))
            ),
            self.lease_ms,
            *itertools.chain.from_iterable((id, repr(slot.hold)) for id, slot in slots.items()),
        )

    def _warn(self, exc: BaseException) -> None:
        """Redis failed (:meth:`_failed`): a warning a minute at most."""
        self._failed()
        now = time.monotonic()
        if now - self._warned >= _WARN_EVERY_S:
            self._warned = now
            log.warning(
                "per-key limits: Redis failed (%s); rate and concurrency (streams, sockets, "
                "readers) are held per process until it is back",
                type(exc).__name__,
            )
