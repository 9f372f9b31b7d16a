"""Reading a stream from its log: a store's log (:class:`StoreReader`), and the
helpers every reader's owner uses (:func:`leave`, :func:`with_usage`).

A local run's log is read by :class:`~nexus.cache.run.RunReader`; both are
:class:`~nexus.cache.run.LogReader`\\ s, iterated asynchronously in batches.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import replace

from ..errors import GatewayError
from ..events import Done, StreamEvent
from ..pricing import Spend
from ..types import StreamMeta
from .run import MAX_BATCH, LogReader, Push, RunReader, StreamRun
from .store import Store, StreamInfo

__all__ = ["StoreReader", "leave", "with_usage"]


class StoreReader:
    """Follows a log kept in the store (finished, or live on another replica).

    While it reads, it renews a lease so the owning replica does not cancel the
    stream as detached (``detach_timeout_s``: the owner's wait for a resumable one).
    """

    failure: GatewayError | None = None
    spend: Spend | None = None  # counted where the stream ran
    sink: Push | None = None  # not pushed: read in the reader's task

    def __init__(self, store: Store, info: StreamInfo, start: int, detach_timeout_s: float):
        self.meta = info.meta
        self._store = store
        self._id = info.id
        self._batches: AsyncIterator[list[StreamEvent]] = store.read(info.id, start)
        self._pending: list[StreamEvent] = []
        self._lease: asyncio.Task[None] | None = None
        if info.status == "in_progress" and store.shared:
            # A stream that is not resumable is cancelled once the last lease lapses:
            # short, so that the owner stops paying soon after this reader leaves.
            ttl = max(detach_timeout_s * 2 if info.resumable else 0.0, 2.0)
            self._lease = asyncio.get_running_loop().create_task(self._renew(ttl))

    @property
    def served(self) -> StreamMeta:
        return self.meta

    async def settled_spend(self, wait_s: float) -> Spend | None:
        return None  # counted where the stream ran

    def __aiter__(self) -> StoreReader:
        return self

    async def __anext__(self) -> list[StreamEvent]:
        pending = self._pending
        if not pending:
            pending = await self._batches.__anext__()
            if len(pending) <= MAX_BATCH:
                return pending
        self._pending = pending[MAX_BATCH:]
        return pending[:MAX_BATCH]

    async def _renew(self, ttl: float) -> None:
        while True:
            with contextlib.suppress(Exception):
                await self._store.lease(self._id, ttl)
            await asyncio.sleep(ttl / 4)

    async def close(self) -> None:
        if self._lease is not None:
            self._lease.cancel()
            self._lease = None
        closer = getattr(self._batches, "aclose", None)
        if closer is not None:
            with contextlib.suppress(Exception):
                await closer()


def with_usage(meta: StreamMeta, include_usage: bool, include_cost: bool = False) -> StreamMeta:
    """``meta`` for a listener whose request asked (or not) for usage (and its cost)."""
    if meta.include_usage == include_usage and meta.include_cost == include_cost:
        return meta
    return replace(meta, include_usage=include_usage, include_cost=include_cost)


async def leave(reader: LogReader, run: StreamRun | None) -> None:
    """A reader whose client never learnt the stream's id is done: close it and, when it
    ends early (an abort, the client gone, a failure), end the stream with it, unless it
    is shared (``run`` None: joined; or joined by others who still read it).
    Idempotent."""
    # Cancelled before the close, which would otherwise end a stream that is not
    # resumable as ``client_disconnect``: this end is an abort.
    if (
        run is not None
        and not run.finished
        and run.attached == 1
        and isinstance(reader, RunReader)
        and reader.attached
    ):
        run.cancel(Done(aborted=True))
    await reader.close()
    if run is not None and not run.finished and not run.attached:
        run.cancel(Done(aborted=True))
