"""The keeper of the hub's logs: mirrored into a shared store as they grow, handed to
the store when they end, recorded, their claims released.

With a shared store, one task (the mirror) serves every run of the process: a run that
grows marks itself, the keeper being one more reader of its log, told of each batch in
the run's own call (no task, timer or future per stream and batch); the mirror
waits the store's ``mirror_interval_s`` (``[store] mirror_interval_ms``, 10 ms by default) so
that the runs growing meanwhile join, then writes all
their new entries and ends in one round trip (:meth:`~nexus.cache.store.Store.mirror`),
and renews the live logs' TTLs in one round trip every third of ``resume_ttl_s`` (60 s
at most). It stops when no run is left. Otherwise a task starts when a run finishes.

The store may fail (Redis restarted or unreachable). A running stream does not notice:
its producer never awaits the store. What lapses is resuming it elsewhere: the keeper
warns once per stream and lapse, tells ``on_mirror`` (``behind``), and retries after
:data:`RETRY_S`, doubling up to :data:`RETRY_MAX_S`, from the last entry written; a log
the store lost meanwhile is written again from entry 0 (``caught_up``). An end is
retried for up to ``resume_ttl_s``, then given up (``abandoned``: a reader elsewhere
gets an error, not a hole); the stream stops counting as running meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine
from dataclasses import replace
from typing import Any

from ..config import CacheConfig, StreamsConfig
from ..errors import StoreUnavailable
from ..events import Done, Error, StreamEvent
from .codec import event_size
from .recording import record
from .run import StreamRun
from .store import Status, Store, StreamInfo, Write

__all__ = [
    "RECORDING_WAIT_S",
    "RETRY_MAX_S",
    "RETRY_S",
    "Keeper",
    "status_of",
]

log = logging.getLogger("nexus.streams")

RETRY_S = 1.0
"""After the store failed, the next try comes this much later, doubling up to..."""
RETRY_MAX_S = 8.0
RECORDING_WAIT_S = 1.0
"""How long an identical request waits for the recording of a stream that just ended here
(a round trip or two: the mirror hands its end over, then records it) rather than call
upstream again (:meth:`Keeper.recorded`)."""

_CANCELLED = ("stream_detached", "stream_cancelled", "client_disconnect")
"""Error codes of a stream ended on purpose (its status is ``cancelled``, not ``failed``)."""


def status_of(terminal: StreamEvent) -> Status:
    if type(terminal) is Error:
        return "cancelled" if terminal.code in _CANCELLED else "failed"
    if type(terminal) is Done and terminal.aborted:
        return "cancelled"
    return "completed"


class _Kept:
    """A run in the mirror: ``written`` entries are in the store (if ``begun``)."""

    __slots__ = ("_mark", "begun", "behind", "give_up", "record", "run", "written")

    def __init__(
        self, run: StreamRun, record: str | None, begun: bool, mark: Callable[[_Kept], None]
    ) -> None:
        self.run = run
        self._mark = mark  # the keeper's (a closure over this one would be a cycle)
        self.record = record
        self.begun = begun
        self.written = 0
        self.behind = False
        self.give_up = 0.0  # once its end failed: when it is given up

    def woke(self, _: object) -> bool:
        """Told of each batch the run logs (a reader that takes every batch: no future
        set and callback scheduled per batch), and of its end."""
        self._mark(self)
        return True


class Keeper:
    """Keeps the logs of a hub's runs (see the module docstring); ``gone(run)`` is
    called once a run's log is kept (or given up), ``released(run)`` once a finished run
    whose end the store has not taken yet stops counting as running (it is still read
    here meanwhile)."""

    def __init__(
        self,
        store: Store,
        streams: StreamsConfig,
        cache: CacheConfig,
        gone: Callable[[StreamRun], None],
        released: Callable[[StreamRun], None] | None = None,
    ) -> None:
        self.store = store
        self.streams = streams
        self.cache = cache
        self.tasks: set[asyncio.Task[None]] = set()
        """The mirror, and the ends and recordings under way."""
        self.closing = asyncio.Event()
        """Set at shutdown: a mirror waiting to retry a store that is down makes one last try."""
        self.on_mirror: Callable[[str], None] | None = None
        """Told ``behind``, ``caught_up`` or ``abandoned`` as a stream's mirror into a
        shared store lapses, recovers, or is given up (metrics)."""
        self._gone = gone
        self._released = released or gone
        self._recording: dict[str, tuple[StreamRun, asyncio.Future[None]]] = {}
        """Cache keys whose run here is to be recorded -> it, and a future done once its
        recording was written (or will not be)."""
        self._kept: dict[str, _Kept] = {}
        self._dirty: dict[str, _Kept] = {}
        self._woken = asyncio.Event()
        self._mirror: asyncio.Task[None] | None = None
        self._renew_now = False

    def keep(self, run: StreamRun, record: str | None, stored: bool) -> None:
        """Look after ``run``'s log; ``record``: the cache key to record it under;
        ``stored``: :meth:`Store.begin` was called (else the mirror begins it)."""
        if record is not None:
            self._recording[record] = (run, asyncio.get_running_loop().create_future())
        if not self.store.shared:
            # Unrecorded (the common case): a bound method, not a closure per stream.
            run.on_finish = (
                self._finished
                if record is None
                else lambda run: self._track(self._end(run, record))
            )
            return
        kept = self._kept[run.id] = _Kept(run, record, stored, self._mark)
        run._waiter(kept.woke).add_done_callback(kept.woke)  # for as long as it runs
        if not stored or run.finished or run.events:
            self._mark(kept)
        if self._mirror is None:
            self._mirror = self._track(self._run())

    async def recorded(self, key: str, wait_s: float) -> bool:
        """When a run of ``key`` ended here and its recording is being written: wait for
        it (``wait_s`` at most) and say True. Back to back, an identical request replays
        it rather than call upstream again; nothing waits on the store per chunk."""
        pending = self._recording.get(key)
        if pending is None or not pending[0].finished:
            return False
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait_s):
                await asyncio.shield(pending[1])
        return True

    def _settled(self, run: StreamRun, key: str | None) -> None:
        """``run``'s recording under ``key`` is written, or will not be."""
        if key is None:
            return
        pending = self._recording.get(key)
        if pending is not None and pending[0] is run:
            del self._recording[key]
            pending[1].set_result(None)

    def _finished(self, run: StreamRun) -> None:
        self._track(self._end(run, None))

    def never_started(self, info: StreamInfo, claimed: str, *, runs: bool = False) -> None:
        """A stream whose start the store failed (its claim of ``claimed``, its ``begin``):
        Redis may yet run what it was sent (a stalled one runs it as it resumes), leaving a
        claim to a stream that never runs, which identical requests would join and wait on
        for as long as its owner lives. Both are undone (the claim only, if it ``runs`` here
        unstored: its log is mirrored once the store is back), tried again as the mirror
        retries until one try lands (the store answers again: what it was sent before ran)."""
        self._track(self._undo(info, claimed, runs))

    async def _undo(self, info: StreamInfo, claimed: str, runs: bool) -> None:
        loop = asyncio.get_running_loop()
        give_up, delay = loop.time() + self.streams.resume_ttl_s, RETRY_S / 4
        while True:
            try:
                await self.store.release(claimed, info.id)
                if not runs:
                    await self.store.end(replace(info, status="failed"), [], 0, 1.0)
                return
            except StoreUnavailable:
                if loop.time() + delay > give_up:
                    return  # (its TTLs end it)
                with contextlib.suppress(TimeoutError):  # (a shutdown waits for no retry)
                    async with asyncio.timeout(delay):
                        await self.closing.wait()
                if self.closing.is_set():
                    return
                delay = min(delay * 2, RETRY_MAX_S)

    def _track(self, job: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(job)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    def _mark(self, kept: _Kept) -> None:
        run_id = kept.run.id
        if self._kept.get(run_id) is not kept:
            return  # its end is written already (the finish's callback came late)
        self._dirty[run_id] = kept
        self._woken.set()

    def _state(self, kept: _Kept, state: str) -> None:
        kept.behind = state == "behind"
        if self.on_mirror is not None:
            self.on_mirror(state)

    async def _run(self) -> None:
        """The mirror (see the module docstring)."""
        loop = asyncio.get_running_loop()
        every = min(self.streams.resume_ttl_s / 3, 60.0)
        renew_at = loop.time() + every
        delay = RETRY_S
        try:
            while self._kept:
                if not self._dirty and not self._renew_now:
                    self._woken.clear()
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout_at(renew_at):
                            await self._woken.wait()
                if not self.closing.is_set():
                    # The runs that grow meanwhile join.
                    await asyncio.sleep(self.store.mirror_interval_s)
                if loop.time() >= renew_at or self._renew_now:
                    renew_at = loop.time() + every
                    self._renew_now = False
                    await self._renew()
                dirty, self._dirty = self._dirty, {}
                if dirty and not await self._write(list(dirty.values())):
                    # Until the retry, or a store back from a restart (renew_soon): its
                    # streams are lost there, and readers elsewhere get 404s meanwhile.
                    retry_at = loop.time() + delay
                    while not (self._renew_now or self.closing.is_set()):
                        if (left := retry_at - loop.time()) <= 0:
                            break
                        await asyncio.sleep(min(left, 0.1))
                    delay = min(delay * 2, RETRY_MAX_S)
                else:
                    delay = RETRY_S
        finally:
            self._mirror = None

    def renew_soon(self) -> None:
        """The store may have lost the live streams (it restarted): renew them now, and
        write those it lost again."""
        if self._mirror is not None:
            self._renew_now = True
            self._woken.set()

    async def _renew(self) -> None:
        ids = [kept.run.id for kept in self._kept.values() if kept.begun]
        try:
            lost = await self.store.keep_alive(ids)
        except StoreUnavailable:
            return  # counted; a stream's mirror warns when it fails
        except Exception:
            log.exception("renewing the live streams in the store failed")
            return
        for stream_id in lost:  # a quiet stream whose keys a restart lost: begun again
            kept = self._kept.get(stream_id)
            if kept is not None and kept.begun and not kept.run.finished:
                log.info("stream %s: the store lost it (restarted?); writing it again", stream_id)
                kept.begun = False
                self._mark(kept)

    async def _write(self, batch: list[_Kept]) -> bool:
        """Each run's new entries, or its end, in one round trip; False if it failed."""
        writes = []
        for kept in batch:
            run = kept.run
            if run.finished:
                run.info.status = status_of(run.events[-1])
            start = kept.written if kept.begun else 0
            begin = not (kept.begun or run.finished)
            writes.append(Write(run.info, run.events[start:], start, begin, run.finished))
        try:
            results = await self.store.mirror(writes, self.streams.resume_ttl_s)
        except Exception as exc:
            if not isinstance(exc, StoreUnavailable):
                log.exception("mirroring %d streams to the store failed", len(batch))
            self._failed(batch)
            return False
        for kept, write, ok in zip(batch, writes, results, strict=True):
            if kept.behind:
                log.info("stream %s: its log in the store is caught up", kept.run.id)
                self._state(kept, "caught_up")
            if not ok:  # the store lost the log: again, from entry 0
                kept.begun = False
                self._mark(kept)
            elif write.end:
                del self._kept[kept.run.id]
                # Marked again while this end was in flight (the finish's callback): done.
                self._dirty.pop(kept.run.id, None)
                if kept.record is not None:
                    self._track(self._recorded(kept.run, kept.record))
                else:
                    self._gone(kept.run)
            else:
                kept.begun = True
                kept.written = len(write.events) + write.start  # (grown since: marked)
        return True

    def _failed(self, batch: list[_Kept]) -> None:
        """The store failed: each stream warned and counted once per lapse, retried after
        a pause (at shutdown, only its end, once); an end until it is given up."""
        now = asyncio.get_running_loop().time()
        for kept in batch:
            run = kept.run
            if not kept.behind:
                log.warning(
                    "the stream store cannot be reached: stream %s streams on to its "
                    "clients here, but cannot be resumed on another replica until its log "
                    "is caught up",
                    run.id,
                )
                self._state(kept, "behind")
            if not run.finished:
                if self.closing.is_set():
                    run.done.add_done_callback(kept.woke)  # last try
                else:
                    self._mark(kept)
                continue
            self._released(run)  # ended: it must not hold a stream slot while this retries
            if not kept.give_up:
                kept.give_up = now + self.streams.resume_ttl_s
            if self.closing.is_set() or now >= kept.give_up:
                log.warning(
                    "stream %s: its log could not be kept in the store; readers elsewhere "
                    "get an error, not a partial stream",
                    run.id,
                )
                self._state(kept, "abandoned")
                del self._kept[run.id]
                self.store.forget(run.id)
                self._settled(run, kept.record)
                self._gone(run)
            else:
                self._mark(kept)

    async def _recorded(self, run: StreamRun, key: str) -> None:
        try:
            await record(self.store, self.cache, run, key)
        finally:
            self._settled(run, key)
            self._gone(run)

    async def _end(self, run: StreamRun, key: str | None) -> None:
        """A finished run's log handed to a store that is not shared, then recorded."""
        try:
            run.info.status = status_of(run.events[-1])
            size = run.size + event_size(run.events[-1])
            ttl = self.streams.resume_ttl_s
            try:
                await self.store.end(run.info, run.events, 0, ttl, size)
            except Exception:
                log.exception("keeping the log of stream %s failed", run.id)
            if key is not None:
                await record(self.store, self.cache, run, key)
        finally:
            self._settled(run, key)
            self._gone(run)
