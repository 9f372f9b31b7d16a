"""The in-process store: the embedded default. One process; bounded by bytes, oldest out first.

Live logs stay with their :class:`~nexus.cache.run.StreamRun`; this store keeps
finished logs and recordings until their TTL, and drops the oldest entries
when the total passes ``max_bytes`` (expired ones first, found through a heap of
expiry times: a put costs O(log n), however many entries are kept). Nothing is
copied: a finished log is the run's own list.
"""

from __future__ import annotations

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

__all__ = ["MemoryStore"]


@dataclass(slots=True)
class _Item:
    value: tuple[StreamInfo, Sequence[StreamEvent]] | Recording
    expires_at: float
    size: int


class MemoryStore(Store):
    def __init__(self, max_bytes: int = 256 * 1024 * 1024) -> None:
        self.max_bytes = max_bytes
        self.size = 0
        self._items: OrderedDict[str, _Item] = OrderedDict()
        self._expiry: list[tuple[float, int, str, _Item]] = []
        """(expires_at, seq, key, item) per put; stale once the key holds another item."""
        self._seq = itertools.count()
        self._claims: dict[str, tuple[str, float]] = {}

    def __len__(self) -> int:
        return len(self._items)

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
        self._put("log:" + info.id, (info, events), ttl_s, 256 + size)

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

    # Recordings.
    async def get_recording(self, key: str) -> Recording | None:
        item = self._get("rec:" + key)
        return item if isinstance(item, Recording) else None

    async def put_recording(self, key: str, recording: Recording, ttl_s: float) -> None:
        size = 256 + sum(event_size(event) + 8 for event in recording.events)
        self._put("rec:" + key, recording, ttl_s, size)

    # In-flight claims.
    async def claim(self, key: str, stream_id: str, ttl_s: float) -> str | None:
        now = time.monotonic()
        held = self._claims.get(key)
        if held is not None and held[1] > now and held[0] != stream_id:
            return held[0]
        self._claims[key] = (stream_id, now + ttl_s)
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
    ) -> None:
        if key in self._items:
            self._drop(key)
        if size > self.max_bytes:
            return  # larger than the whole store: not kept
        item = _Item(value, time.monotonic() + ttl_s, size)
        self._items[key] = item
        heapq.heappush(self._expiry, (item.expires_at, next(self._seq), key, item))
        self.size += size
        if self.size > self.max_bytes:
            now = time.monotonic()
            expiry = self._expiry
            while expiry and expiry[0][0] <= now:
                _, _, old, stale = heapq.heappop(expiry)
                if self._items.get(old) is stale:
                    self._drop(old)
            while self.size > self.max_bytes:
                self._drop(next(iter(self._items)))
        if len(self._expiry) > 2 * len(self._items) + 64:
            # Entries dropped or replaced leave theirs behind: rebuild now and then.
            self._expiry = [(i.expires_at, next(self._seq), k, i) for k, i in self._items.items()]
            heapq.heapify(self._expiry)

    def _drop(self, key: str) -> None:
        item = self._items.pop(key)
        self.size -= item.size
