"""Per-key limits: request rate, concurrent streams, budget. One interface, two backends.

A request of an API key passes :meth:`KeyLimits.admit` before it opens anything:
its budget (``[[auth.keys]] budget_usd`` per ``budget_period``), one token of its
``requests_per_second_per_key`` bucket, and, for a request that runs a model, a
place among its ``max_concurrent_streams_per_key`` streams (a :class:`Slot`). A
request that ends charges its cost (:meth:`KeyLimits.charge`).

A budget holds because a request of a key with one is admitted only if its worst case
fits: the key's spend, plus what its running streams hold, plus this request's *hold*
(its prompt, estimated, and its output cap, at the dearest of its targets' prices) must
not pass the budget. The hold is taken with the slot and let go with it, after the
stream's real cost is charged: running streams can never spend together more than the
budget left when they started (the prompt estimate's error aside).

* :class:`LocalLimits` (``[store] kind = "memory"``): token buckets and spend in
  this process; the streams a key runs are the hub's own count of them. N
  processes admit N times the limits.
* :class:`~nexus.cache.redis_limits.RedisLimits` (``kind = "redis"``): every
  count is in Redis, checked and taken by one Lua script in one round trip, so
  replicas and workers together admit exactly the limits. See that module for
  slots, leases, and what a Redis failure does.

A key's places of other kinds, which hold no stream slot, are counted here too, each
kind on its own (:meth:`KeyLimits.enter`): its realtime sockets (``[realtime]
max_sockets_per_key``) and its HTTP readers (``[limits] max_readers_per_key``). They
are slots in a set of their own, with neither rate nor budget: per process with the
memory store, in Redis (shared, leased as stream slots are) with the Redis store.

The global ``[limits] max_concurrent_streams`` is not here: it protects one
process, and admission counts it (:mod:`nexus.cache.admission`).
"""

from __future__ import annotations

import itertools
import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable

from ..auth import ApiKey, RateLimiter
from ..budgets import budget_message, window
from ..errors import GatewayError, StoreUnavailable, TooManyStreams
from ..events import Error
from ..hooks import CallContext
from ..pricing import Spend
from ..types import Completion

__all__ = [
    "STREAMS",
    "BudgetExceeded",
    "BudgetPlugin",
    "KeyLimits",
    "LocalLimits",
    "Slot",
    "StoreUnavailable",
    "budget_exceeded",
    "over_budget",
    "rate_limited",
    "too_many_streams",
]


class BudgetExceeded(GatewayError):
    status = 429
    code = "budget_exceeded"
    error_type = "rate_limit_error"
    retryable = False


def rate_limited(name: str, rate: float, wait_s: float) -> GatewayError:
    return GatewayError(
        f"The API key {name!r} is over its limit of {rate:g} requests per second.",
        code="rate_limited",
        status=429,
        retryable=True,
        headers={"Retry-After": str(max(1, math.ceil(wait_s)))},
    )


def too_many_streams(name: str, per_key: int) -> TooManyStreams:
    return TooManyStreams(
        f"The API key {name!r} is at its limit of {per_key} concurrent streams "
        "([limits] max_concurrent_streams_per_key); retry when one ends.",
        headers={"Retry-After": "1"},
    )


def budget_exceeded(
    key: ApiKey, spent: float, now: float, held: float = 0.0, hold: float = 0.0
) -> BudgetExceeded:
    """The refusal of a key whose window's spend reached its budget, or whose budget left
    does not cover ``hold``, this request's worst case, beside ``held`` by its running
    streams. ``Retry-After``: 1 when the request fits once those end (they give back what
    they did not spend); none when it can never fit (more than the whole budget); else
    the window's reset, when it has one."""
    budget = key.budget_usd
    assert budget is not None
    win = window(key.budget_period, now)
    retry = win.retry_after_s(now)
    message = budget_message(key.name, budget, key.budget_period, spent, win)
    if spent < budget:
        message += (
            f" This request may cost up to ${hold:.6g} (its prompt and its output cap: "
            "max_tokens, else [limits] budget_max_output_tokens)"
        )
        if held > 0:
            message += f" and its running streams hold ${held:.6g}"
        message += "; lower max_tokens" + (", or retry when its streams end." if held else ".")
        if hold > budget:
            retry = None  # no window ever holds it: retrying cannot help
        elif held > 0 and spent + hold <= budget:
            retry = 1
    return BudgetExceeded(message, headers={} if retry is None else {"Retry-After": str(retry)})


def over_budget(key: ApiKey, spent: float, held: float, hold: float) -> bool:
    """Whether a request holding ``hold`` is refused (see the module docstring)."""
    assert key.budget_usd is not None
    return spent >= key.budget_usd or spent + held + hold > key.budget_usd


STREAMS = "streams"
"""The kind of a :class:`Slot` taken by :meth:`KeyLimits.admit`: a place among a key's
concurrent streams."""


class Slot:
    """A key's place among its concurrent streams (in a shared count) and its budget's
    ``hold`` (USD): held by the request that took it, then by the run it opened
    (``taken``), released when that ends. Or, of another ``kind``, a place among the
    key's sockets or readers (:meth:`KeyLimits.enter`): no hold, held until it leaves."""

    __slots__ = ("hold", "id", "key", "kind", "taken")

    def __init__(self, key: str, id: str, hold: float = 0.0, kind: str = STREAMS) -> None:
        self.key = key
        self.id = id
        self.hold = hold
        self.kind = kind
        self.taken = False


class KeyLimits(ABC):
    """Rates, concurrent streams and budgets of API keys. See the module docstring."""

    async def start(self) -> None:
        """Called when the app starts (after the store's start)."""

    async def close(self, *, deadline: float | None = None) -> None:
        """Called when the app stops (before the store's close); a shared backend waits
        on its store until ``deadline`` (event loop time) at most: shutdown is bounded."""

    @abstractmethod
    async def admit(
        self, key: ApiKey, *, stream: bool, rate: bool = True, hold: float = 0.0
    ) -> Slot | None:
        """One request of ``key``: a token of its rate (unless ``rate`` is False: taken
        before) and, with ``stream`` (a request that runs a model), its budget, with
        ``hold`` (its worst case, USD) held, and a place among its concurrent streams; the
        :class:`Slot` to :meth:`release` when the stream ends (None when there is nothing
        to release).

        Raises :class:`BudgetExceeded`, 429 ``rate_limited``, :class:`TooManyStreams`
        and (shared backend) :class:`StoreUnavailable`.
        """

    async def end(self, slot: Slot) -> None:
        """The stream that held ``slot`` is ending (its cost, if any, charged): a shared count
        lets the slot go now, before its client can see the end, so that the client's next
        request does not find it running. :meth:`release` follows, later, and is then a
        no-op. Here, nothing: a process's own count of streams follows its runs."""

    def release(self, slot: Slot) -> None:
        """The stream that held ``slot`` ended (called once it no longer counts here)."""

    @abstractmethod
    async def enter(self, kind: str, name: str, limit: int) -> Slot | None:
        """A place among key ``name``'s ``kind`` (``"sockets"``, ``"readers"``: not
        :data:`STREAMS`), of which it may hold ``limit``: the :class:`Slot` to
        :meth:`leave` when it is done, or None when the key holds ``limit`` already.
        Never raises for the store: a shared backend that fails counts in this process
        (and in the store once it is back)."""

    @abstractmethod
    def leave(self, place: Slot) -> None:
        """The holder of ``place`` (:meth:`enter`) is done (once or more: the first counts)."""

    @abstractmethod
    async def charge(self, key: ApiKey, usd: float, slot: Slot | None = None) -> None:
        """Add ``usd`` to the spend of ``key``'s current budget window; the stream's real
        cost replaces its ``slot``'s hold, in the same step (its end, then the client's
        next request, must not find both or neither)."""

    @abstractmethod
    async def spent(self, key: ApiKey) -> float:
        """The spend of ``key``'s current budget window."""


class LocalLimits(KeyLimits):
    """This process's limits: token buckets, the hub's count of each key's streams
    (``running``), spend per key in memory (the current window only)."""

    def __init__(
        self, rate: float, per_key: int | None, running: Callable[[str], int] | None = None
    ) -> None:
        self.rate = rate
        self.per_key = per_key
        self._buckets = RateLimiter(rate)
        self._running = running
        self._spend: dict[str, tuple[str, float]] = {}
        """Key name -> (window id, spend): a new window replaces the old one."""
        self._held: dict[str, float] = {}
        """Key name -> the holds of its running streams (USD)."""
        self._ids = itertools.count()
        self._places: dict[tuple[str, str], set[str]] = {}
        """(kind, key name) -> the ids of the places held (:meth:`enter`)."""

    async def admit(
        self, key: ApiKey, *, stream: bool, rate: bool = True, hold: float = 0.0
    ) -> Slot | None:
        self.check(key, stream=stream, rate=rate, hold=hold)
        if not (stream and hold > 0 and key.budget_usd is not None):
            return None
        self._held[key.name] = self._held.get(key.name, 0.0) + hold
        return Slot(key.name, str(next(self._ids)), hold)

    def release(self, slot: Slot) -> None:
        left = self._held.get(slot.key, 0.0) - slot.hold
        if left > 1e-12:
            self._held[slot.key] = left
        else:
            self._held.pop(slot.key, None)

    async def enter(self, kind: str, name: str, limit: int) -> Slot | None:
        place = Slot(name, str(next(self._ids)), kind=kind)
        return place if self.hold(place, limit) else None

    def hold(self, place: Slot, limit: int | None) -> bool:
        """Count ``place`` among its key's places of its kind here, unless ``limit`` of them
        are held (None: no limit, it is counted elsewhere)."""
        held = self._places.setdefault((place.kind, place.key), set())
        if limit is not None and len(held) >= limit:
            return False
        held.add(place.id)
        return True

    def leave(self, place: Slot) -> None:
        held = self._places.get((place.kind, place.key))
        if held is not None:
            held.discard(place.id)
            if not held:
                del self._places[place.kind, place.key]

    def held(self, kind: str, name: str) -> int:
        """How many places of ``kind`` key ``name`` holds in this process."""
        return len(self._places.get((kind, name), ()))

    def check(
        self,
        key: ApiKey,
        *,
        stream: bool,
        budget: bool = True,
        rate: bool = True,
        hold: float = 0.0,
    ) -> None:
        """:meth:`admit`, without a wait or a hold taken: what it raises, or nothing."""
        if budget and stream and key.budget_usd is not None:
            now = time.time()
            spent = self._current(key, now)
            held = self._held.get(key.name, 0.0)
            if over_budget(key, spent, held, hold):
                raise budget_exceeded(key, spent, now, held, hold)
        wait = self._buckets.acquire(key.name, time.monotonic()) if rate else 0
        if wait > 0:
            raise rate_limited(key.name, self.rate, wait)
        per_key = self.per_key
        running = self._running
        if stream and per_key is not None and running is not None and running(key.name) >= per_key:
            raise too_many_streams(key.name, per_key)

    def _current(self, key: ApiKey, now: float) -> float:
        held = self._spend.get(key.name)
        if held is None or held[0] != window(key.budget_period, now).id:
            return 0.0
        return held[1]

    async def charge(self, key: ApiKey, usd: float, slot: Slot | None = None) -> None:
        now = time.time()
        self._spend[key.name] = (window(key.budget_period, now).id, self._current(key, now) + usd)
        if slot is not None:
            self.release(slot)
            slot.hold = 0.0

    async def spent(self, key: ApiKey) -> float:
        return self._current(key, time.time())


class BudgetPlugin:
    """Charges each stream's cost to its key when it ends (completed, failed, cancelled):
    an internal hook plugin, registered by the app when it has keys. Every key's spend is
    kept (``nexus keys`` shows it), per its ``budget_period`` (``month`` unless set).

    A stream's end hooks run before its last entry reaches the readers, so a client
    that saw the end of one request is refused its next one if that one spent the
    budget. A request that joined another's stream fires no end hook (it costs
    nothing), nor does a cache replay (its ``Spend`` has no cost: nothing was billed).
    """

    wants_final = False  # the spend is all it reads: streams need not be merged for it

    def __init__(
        self,
        limits: KeyLimits,
        keys: list[ApiKey],
        slot_of: Callable[[str], Slot | None] = lambda run_id: None,
    ) -> None:
        self.limits = limits
        self.keys = {key.name: key for key in keys}
        self.slot_of = slot_of
        """The slot a run holds, by its id: its hold goes when its cost is charged."""

    async def on_stream_completed(
        self,
        ctx: CallContext,
        request_id: str,
        model: str,
        provider: str,
        elapsed: float,
        final: Completion,
        *,
        spend: Spend,
    ) -> None:
        await self._charge(ctx, request_id, spend)

    async def on_stream_failed(
        self, ctx: CallContext, request_id: str, model: str, error: Error, *, spend: Spend
    ) -> None:
        await self._charge(ctx, request_id, spend)

    async def _charge(self, ctx: CallContext, run_id: str, spend: Spend) -> None:
        """Add the stream's cost (estimated or not; none when it has no price) in place
        of its hold."""
        key = None if ctx.key is None else self.keys.get(ctx.key)
        if key is None:
            return
        cost = spend.cost_usd or 0.0
        slot = self.slot_of(run_id)
        if slot is not None and (slot.key != key.name or not slot.hold):
            slot = None
        if cost > 0 or slot is not None:
            await self.limits.charge(key, cost, slot)
