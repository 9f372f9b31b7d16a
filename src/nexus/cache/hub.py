"""The stream hub: every stream the gateway serves, streaming or not, is opened,
found and ended here; the jobs around it have modules of their own.

:meth:`StreamHub.open` turns a request into a stream resource:

1. With ``[cache] enabled``, a recording of the same request by the same owner replays
   as a new stream (``cache="hit"``; :mod:`nexus.cache.recording`).
2. An identical request of the same owner still streaming, here or on a replica sharing
   the store, is joined: one upstream call, many listeners (``"hit"``). One that just
   ended here is waited for, a round trip, to be recorded and replayed; one that ended
   elsewhere and is not recorded yet is joined (its log is whole).
3. Otherwise the engine's stream, through its middleware, starts in a :class:`StreamRun`
   (:mod:`nexus.cache.run`; ``"miss"``, or None with the cache off), which
   :mod:`nexus.cache.keeper` keeps in the store and records.

Every request first passes admission (:mod:`nexus.cache.admission`) and
``on_stream_started``; the other hooks watch a run's source. :meth:`StreamHub.attach`
finds a stream by id: a local run, else the store (:mod:`nexus.cache.readers`). A stream
the store cannot begin gets 503 ``store_unavailable``, unless ``[store] required =
false``: it then runs here alone (:attr:`Opened.stored` False), not cached, not joined,
its keeper mirroring it once the store is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

from ..auth import ApiKey
from ..config import CacheConfig, StreamsConfig
from ..engine import Engine
from ..errors import ServerShuttingDown, StoreUnavailable, StreamNotFound
from ..events import StreamEvent
from ..hooks import CallContext
from ..request import ChatRequest
from ..stream import Stream
from ..types import StreamMeta
from ..watchdog import Watchdog
from .admission import Admission
from .keeper import RECORDING_WAIT_S, Keeper, status_of
from .limits import KeyLimits
from .readers import LEASE_S, RunReader, StoreReader
from .recording import cache_key, replay
from .run import StreamRun
from .store import Store, StreamInfo

__all__ = ["Opened", "StreamHub"]

log = logging.getLogger("nexus.streams")


@dataclass(slots=True)
class Opened:
    """A stream resource, ready to attach to. ``run`` is None when it lives elsewhere."""

    info: StreamInfo
    run: StreamRun | None
    cache: str | None = None
    joined: bool = False
    """It is another request's stream: leaving it must never end it."""
    stored: bool = True
    """False: the store could not be reached when it started (``[store] required =
    false``): it runs on this replica only, not cached, not joined."""
    reader: RunReader | None = None
    """A joined local stream's reader, taken as it was joined, before any wait: its
    other readers leaving meanwhile must not end it as one nobody reads (:meth:`reader_of`)."""

    @property
    def id(self) -> str:
        return self.info.id


class StreamHub:
    """Opens, finds and ends stream resources. One per app; see the module docstring."""

    def __init__(
        self,
        engine: Engine,
        store: Store,
        *,
        streams: StreamsConfig | None = None,
        cache: CacheConfig | None = None,
        max_duration_s: float | None = None,
        store_required: bool = True,
    ) -> None:
        self.engine = engine
        self.store = store
        self.streams = streams or StreamsConfig()
        self.cache = cache or CacheConfig()
        self.max_duration_s = max_duration_s
        self.store_required = store_required
        """False: a stream the store cannot begin runs here alone (see the module docstring)."""
        self.live: dict[str, StreamRun] = {}  # the runs that count as running here
        self._unkept: dict[str, StreamRun] = {}  # ended, the store down: read here meanwhile
        self.admission = Admission()
        self.keeper = Keeper(store, self.streams, self.cache, self._gone, self._released)
        self.on_live: Callable[[int], None] | None = None
        """Told how many streams run here whenever that changes (metrics, several workers)."""
        self.watchdog = Watchdog()
        """Ends the streams that pass ``max_duration_s``: one ticker, not a timer each."""
        self._unstored_warned = 0.0
        self._closed_with: StreamEvent | None = None
        store.live_entries = self._entries  # what replicas asking learn (a shared store)
        store.on_lost = self.keeper.renew_soon

    @property
    def limits(self) -> KeyLimits:
        """Per-key rates, streams and budgets (the app sets the configured ones)."""
        return self.admission.limits

    @limits.setter
    def limits(self, limits: KeyLimits) -> None:
        self.admission.limits = limits

    @property
    def on_mirror(self) -> Callable[[str], None] | None:
        """Told how streams' mirrors into a shared store fare (:mod:`nexus.cache.keeper`)."""
        return self.keeper.on_mirror

    @on_mirror.setter
    def on_mirror(self, tell: Callable[[str], None] | None) -> None:
        self.keeper.on_mirror = tell

    def running(self, owner: str | None = None) -> int:
        """:meth:`Admission.running <nexus.cache.admission.Admission.running>`."""
        return self.admission.running(owner)

    def admit(
        self, key: ApiKey | None, limit: int, *, rate_taken: bool = False, hold: float = 0.0
    ) -> contextlib.AbstractAsyncContextManager[None]:
        """:meth:`Admission.admit <nexus.cache.admission.Admission.admit>`."""
        return self.admission.admit(key, limit, rate_taken=rate_taken, hold=hold)

    async def open(
        self,
        request: ChatRequest,
        *,
        format: str,
        owner: str | None = None,
        background: bool = False,
        resumable: bool = False,
        ctx: CallContext | None = None,
        private: bool = False,
    ) -> Opened:
        """A stream for ``request``: replayed, joined or new (see the module docstring).

        ``private``: nobody else learns its id (a JSON answer): with the cache off it needs
        no store, so one that cannot be reached runs it here alone even when ``[store]
        required``.

        ``resumable``: it outlives its clients for ``[streams] detach_timeout_s`` (a
        ``background`` stream always does); otherwise the last reader to leave cancels it
        (:mod:`nexus.cache.run`). A resumable request that joins a stream of its key makes
        that stream resumable, on whichever replica it runs; one of another key
        (``share_across_keys``) only when ``background``, whose read token finds it.

        ``ctx`` is what the middleware and the hooks see of the call (by default one with
        ``key=owner`` and ``format``). Raises what :meth:`Engine.open_stream` raises for a
        request that cannot be routed or is refused, :class:`~nexus.errors.StoreUnavailable`,
        and :class:`~nexus.errors.ServerShuttingDown` once :meth:`shutdown` began."""
        if self._closed_with is not None:
            raise ServerShuttingDown("The server is shutting down; retry the request.")
        if ctx is None:
            ctx = CallContext(key=owner, format=format)
        resumable = background or resumable
        if not self.cache.enabled:
            stream = await self._open(request, ctx)
            return await self._launch(
                stream, format, owner, background, resumable, ctx, private=private
            )
        key = cache_key(request, owner, shared=self.cache.share_across_keys)
        try:
            recording = await self.store.get_recording(key)
            if recording is None and await self.keeper.recorded(key, RECORDING_WAIT_S):
                recording = await self.store.get_recording(key)  # it just ended here
        except StoreUnavailable:
            if self.store_required:
                raise
            stream = await self._open(request, ctx)
            info = StreamInfo(stream.meta, format, owner, resumable=resumable)
            return self._unstored(info, stream, background, ctx)
        if recording is not None:
            self.engine.route(request.model)  # the model must still exist
            meta = StreamMeta.new(
                request.model,
                include_usage=request.include_usage or request.include_cost,  # (as a miss's)
                include_cost=request.include_cost,
                provider=recording.provider,
                upstream_model=recording.upstream_model,
                retry_ms=self.engine.retry_ms,
                echo=request.responses_echo,
            )
            source = Stream.of_batches(replay(recording, self.cache), meta)
            await self.engine.hooks.started(source, ctx)
            return await self._launch(
                source, format, owner, background, resumable, ctx, replayed=True
            )
        stream = await self._open(request, ctx)
        info = StreamInfo(stream.meta, format, owner, resumable=resumable)
        return await self._claim(key, stream, info, background, ctx)

    async def _claim(
        self, key: str, stream: Stream, info: StreamInfo, background: bool, ctx: CallContext
    ) -> Opened:
        """Run ``stream`` to be recorded under ``key``, or join the identical stream
        that holds the key's claim (``stream`` is then closed unread)."""
        store = self.store
        ttl = self.streams.resume_ttl_s
        # A claim outlives the longest stream (lapsed, an identical request went upstream).
        lasts = ttl + (self.max_duration_s or 0.0)
        handed = False  # until then, a failure of the store closes the upstream stream
        begun = False
        try:
            if store.shared:
                # Visible to every replica before anyone can be told its id (a 202, a claim).
                await store.begin(info, ttl)
                begun = True
            holder = await store.claim(key, info.id, lasts)
            # A claim ends with its stream; one left by a replica that died is taken over.
            for attempt in range(3):
                if attempt:
                    holder = await store.claim(key, info.id, lasts)
                if holder is None:
                    handed = True
                    run = self._start(info, stream, ctx, record=key, detached=background)
                    return Opened(info, run, "miss")
                joined = await self._joinable(holder)  # (no wait for a local stream)
                if joined is not None:
                    joined = await self._joined_as(joined, info, lasts, background)
                if joined is not None:
                    handed = True
                    local = self.local(holder)
                    reader = None if local is None else local.reader()
                    try:
                        await stream.close()
                        if store.shared:
                            await store.end(replace(info, status="cancelled"), [], 0, 1.0)
                    except BaseException:
                        if reader is not None:
                            await reader.close()
                        raise
                    return Opened(joined, local, "hit", joined=True, reader=reader)
                await store.release(key, holder)  # its stream is over, or its replica died
        except BaseException as exc:
            unstored = isinstance(exc, StoreUnavailable) and not (self.store_required or handed)
            if isinstance(exc, StoreUnavailable) and not handed and store.shared:
                self.keeper.never_started(info, key, runs=unstored)  # (the store may yet run)
            if unstored:
                return self._unstored(info, stream, background, ctx)  # (a claim, a join, ...)
            if not handed:
                await stream.close()
                await self.engine.hooks.given_up(ctx, stream.meta, exc)
                if begun and not isinstance(exc, StoreUnavailable):
                    with contextlib.suppress(Exception):  # its live entry ends with it
                        await store.end(replace(info, status="failed"), [], 0, 1.0)
            raise
        run = self._start(info, stream, ctx, detached=background)  # contended: not recorded
        return Opened(info, run, "miss")

    async def _joined_as(
        self, joined: StreamInfo, info: StreamInfo, lasts: float, background: bool
    ) -> StreamInfo | None:
        """What a request (``info``) that joins ``joined`` is told of it. A resumable one
        makes it resumable, here or through the store (None: its replica is cancelling it
        for want of clients, and it must not be joined); another holds it elsewhere."""
        local = self.local(joined.id)
        other = joined.owner != info.owner and not background  # [cache] share_across_keys
        if not info.resumable or other:  # (another key's: never resumed by this client)
            elsewhere = local is None and joined.status == "in_progress" and self.store.shared
            if elsewhere and not await self.store.hold_for_join(joined.id, LEASE_S):
                return None
            return replace(joined, resumable=False) if other else joined
        if local is not None:
            local.info.resumable = True  # this client may leave and come back
            return local.info
        if joined.status != "in_progress":
            return replace(joined, resumable=True)  # ended: its log waits resume_ttl_s
        # Held as by a client that left just now: resumable for detach_timeout_s from here.
        if not await self.store.make_resumable(joined.id, lasts, self.streams.detach_timeout_s):
            return None
        return replace(joined, resumable=True)

    async def _open(self, request: ChatRequest, ctx: CallContext) -> Stream:
        """The engine's stream through its middleware, past ``on_stream_started``."""
        stream = await self.engine.open_stream(request, ctx, observe=False)
        await self.engine.hooks.started(stream, ctx)
        return stream

    async def _joinable(self, stream_id: str) -> StreamInfo | None:
        """The info of the stream holding a claim, if a request may join it: one still
        running, or one that ended well and whose recording is not written yet (its
        whole log is here, or in the store: joined, it is read from its start)."""
        run = self.local(stream_id)
        if run is not None:
            if not run.ending or (run.finished and status_of(run.events[-1]) == "completed"):
                return run.info
            return None
        info = await self.store.info(stream_id)
        if info is None or info.status not in ("in_progress", "completed"):
            return None
        if info.status == "completed":
            return info
        return info if await self.store.alive(stream_id) else None

    async def _launch(
        self,
        source: Stream,
        format: str,
        owner: str | None,
        background: bool,
        resumable: bool,
        ctx: CallContext,
        *,
        replayed: bool = False,
        private: bool = False,
    ) -> Opened:
        """Begin ``source`` in a shared store, then run it (not recorded)."""
        info = StreamInfo(source.meta, format, owner, resumable=resumable)
        if self.store.shared:
            try:
                await self.store.begin(info, self.streams.resume_ttl_s)
            except StoreUnavailable:
                if self.store_required and not private:
                    await source.close()  # the store cannot be reached: nothing may run unseen
                    raise
                return self._unstored(info, source, background, ctx, replayed=replayed)
            except BaseException:
                await source.close()
                raise
        run = self._start(info, source, ctx, detached=background, replayed=replayed)
        return Opened(info, run, "hit" if replayed else None)

    def _unstored(
        self,
        info: StreamInfo,
        stream: Stream,
        background: bool,
        ctx: CallContext,
        *,
        replayed: bool = False,
    ) -> Opened:
        """Run ``stream`` here alone: the store could not be reached and is not required.
        A warning at most every 10 s, however many requests the outage meets."""
        now = asyncio.get_running_loop().time()
        if now - self._unstored_warned >= 10.0:
            self._unstored_warned = now
            log.warning(
                "the stream store cannot be reached: new streams run on this replica only "
                "([store] required = false), not cached, not joined, resumable elsewhere "
                "once the store is back"
            )
        run = self._start(info, stream, ctx, detached=background, replayed=replayed, stored=False)
        return Opened(info, run, "hit" if replayed else None, stored=False)

    def _start(
        self,
        info: StreamInfo,
        source: Stream,
        ctx: CallContext,
        record: str | None = None,
        *,
        detached: bool = False,
        replayed: bool = False,
        stored: bool = True,
    ) -> StreamRun:
        """Run it, watched by the hooks (``store.begin`` done, unless not ``stored``);
        the keeper looks after its log."""
        run = StreamRun(
            info,
            source,
            detach_timeout_s=self.streams.detach_timeout_s,
            max_log_bytes=self.streams.max_log_bytes,
            held=partial(self.store.held, info.id) if self.store.shared else None,
            max_duration_s=self.max_duration_s,
            observer=self.engine.hooks.observe(ctx, info.meta),
            timed=record is not None,
            watchdog=self.watchdog,
            prices=self.engine.prices,
            replayed=replayed,
        )
        self.live[run.id] = run
        self.admission.started(run.id, info.owner)
        run.on_end = self._ending
        if self.on_live is not None:
            self.on_live(len(self.live))
        run.start(detached=detached)
        self.keeper.keep(run, record, stored)
        if self._closed_with is not None:  # opened while the hub shut down: ended too
            run.cancel(self._closed_with)
        return run

    async def _ending(self, run: StreamRun) -> None:
        """``run`` ends: it stops counting as running, and its key's slot leaves a shared
        count, before the end is in its log (not once the log is kept: a store that is
        down is retried for seconds, and a key at its limit would be refused meanwhile)."""
        await self.admission.ending(run.id)

    def _released(self, run: StreamRun) -> None:
        """``run`` ended, its end not in the store yet: not running, still read here."""
        if self.live.get(run.id) is run:
            self._unkept[run.id] = run
            self._not_running(run)

    def _gone(self, run: StreamRun) -> None:
        """``run``'s log is kept (or given up): it is no longer found here."""
        if self._unkept.get(run.id) is run:
            del self._unkept[run.id]
        self._not_running(run)

    def _not_running(self, run: StreamRun) -> None:
        if self.live.pop(run.id, None) is not None:
            self.admission.ended(run.id)
            if self.on_live is not None:
                self.on_live(len(self.live))

    def local(self, stream_id: str) -> StreamRun | None:
        """The run of ``stream_id`` here: running, or ended and not yet in the store."""
        return self.live.get(stream_id) or self._unkept.get(stream_id)

    async def attach(
        self, stream_id: str, start: int = 0, *, meta: StreamMeta | None = None
    ) -> RunReader | StoreReader:
        """A reader of the stream's log from entry ``start``. Raises :class:`StreamNotFound`."""
        run = self.local(stream_id)
        reader: RunReader | StoreReader
        if run is not None:
            reader = run.reader(start)
        else:
            info = await self.info(stream_id)
            if info is None:
                raise StreamNotFound(f"No stream {stream_id!r}: unknown, or expired.")
            reader = StoreReader(self.store, info, start, self.streams.detach_timeout_s)
        if meta is not None:
            reader.meta = meta
        return reader

    async def reader_of(
        self, opened: Opened, *, meta: StreamMeta | None = None
    ) -> RunReader | StoreReader:
        """A reader of ``opened`` from its start: the one taken as it was joined, or new."""
        reader, opened.reader = opened.reader, None
        if reader is None:
            return await self.attach(opened.id, meta=meta)
        if meta is not None:
            reader.meta = meta
        return reader

    async def reached(self, info: StreamInfo, entries: int) -> bool:
        """Whether the stream has logged ``entries`` entries so far: here, or on the replica
        running it, whose copy in the store may trail what it sent (:meth:`Store.reached
        <nexus.cache.store.Store.reached>`). A finished stream has logged all it will.
        Raises :class:`~nexus.errors.StoreUnavailable` when it cannot be told."""
        run = self.local(info.id)
        if run is not None:
            return entries <= len(run.events)
        if entries <= 0 or info.status != "in_progress":
            return True
        return await self.store.reached(info.id, entries)

    def _entries(self, stream_id: str) -> int | None:
        run = self.local(stream_id)
        return None if run is None else len(run.events)

    async def info(self, stream_id: str) -> StreamInfo | None:
        run = self.local(stream_id)
        if run is not None:
            return run.info
        return await self.store.info(stream_id)

    async def shutdown(self, terminal: StreamEvent, timeout_s: float = 10.0) -> None:
        """Cancel every live stream with ``terminal``; wait until their logs are kept
        (keepers retrying a store that is down make one last try), ``timeout_s`` at most."""
        self.keeper.closing.set()
        self._closed_with = terminal  # (and so is any run a request still opens)
        for run in list(self.live.values()):
            run.cancel(terminal)
        await self.drain(timeout_s)

    async def drain(self, timeout_s: float = 10.0) -> None:
        """Until every run's keeper is done (logs handed to the store); at most ``timeout_s``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        tasks = self.keeper.tasks
        # A run leaves ``live`` once its log is kept: by its keeper, or by the task its
        # end starts (between the two, neither is there to wait for: a turn of the loop).
        while (tasks or self.live) and loop.time() < deadline:
            pending = [*tasks, *(run.done for run in self.live.values())]
            pending = [p for p in pending if not p.done()]
            if pending:
                await asyncio.wait(pending, timeout=deadline - loop.time())
            else:
                await asyncio.sleep(0)
        if tasks or self.live:
            left = max(len(tasks), len(self.live))
            log.warning("%d streams did not finish closing in %.1fs", left, timeout_s)
