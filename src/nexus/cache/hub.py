"""The stream hub: every stream the gateway serves is opened, found and ended here.

:meth:`StreamHub.open` turns a request into a stream resource:

1. With ``[cache] enabled``, a recording of the same canonical request
   (:func:`cache_key`: model, messages, parameters; not the wire format, not the
   stream options) made by the same owner replays as a new stream
   (``cache="hit"``), burst, paced or fast-forwarded.
2. An identical request of the same owner still streaming (here, or on a
   replica sharing the store) is joined: one upstream call, many listeners
   (``cache="hit"``).

The owner is the API key's name (``anonymous`` without keys): a key never gets
another key's recording, usage included, nor joins its stream, unless
``[cache] share_across_keys`` says the keys share one cache.
3. Otherwise the engine's stream starts in a :class:`StreamRun`
   (``cache="miss"``, or None with the cache off); if it ends well, it is
   recorded.

Engine streams are opened through the engine's middleware
(:meth:`Engine.open_stream`); every request, whichever of the three, first
passes the plugins' ``on_stream_started`` (a :class:`~nexus.hooks.StreamRejected`
refuses it before anything starts). A run fires the other hooks of its stream
(:mod:`nexus.hooks`); a joining request makes no stream, so it gets no more.

:meth:`StreamHub.attach` finds a stream by id: a local run, else the store
(a replica's live log, or a finished one within ``resume_ttl_s``). Each run has
a keeper task that mirrors its log into a shared store as it grows and, when
it ends, hands the log to the store, records it and releases its claim.

The store may fail (Redis restarted or unreachable). A running stream does not
notice: its producer never awaits the store, so its clients read on to the end.
What lapses is its mirror, hence resuming it elsewhere: the keeper warns once
for the stream, tells :attr:`StreamHub.on_mirror` (``behind``), and retries
from the last entry it mirrored at the stream's next growth, at most every
second or so (:mod:`nexus.cache.mirror`); a log the store lost meanwhile is
begun again and written from entry 0 (``caught_up``). Its end is retried the
same way for up to ``resume_ttl_s``, then given up (``abandoned``: a reader
elsewhere gets an error, not a hole; see :mod:`nexus.cache.redis`). A new
request whose stream cannot be begun in the store gets 503 ``store_unavailable``,
unless ``[store] required = false``: it then runs on this replica alone
(:attr:`Opened.stored` False), not cached and not joined, its keeper catching its
mirror up from entry 0 once the store is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import hashlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, replace
from typing import Any

import orjson

from ..auth import ApiKey
from ..config import CacheConfig, StreamsConfig
from ..engine import Engine
from ..errors import GatewayError, StoreUnavailable, StreamNotFound, TooManyStreams
from ..events import Done, Error, StreamEvent, Usage
from ..hooks import CallContext
from ..pricing import Spend
from ..request import ChatRequest
from ..stream import Stream
from ..types import StreamMeta
from ..watchdog import Watchdog
from .codec import event_size
from .limits import KeyLimits, LocalLimits, Slot
from .mirror import Mirror
from .run import MAX_BATCH, LogReader, RunReader, StreamRun
from .store import Recording, Status, Store, StreamInfo

__all__ = ["ANONYMOUS", "SHARED", "Opened", "StoreReader", "StreamHub", "cache_key", "leave"]

log = logging.getLogger("nexus.streams")

_NOT_IN_KEY = {"stream", "stream_options", "background"}
_CANCELLED = ("stream_detached", "stream_cancelled", "client_disconnect")
"""Error codes of a stream ended on purpose (its status is ``cancelled``, not ``failed``)."""

ANONYMOUS = "anonymous"
"""Whose cache a request without an API key (auth off) uses."""
SHARED = "*"
"""The one cache every key uses with ``[cache] share_across_keys`` (never a key's name)."""


_ADMITTED: contextvars.ContextVar[Slot | None] = contextvars.ContextVar(
    "nexus_admitted", default=None
)
"""The slot :meth:`StreamHub.admit` took for the block it runs: the run that
:meth:`StreamHub.open` starts in that block (the same task) takes it over."""


def cache_key(request: ChatRequest, owner: str | None = None, *, shared: bool = False) -> str:
    """The canonical request in its owner's cache: what decides the output, whatever the
    wire format, and whose it is.

    ``owner`` is the API key's name (None: no key, the ``anonymous`` cache); with
    ``shared`` every owner has the same key. The in-flight claim uses this key too,
    so a request joins only a stream it could have replayed.
    """
    scope = SHARED if shared else ANONYMOUS if owner is None else "key:" + owner
    body = request.model_dump(mode="json", exclude=_NOT_IN_KEY, exclude_none=True)
    canonical = orjson.dumps(body, option=orjson.OPT_SORT_KEYS)
    return hashlib.sha256(scope.encode() + b"\n" + canonical).hexdigest()


def status_of(terminal: StreamEvent) -> Status:
    if type(terminal) is Error:
        return "cancelled" if terminal.code in _CANCELLED else "failed"
    if type(terminal) is Done and terminal.aborted:
        return "cancelled"
    return "completed"


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

    @property
    def id(self) -> str:
        return self.info.id


class StoreReader:
    """Follows a log kept in the store (finished, or live on another replica).

    While it reads, it renews a lease so the owning replica does not cancel the
    stream as detached.
    """

    def __init__(self, hub: StreamHub, info: StreamInfo, start: int) -> None:
        self.meta = info.meta
        self._hub = hub
        self._id = info.id
        self._batches: AsyncIterator[list[StreamEvent]] = hub.store.read(info.id, start)
        self._pending: list[StreamEvent] = []
        self._lease: asyncio.Task[None] | None = None
        self._resumable = info.resumable
        if info.status == "in_progress" and hub.store.shared:
            self._lease = asyncio.get_running_loop().create_task(self._renew())

    @property
    def failure(self) -> GatewayError | None:
        return None

    @property
    def spend(self) -> Spend | None:
        return None  # counted where the stream ran

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

    async def _renew(self) -> None:
        # A stream that is not resumable is cancelled once the last lease lapses: keep
        # it short, so that the owner stops paying soon after this reader leaves.
        detach = self._hub.streams.detach_timeout_s if self._resumable else 0.0
        ttl = max(detach * 2, 2.0)
        while True:
            with contextlib.suppress(Exception):
                await self._hub.store.lease(self._id, ttl)
            await asyncio.sleep(ttl / 4)

    async def close(self) -> None:
        if self._lease is not None:
            self._lease.cancel()
            self._lease = None
        closer = getattr(self._batches, "aclose", None)
        if closer is not None:
            with contextlib.suppress(Exception):
                await closer()


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
        self.store_required = store_required
        """False: a stream the store cannot begin runs here alone (see the module docstring)."""
        self.on_mirror: Callable[[str], None] | None = None
        """Told ``behind``, ``caught_up`` or ``abandoned`` as a stream's mirror into a shared
        store lapses, recovers, or is given up (metrics)."""
        self._closing = asyncio.Event()
        self._unstored_warned = 0.0
        self.store = store
        self.streams = streams or StreamsConfig()
        self.cache = cache or CacheConfig()
        self.max_duration_s = max_duration_s
        self.live: dict[str, StreamRun] = {}
        self._owned: dict[str, int] = {}  # live runs per owner (API key name)
        self._opening = 0  # admitted requests with no live run (yet, or at all)
        self._opening_owned: dict[str, int] = {}
        self.limits: KeyLimits = LocalLimits(0.0, None, self.running)
        """Per-key rates, streams and budgets (the app sets the configured ones)."""
        self._slots: dict[str, Slot] = {}  # run id -> the key's slot it holds (shared limits)
        self.on_live: Callable[[int], None] | None = None
        """Told how many streams run here whenever that changes (metrics, several workers)."""
        self._keepers: set[asyncio.Task[None]] = set()
        self.watchdog = Watchdog()
        """Ends the streams that pass ``max_duration_s``: one ticker, not a timer each."""

    def running(self, owner: str | None = None) -> int:
        """Streams running here, or ``owner``'s: those live and the requests admitted
        without a live run (being opened, or answered without one)."""
        if owner is None:
            return len(self.live) + self._opening
        return self._owned.get(owner, 0) + self._opening_owned.get(owner, 0)

    @contextlib.asynccontextmanager
    async def admit(self, key: ApiKey | None, limit: int) -> AsyncIterator[None]:
        """A place among the streams running here while one is opened in the block (or,
        for a request answered without a run of its own, while it runs), and ``key``'s
        place among its own streams (:meth:`KeyLimits.admit`, with its rate and budget).

        Raises :class:`TooManyStreams` past ``[limits] max_concurrent_streams`` (this
        process), and what :meth:`KeyLimits.admit` raises. A request being opened
        counts as running, so that requests arriving together cannot all pass a limit
        that only some of them fit in; counted, not scanned (the check is O(1)). A run
        started in the block takes the key's :class:`Slot` with it (see :meth:`_start`):
        it is released when the run ends, else when the block does.
        """
        if self.running() >= limit:
            raise TooManyStreams(
                f"The gateway is at its limit of {limit} concurrent streams "
                "([limits] max_concurrent_streams); retry shortly.",
                headers={"Retry-After": "1"},
            )
        self._opening += 1
        try:
            slot = None
            owner = None
            if key is not None:
                slot = await self.limits.admit(key, stream=True)
                owner = key.name
                self._opening_owned[owner] = self._opening_owned.get(owner, 0) + 1
            admitted = _ADMITTED.set(slot)
            try:
                yield
            finally:
                _ADMITTED.reset(admitted)
                if owner is not None:
                    _discount(self._opening_owned, owner)
                if slot is not None and not slot.taken:
                    self.limits.release(slot)
        finally:
            self._opening -= 1

    async def open(
        self,
        request: ChatRequest,
        *,
        format: str,
        owner: str | None = None,
        background: bool = False,
        resumable: bool = False,
        ctx: CallContext | None = None,
    ) -> Opened:
        """A stream for ``request``: replayed, joined or new (see the module docstring).

        ``resumable``: it outlives its clients for ``[streams] detach_timeout_s``
        (a ``background`` stream always does); otherwise the last reader to leave
        cancels it (:mod:`nexus.cache.run`). A resumable request that joins a stream
        of this replica's makes that stream resumable.

        ``ctx`` is what the middleware and the hooks see of the call (by default
        one with ``key=owner`` and ``format``). Raises what
        :meth:`Engine.complete_stream` raises for a request that cannot be
        routed, a middleware's refusal and a plugin's
        :class:`~nexus.hooks.StreamRejected`.
        """
        if ctx is None:
            ctx = CallContext(key=owner, format=format)
        if not self.cache.enabled:
            stream = await self._open(request, ctx)
            info, run = await self._launch(stream, format, owner, background, resumable, ctx)
            return Opened(info, run, stored=run.stored)
        key = cache_key(request, owner, shared=self.cache.share_across_keys)
        try:
            recording = await self.store.get_recording(key)
        except StoreUnavailable:
            if self.store_required:
                raise
            stream = await self._open(request, ctx)
            return self._unstored(
                self._info(stream, format, owner, background or resumable), stream, background, ctx
            )
        if recording is not None:
            self.engine.route(request.model)  # the model must still exist
            meta = StreamMeta.new(
                request.model,
                include_usage=request.include_usage,
                provider=recording.provider,
                upstream_model=recording.upstream_model,
                retry_ms=self.engine.retry_ms,
            )
            source = Stream.of_batches(self._replay(recording), meta)
            await self._started(source, ctx)
            info, run = await self._launch(
                source, format, owner, background, resumable, ctx, replayed=True
            )
            return Opened(info, run, "hit", stored=run.stored)
        stream = await self._open(request, ctx)
        info = self._info(stream, format, owner, background or resumable)
        handed = False  # until then, a failure of the store closes the upstream stream
        begun = False
        try:
            try:
                if self.store.shared:
                    # Visible to every replica before anyone can be told its id (a 202, a claim).
                    await self.store.begin(info, self.streams.resume_ttl_s)
                    begun = True
                holder = await self.store.claim(key, info.id, self.streams.resume_ttl_s)
            except StoreUnavailable:
                if self.store_required:
                    raise
                handed = True
                return self._unstored(info, stream, background, ctx)
            # A claim ends with its stream; one left by a replica that died is taken over.
            for attempt in range(3):
                if attempt:
                    holder = await self.store.claim(key, info.id, self.streams.resume_ttl_s)
                if holder is None:
                    handed = True
                    run = self._start(info, stream, background, ctx, record=key)
                    return Opened(info, run, "miss")
                joined = await self._joinable(holder)
                if joined is not None:
                    handed = True
                    await stream.close()
                    if self.store.shared:
                        await self.store.end(replace(info, status="cancelled"), [], 0, 1.0)
                    local = self.live.get(holder)
                    if local is not None and resumable:
                        local.info.resumable = True  # this client may leave and come back
                    return Opened(joined, local, "hit", joined=True)
                await self.store.release(key, holder)  # its stream is over, or its replica died
        except BaseException:
            if not handed:
                await stream.close()
                if begun:
                    with contextlib.suppress(Exception):  # its live entry ends with it
                        await self.store.end(replace(info, status="failed"), [], 0, 1.0)
            raise
        run = self._start(info, stream, background, ctx)  # contended: stream, but do not record
        return Opened(info, run, "miss")

    async def _open(self, request: ChatRequest, ctx: CallContext) -> Stream:
        """The engine's stream through its middleware, past ``on_stream_started``."""
        stream = await self.engine.open_stream(request, ctx, observe=False)
        await self._started(stream, ctx)
        return stream

    async def _started(self, source: Stream, ctx: CallContext) -> None:
        hooks = self.engine.hooks
        if hooks:
            meta = source.meta
            try:
                await hooks.started(ctx, meta.id, meta.model, meta.provider)
            except BaseException:
                await source.close()
                raise

    async def _joinable(self, stream_id: str) -> StreamInfo | None:
        run = self.live.get(stream_id)
        if run is not None:
            return run.info if not run.ending else None
        info = await self.store.info(stream_id)
        if info is None or info.status != "in_progress":
            return None
        return info if await self.store.alive(stream_id) else None

    def _info(self, source: Stream, format: str, owner: str | None, resumable: bool) -> StreamInfo:
        return StreamInfo(meta=source.meta, format=format, owner=owner, resumable=resumable)

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
    ) -> tuple[StreamInfo, StreamRun]:
        info = self._info(source, format, owner, background or resumable)
        stored = True
        if self.store.shared:
            try:
                await self.store.begin(info, self.streams.resume_ttl_s)
            except StoreUnavailable:
                if self.store_required:
                    await source.close()  # the store cannot be reached: nothing may run unseen
                    raise
                self._warn_unstored()
                stored = False
            except BaseException:
                await source.close()
                raise
        return info, self._start(info, source, background, ctx, replayed=replayed, stored=stored)

    def _unstored(
        self, info: StreamInfo, stream: Stream, background: bool, ctx: CallContext
    ) -> Opened:
        """Run ``stream`` here alone: the store could not be reached and is not required."""
        self._warn_unstored()
        return Opened(info, self._start(info, stream, background, ctx, stored=False), stored=False)

    def _warn_unstored(self) -> None:
        """A warning at most every 10 s, however many requests the outage meets."""
        now = asyncio.get_running_loop().time()
        if now - self._unstored_warned >= 10.0:
            self._unstored_warned = now
            log.warning(
                "the stream store cannot be reached: new streams run on this replica only "
                "([store] required = false), not cached, not joined, resumable elsewhere "
                "once the store is back"
            )

    def _start(
        self,
        info: StreamInfo,
        source: Stream,
        background: bool,
        ctx: CallContext,
        record: str | None = None,
        *,
        replayed: bool = False,
        stored: bool = True,
    ) -> StreamRun:
        """Run it (``store.begin`` done, unless not ``stored``); a keeper looks after its log.

        With a shared store the keeper is a task for the run's whole length (it
        mirrors the log as it grows); otherwise it is a task started when the run
        finishes: an idle stream holds no task of the hub's.
        """
        run = StreamRun(
            info,
            source,
            detach_timeout_s=self.streams.detach_timeout_s,
            max_log_bytes=self.streams.max_log_bytes,
            leased=(lambda: self.store.leased(info.id)) if self.store.shared else None,
            max_duration_s=self.max_duration_s,
            observer=self.engine.hooks.observe(ctx, info.meta),
            timed=record is not None,
            watchdog=self.watchdog,
            prices=self.engine.prices,
            replayed=replayed,
        )
        self.live[run.id] = run
        slot = _ADMITTED.get()
        if slot is not None and not slot.taken and slot.key == info.owner:
            slot.taken = True  # the run holds it now, until _gone
            self._slots[run.id] = slot
        owner = info.owner
        if owner is not None:
            self._owned[owner] = self._owned.get(owner, 0) + 1
        if self.on_live is not None:
            self.on_live(len(self.live))
        run.stored = stored
        run.start(detached=background)
        if self.store.shared:
            self._track(self._keep(run, record, stored))
        else:
            run.record = record
            run.on_finish = self._finished
        return run

    def _finished(self, run: StreamRun) -> None:
        self._track(self._end(run, run.record, 0))

    def _track(self, keeper: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(keeper)
        self._keepers.add(task)
        task.add_done_callback(self._keepers.discard)

    async def attach(
        self, stream_id: str, start: int = 0, *, meta: StreamMeta | None = None
    ) -> RunReader | StoreReader:
        """A reader of the stream's log from entry ``start``. Raises :class:`StreamNotFound`."""
        run = self.live.get(stream_id)
        if run is not None:
            reader = run.reader(start)
        else:
            info = await self.info(stream_id)
            if info is None:
                raise StreamNotFound(f"No stream {stream_id!r}: unknown, or expired.")
            reader = StoreReader(self, info, start)  # type: ignore[assignment]
        if meta is not None:
            reader.meta = meta
        return reader

    async def info(self, stream_id: str) -> StreamInfo | None:
        run = self.live.get(stream_id)
        if run is not None:
            return run.info
        return await self.store.info(stream_id)

    def cancel(self, stream_id: str, terminal: StreamEvent) -> bool:
        """End a local stream now. False when it is not running here."""
        run = self.live.get(stream_id)
        if run is None or run.finished:
            return False
        run.cancel(terminal)
        return True

    async def shutdown(self, terminal: StreamEvent) -> None:
        """Cancel every live stream with ``terminal``; wait until their logs are kept
        (keepers retrying a store that is down make one last try)."""
        self._closing.set()
        for run in list(self.live.values()):
            run.cancel(terminal)
        await self.drain()

    async def drain(self, timeout_s: float = 10.0) -> None:
        """Until every run's keeper is done (logs handed to the store); at most ``timeout_s``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        # A run leaves ``live`` once its log is kept: by its keeper, or by the task its
        # end starts (between the two, neither is there to wait for: a turn of the loop).
        while (self._keepers or self.live) and loop.time() < deadline:
            pending = [*self._keepers, *(run.done for run in self.live.values())]
            pending = [p for p in pending if not p.done()]
            if pending:
                await asyncio.wait(pending, timeout=deadline - loop.time())
            else:
                await asyncio.sleep(0)
        if self._keepers or self.live:
            log.warning(
                "%d streams did not finish closing in %.0fs",
                max(len(self._keepers), len(self.live)),
                timeout_s,
            )

    async def _keep(self, run: StreamRun, record: str | None, stored: bool = True) -> None:
        """A shared store's keeper: the log mirrored as it grows, then :meth:`_end`.

        ``written`` entries are in the store; while it fails, the keeper retries from
        there (see the module docstring). ``stored`` False: the stream was not begun
        in the store, which it is first, once the store answers.
        """
        store = self.store
        written = 0
        begun = stored
        mirror = Mirror(run, self.on_mirror, self._closing)
        try:
            alive = asyncio.get_running_loop().create_task(self._keep_alive(run))
            try:
                while not run.finished:
                    end = len(run.events)  # no terminal yet: that goes with end()
                    if begun and end <= written:
                        await run.changed()
                        continue
                    try:
                        if not begun:
                            await store.begin(run.info, self.streams.resume_ttl_s)
                            begun, written = True, 0
                        if end > written:
                            if not await store.append(run.id, written, run.events[written:end]):
                                begun = False  # the store lost the log: again, from entry 0
                                continue
                            written = end
                        mirror.ok()
                    except StoreUnavailable:
                        mirror.failed()
                        if self._closing.is_set():
                            break  # shutting down: its end gets one last try
                        await mirror.pause()
            except Exception:
                log.exception("mirroring stream %s to the store failed", run.id)
            await run.wait()
            alive.cancel()
        except BaseException:
            self._gone(run)
            raise
        # Not begun (the store lost it, or never had it): end() writes it whole.
        await self._end(run, record, written if begun else 0, mirror)

    async def _end(
        self, run: StreamRun, record: str | None, written: int, mirror: Mirror | None = None
    ) -> None:
        """The finished log handed to the store (``written`` entries are there), recorded.

        With a shared store that fails, retried (``mirror``) for up to ``resume_ttl_s``;
        the run stops counting as running meanwhile."""
        store = self.store
        ttl = self.streams.resume_ttl_s
        try:
            run.info.status = status_of(run.events[-1])
            size = run.size + event_size(run.events[-1])
            loop = asyncio.get_running_loop()
            give_up = loop.time() + ttl
            while True:
                try:
                    await store.end(run.info, run.events, written, ttl, size)
                    if mirror is not None:
                        mirror.ok()
                    break
                except StoreUnavailable:
                    if mirror is None:
                        log.warning(
                            "keeping the log of stream %s failed: store unreachable", run.id
                        )
                        break
                    self._gone(run)  # ended: it must not hold a stream slot while this retries
                    mirror.failed()
                    if self._closing.is_set() or loop.time() >= give_up:
                        mirror.abandon()
                        return
                    await mirror.pause()
                except Exception:
                    log.exception("keeping the log of stream %s failed", run.id)
                    break
            if record is not None:
                await self._record(run, record)
        finally:
            self._gone(run)

    def _gone(self, run: StreamRun) -> None:
        if self.live.pop(run.id, None) is not None and run.info.owner is not None:
            _discount(self._owned, run.info.owner)
        slot = self._slots.pop(run.id, None)
        if slot is not None:
            self.limits.release(slot)
        if self.on_live is not None:
            self.on_live(len(self.live))

    async def _keep_alive(self, run: StreamRun) -> None:
        """Keep a long, quiet stream's live log from expiring while it runs."""
        while True:
            await asyncio.sleep(min(self.streams.resume_ttl_s / 3, 60.0))
            try:
                await self.store.keep_alive(run.id)
            except StoreUnavailable:
                pass  # counted; the keeper warns once for the stream
            except Exception:
                log.exception("renewing stream %s in the store failed", run.id)

    async def _record(self, run: StreamRun, key: str) -> None:
        try:
            terminal = run.events[-1]
            cache = self.cache
            if (
                type(terminal) is Done
                and not terminal.aborted
                and len(run.events) - 1 <= cache.max_frames
                and run.size <= cache.max_bytes
                and run.offsets is not None
            ):
                meta = run.info.meta
                recording = Recording(
                    _free(run.events[:-1]), run.offsets[:-1], meta.provider, meta.upstream_model
                )
                await self.store.put_recording(key, recording, cache.ttl_s)
            await self.store.release(key, run.id)
        except Exception:
            log.exception("recording stream %s failed", run.id)

    async def _replay(self, recording: Recording) -> AsyncGenerator[list[StreamEvent], None]:
        mode = self.cache.mode
        if mode == "burst":
            for at in range(0, len(recording.events), MAX_BATCH):
                yield recording.events[at : at + MAX_BATCH]
            return
        divisor = self.cache.ff_divisor if mode == "fast_forward" else 1.0
        loop = asyncio.get_running_loop()
        start = loop.time()
        for event, offset in zip(recording.events, recording.offsets, strict=True):
            delay = start + offset / divisor - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            yield [event]


def _free(events: list[StreamEvent]) -> list[StreamEvent]:
    """A recording's events: its replays cost nothing upstream, so their usage says 0."""
    return [
        replace(e, cost_usd=0.0) if type(e) is Usage and e.cost_usd is not None else e
        for e in events
    ]


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


def describe(info: StreamInfo, read_token: str | None = None) -> dict[str, Any]:
    """The JSON a background request answers with (and a DELETE, without a token).

    With ``read_token`` (see :mod:`nexus.tokens`) it is included, and ``url`` carries
    it as ``?token=``: a URL a browser's ``EventSource`` can read without headers.
    """
    if read_token is None:
        return {
            "id": info.id,
            "url": f"/v1/streams/{info.id}",
            "status": info.status,
            "resumable": info.resumable,
        }
    return {
        "id": info.id,
        "url": f"/v1/streams/{info.id}?token={read_token}",
        "status": info.status,
        "resumable": info.resumable,
        "read_token": read_token,
    }


def _discount(counts: dict[str, int], owner: str) -> None:
    """One less for ``owner``; none left, no entry (the dict holds active keys only)."""
    left = counts.get(owner, 0) - 1
    if left > 0:
        counts[owner] = left
    else:
        counts.pop(owner, None)
