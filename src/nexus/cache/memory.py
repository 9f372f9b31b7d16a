"""The in-process store: the embedded default. One process; bounded by bytes, oldest out first.

Live logs stay with their :class:`~nexus.cache.run.StreamRun`; this store keeps finished
logs (the run's own list, not a copy) and recordings until their TTL, and drops the
oldest when the total passes ``max_bytes``. What one API key keeps is bounded too
(``max_bytes_per_key``): past it, that key's own oldest go first; and when the whole store
is full, the oldest of the key holding the most go, so that one tenant's streams push out
its own logs before another's (entries of no key, a gateway without keys, share the
whole store, oldest first). Expired entries are freed, not just hidden: a heap of expiry
times gives those due first, dropped (with expired claims and prepaid reads) on every put
and every :data:`SWEEP_INTERVAL_S` while started, at O(log n) per entry dropped. A heap
entry names its item by key and sequence number, so an item dropped early is not kept
alive by the heap.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from ..errors import StreamNotFound
from ..events import StreamEvent
from .codec import event_size
from .store import Recording, Store, StreamInfo

__all__ = ["SWEEP_INTERVAL_S", "MemoryStore"]

SWEEP_INTERVAL_S = 0.5
"""How often a started store frees what expired (at most this long after the expiry)."""


@dataclass(slots=True)
class _Item:
    value: tuple[StreamInfo, Sequence[StreamEvent]] | Recording
    expires_at: float
    size: int
    seq: int
    owner: str | None


@dataclass(slots=True)
class _Owned:
    """One API key's entries: their keys, oldest first, and their size."""

    keys: OrderedDict[str, None]
    size: int = 0


class MemoryStore(Store):
    def __init__(
        self, max_bytes: int = 256 * 1024 * 1024, *, max_bytes_per_key: int | None = None
    ) -> None:
        super().__init__()
        self.max_bytes = max_bytes
        self.max_bytes_per_key = max_bytes if max_bytes_per_key is None else max_bytes_per_key
        self.size = 0
        self._items: OrderedDict[str, _Item] = OrderedDict()
        self._owned: dict[str, _Owned] = {}
        self._expiry: list[tuple[float, int, str]] = []
        """(expires_at, seq, key) per put; stale once the key holds another item (or none)."""
        self._seq = itertools.count()
        self._claims: dict[str, tuple[str, float]] = {}
        self._claim_expiry: list[tuple[float, str, str]] = []
        """(expires_at, key, stream_id) per claim; stale once released or claimed again."""
        self._prepaid: dict[tuple[str, str], float] = {}
        """(stream id, key name) -> when its prepaid read lapses."""
        self._prepaid_expiry: list[tuple[float, str, str]] = []
        """(expires_at, stream_id, key) per prepaid read; stale once taken or paid again."""
        self._ticker: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        return len(self._items)

    async def start(self) -> None:
        """Start the tick that frees expired entries (see the module docstring)."""
        if self._ticker is None:
            self._ticker = asyncio.get_running_loop().create_task(self._tick())

    async def close(self) -> None:
        ticker, self._ticker = self._ticker, None
        if ticker is not None:
            ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await ticker

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_S)
            self.sweep()

    def sweep(self, now: float | None = None) -> None:
        """Drop every entry and claim expired as of ``now`` (default: the clock)."""
        if now is None:
            now = time.monotonic()
        expiry, items = self._expiry, self._items
        while expiry and expiry[0][0] <= now:
            _, seq, key = heapq.heappop(expiry)
            item = items.get(key)
            if item is not None and item.seq == seq:
                self._drop(key)
        claims, claim_expiry = self._claims, self._claim_expiry
        while claim_expiry and claim_expiry[0][0] <= now:
            expires_at, key, stream_id = heapq.heappop(claim_expiry)
            if claims.get(key) == (stream_id, expires_at):
                del claims[key]
        prepaid, prepaid_expiry = self._prepaid, self._prepaid_expiry
        while prepaid_expiry and prepaid_expiry[0][0] <= now:
            expires_at, stream_id, key = heapq.heappop(prepaid_expiry)
            if prepaid.get((stream_id, key)) == expires_at:
                del prepaid[(stream_id, key)]

    # Logs.
    async def end(
        self,
        info: StreamInfo,
        events: Sequence[StreamEvent],
        start: int,
        ttl_s: float,
        size: int | None = None,
    ) -> None:
        if size is None:
            size = sum(event_size(event) for event in events)
        self._put("log:" + info.id, (info, events), ttl_s, 256 + size, info.owner)

    async def info(self, stream_id: str) -> StreamInfo | None:
        item = self._get("log:" + stream_id)
        return None if item is None else item[0]  # type: ignore[index]

    async def read(self, stream_id: str, start: int = 0) -> AsyncIterator[list[StreamEvent]]:
        item = self._get("log:" + stream_id)
        if item is None:
            raise StreamNotFound(f"No stream {stream_id!r}: unknown, or expired.")
        events = item[1]  # type: ignore[index]
        if start < len(events):
            yield list(events[start:])

    # Prepaid reads.
    async def prepay_read(self, stream_id: str, key: str, ttl_s: float) -> None:
        expires_at = time.monotonic() + ttl_s
        self._prepaid[(stream_id, key)] = expires_at
        heapq.heappush(self._prepaid_expiry, (expires_at, stream_id, key))

    async def take_prepaid_read(self, stream_id: str, key: str) -> bool:
        expires_at = self._prepaid.pop((stream_id, key), None)  # (no await: one caller)
        return expires_at is not None and time.monotonic() < expires_at

    # Recordings.
    async def get_recording(self, key: str) -> Recording | None:
        item = self._get("rec:" + key)
        return item if isinstance(item, Recording) else None

    async def put_recording(
        self, key: str, recording: Recording, ttl_s: float, owner: str | None = None
    ) -> None:
        size = 256 + sum(event_size(event) + 8 for event in recording.events)
        self._put("rec:" + key, recording, ttl_s, size, owner)

    # In-flight claims.
    async def claim(self, key: str, stream_id: str, ttl_s: float) -> str | None:
        now = time.monotonic()
        held = self._claims.get(key)
        if held is not None and held[1] > now and held[0] != stream_id:
            return held[0]
        expires_at = now + ttl_s
        self._claims[key] = (stream_id, expires_at)
        heapq.heappush(self._claim_expiry, (expires_at, key, stream_id))
        if len(self._claim_expiry) > 2 * len(self._claims) + 64:
            # Released and renewed claims leave theirs behind: rebuild now and then.
            self._claim_expiry = [(at, k, s) for k, (s, at) in self._claims.items()]
            heapq.heapify(self._claim_expiry)
        return None

    async def release(self, key: str, stream_id: str) -> None:
        held = self._claims.get(key)
        if held is not None and held[0] == stream_id:
            del self._claims[key]

    # The bounded map.
    def _get(self, key: str) -> tuple[StreamInfo, Sequence[StreamEvent]] | Recording | None:
        item = self._items.get(key)
        if item is None:
            return None
        if item.expires_at <= time.monotonic():
            self._drop(key)
            return None
        return item.value

    def _put(
        self,
        key: str,
        value: tuple[StreamInfo, Sequence[StreamEvent]] | Recording,
        ttl_s: float,
        size: int,
        owner: str | None = None,
    ) -> None:
        now = time.monotonic()
        self.sweep(now)  # expired entries go first
        if key in self._items:
            self._drop(key)
        if size > (self.max_bytes if owner is None else self.max_bytes_per_key):
            return  # larger than what it may hold at all: not kept
        item = _Item(value, now + ttl_s, size, next(self._seq), owner)
        self._items[key] = item
        heapq.heappush(self._expiry, (item.expires_at, item.seq, key))
        self.size += size
        dropped = 0
        if owner is not None:
            mine = self._owned.setdefault(owner, _Owned(OrderedDict()))
            mine.keys[key] = None
            mine.size += size
            while mine.size > self.max_bytes_per_key:  # its own oldest, never another's
                self._drop(next(iter(mine.keys)))
                dropped += 1
        self._evicted("key_limit", dropped)
        dropped = 0
        while self.size > self.max_bytes:  # the oldest of the key that holds the most
            biggest = max(self._owned.values(), key=lambda owned: owned.size, default=None)
            self._drop(next(iter(biggest.keys if biggest is not None else self._items)))
            dropped += 1
        self._evicted("store_full", dropped)
        if len(self._expiry) > 2 * len(self._items) + 64:
            # Entries dropped or replaced leave theirs behind: rebuild now and then.
            self._expiry = [(i.expires_at, i.seq, k) for k, i in self._items.items()]
            heapq.heapify(self._expiry)

    def _drop(self, key: str) -> None:
        item = self._items.pop(key)
        self.size -= item.size
        if item.owner is not None:
            owned = self._owned[item.owner]
            del owned.keys[key]
            owned.size -= item.size
            if not owned.keys:
                del self._owned[item.owner]
