"""Reading a stream from its log: a local run's (:class:`RunReader`), a store's
(:class:`StoreReader`), and the helpers every reader's owner uses (:func:`leave`,
:func:`with_usage`). Both are :class:`~nexus.cache.run.LogReader`\\ s, iterated
asynchronously in batches.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import replace

from ..errors import GatewayError
from ..events import Done, Error, StreamEvent
from ..pricing import Spend
from ..types import StreamMeta
from .run import CLIENT_GONE, MAX_BATCH, LogReader, Push, StreamRun
from .store import Store, StreamInfo

__all__ = ["LEASE_S", "RunReader", "StoreReader", "forget_unseen", "leave", "with_usage"]


class RunReader:
    """Follows a local run's log from ``start``; attached until :meth:`close`.

    With a ``sink``, a reader waiting at the end of the log has each new batch pushed
    to it in the producer's task; its own task sleeps on (one task woken per upstream
    read, not two). A batch the sink leaves wakes the reader, which returns it; what
    the sink raised, the reader's next read raises."""

    __slots__ = ("_closed", "_error", "_index", "_run", "meta", "sink")

    cancel_safe = True  # a read waits on a future; cancelled, it leaves the log as it was

    def __init__(self, run: StreamRun, start: int = 0) -> None:
        self._run = run
        self._index = start
        self._closed = False
        self._error: Exception | None = None
        self.meta = run.info.meta
        self.sink: Push | None = None
        run._attach()

    @property
    def failure(self) -> GatewayError | None:
        return self._run.failure

    @property
    def attached(self) -> bool:
        """Not closed yet: it counts among its run's readers."""
        return not self._closed

    @property
    def spend(self) -> Spend | None:
        return self._run.spend

    @property
    def run(self) -> StreamRun:
        return self._run

    @property
    def served(self) -> StreamMeta:
        return self._run.info.meta

    async def settled_spend(self, wait_s: float) -> Spend | None:
        run = self._run
        if not run.finished and not run.attached and not run.info.resumable:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait_s):
                    await run.wait()
        return run.spend

    def __aiter__(self) -> RunReader:
        return self

    async def __anext__(self) -> list[StreamEvent]:
        run = self._run
        while True:
            if self._error is not None:
                error, self._error = self._error, None
                raise error
            events = run.events
            index = self._index
            if index < len(events):
                end = min(len(events), index + MAX_BATCH)
                self._index = end
                return events[index:end]
            if run.finished:
                raise StopAsyncIteration
            waiter = run._waiter(None if self.sink is None else self._push)
            try:
                await waiter
            except asyncio.CancelledError:
                run._drop(waiter)
                raise

    def _push(self, batch: list[StreamEvent]) -> bool:
        end = len(self._run.events)
        if self._index + len(batch) != end or self.sink is None:
            return False
        try:
            taken = self.sink(batch)
        except Exception as exc:
            self._index = end  # rendered: its failure is what the reader returns next
            self._error = exc
            return False
        if taken:
            self._index = end
        return taken

    async def close(self, failed: Error | None = None) -> None:
        self.sink = None  # its pump's or turn's bound method: they hold this reader
        if not self._closed:
            self._closed = True
            self._run._detach(failed)


LEASE_S = 2.0
"""A lease outlasts its last renewal by this (renewed every quarter of its TTL); a reader
that leaves leaves it this long at least (others following renew it sooner)."""


class StoreReader:
    """Follows a log kept in the store (finished, or live on another replica).

    While it reads, it renews a lease so the owning replica does not cancel the stream.
    As it leaves, the lease is set to lapse when the stream may end for its sake: at once
    (within ``LEASE_S / 2``) for a plain stream, ``detach_timeout_s`` later for a resumable
    one, the owner's wait for a client of its own (:mod:`nexus.cache.redis_holds`).
    """

    failure: GatewayError | None = None
    spend: Spend | None = None  # counted where the stream ran
    sink: Push | None = None  # not pushed: read in the reader's task
    cancel_safe = False  # a read cancelled inside the store's generator would end it

    def __init__(self, store: Store, info: StreamInfo, start: int, detach_timeout_s: float):
        self.meta = info.meta
        self._store = store
        self._id = info.id
        self._batches: AsyncIterator[list[StreamEvent]] = store.read(info.id, start)
        self._pending: list[StreamEvent] = []
        self._lease: asyncio.Task[None] | None = None
        self._detach_timeout_s = detach_timeout_s
        self._resumable = info.resumable
        if info.status == "in_progress" and store.shared:
            # Lapses detach_timeout_s (resumable) after this reader was last seen, however
            # it went (its replica may die): the owner stops paying soon after that.
            ttl = (detach_timeout_s if info.resumable else 0.0) + LEASE_S
            self._lease = asyncio.get_running_loop().create_task(self._renew(ttl))

    @property
    def served(self) -> StreamMeta:
        return self.meta

    async def settled_spend(self, wait_s: float) -> Spend | None:
        return None  # counted where the stream ran

    @property
    def run(self) -> None:
        return None  # it runs elsewhere

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

    async def _unlease(self) -> None:
        """Gone: the lease lapses when the stream may end for this reader's sake, not
        when its last renewal would have (up to ``LEASE_S`` late, or early)."""
        least = LEASE_S / 2  # longer than a renewal takes to come: others still reading
        resumable = max(self._detach_timeout_s, least)
        hold = resumable if self._resumable else least
        with contextlib.suppress(Exception):
            await self._store.unlease(self._id, hold, resumable)

    async def close(self, failed: Error | None = None) -> None:
        self.sink = None  # (never pushed to; but set, it is its pump's: a cycle if kept)
        lease, self._lease = self._lease, None
        if lease is not None:
            lease.cancel()
        try:
            closer = getattr(self._batches, "aclose", None)
            if closer is not None:
                with contextlib.suppress(Exception):
                    await closer()
        finally:
            if lease is not None:  # (also when cancelled meanwhile: once, not renewed)
                await self._unlease()


def with_usage(meta: StreamMeta, include_usage: bool, include_cost: bool = False) -> StreamMeta:
    """``meta`` for a listener whose request asked (or not) for usage (and its cost)."""
    if meta.include_usage == include_usage and meta.include_cost == include_cost:
        return meta
    return replace(meta, include_usage=include_usage, include_cost=include_cost)


def forget_unseen(reader: LogReader) -> None:
    """Its client left before its response's headers (which name the stream) went out:
    nobody can resume it, so its last local reader leaving ends it as a plain stream's
    does, not ``detach_timeout_s`` later (its upstream generating for nobody); unless its id
    went out (``info.named``: a 202, any reader's headers). Readers on other replicas still
    hold it (their leases are asked first)."""
    run = reader.run
    if run is not None and run.attached == 1 and run.info.resumable and not run.info.named:
        run.info.resumable = False


async def leave(reader: LogReader, run: StreamRun | None, *, aborted: bool = True) -> None:
    """A reader whose client never learnt the stream's id is done: close it and, when it
    ends early, end the stream with it, unless it is shared (``run`` None: joined; or
    joined by others who still read it): as ``aborted`` (the client asked: hooks hear
    ``stream_cancelled``), else as its client gone (``client_disconnect``, as when an
    HTTP stream's last reader leaves). Idempotent."""
    # Ended before the close, which would end it as its last reader gone, not aborted.
    end = Done(aborted=True) if aborted else CLIENT_GONE
    if run is None or run.info.resumable:  # (a joiner made it so: it waits for its readers)
        await reader.close()
        return
    if not run.finished and run.attached == 1 and isinstance(reader, RunReader) and reader.attached:
        run.cancel(end)
    await reader.close()
    if not run.finished and not run.attached:
        run.cancel(end)
