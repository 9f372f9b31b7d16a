"""The in-process store: the embedded default. One process; bounded by bytes, oldest out first.

Live logs stay with their :class:`~nexus.cache.run.StreamRun`; this store keeps
finished logs and recordings until their TTL, and drops the oldest entries
when the total passes ``max_bytes``. Nothing is copied: a finished log is the
run's own list.
"""

from __future__ import annotations

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
        self._items[key] = _Item(value, time.monotonic() + ttl_s, size)
        self.size += size
        if self.size > self.max_bytes:
            now = time.monotonic()
            for old in [k for k, item in self._items.items() if item.expires_at <= now]:
                self._drop(old)
            while self.size > self.max_bytes:
                self._drop(next(iter(self._items)))

    def _drop(self, key: str) -> None:
        item = self._items.pop(key)
        self.size -= item.size
