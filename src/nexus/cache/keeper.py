"""The keeper of a run's log: mirrored into a shared store as it grows, handed to the
store when it ends, recorded, its claim released.

With a shared store the keeper is a task for the run's whole length; otherwise a task
started when the run finishes (an idle stream holds no task of the hub's).

The store may fail (Redis restarted or unreachable). A running stream does not
notice: its producer never awaits the store, so its clients read on to the end.
What lapses is its mirror, hence resuming it elsewhere: the keeper warns once for
the stream, tells ``on_mirror`` (``behind``), and retries from the last entry it
mirrored at the stream's next growth, at most every second or so
(:mod:`nexus.cache.mirror`); a log the store lost meanwhile is begun again and
written from entry 0 (``caught_up``). Its end is retried the same way for up to
``resume_ttl_s``, then given up (``abandoned``: a reader elsewhere gets an error,
not a hole; see :mod:`nexus.cache.redis`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from ..config import CacheConfig, StreamsConfig
from ..errors import StoreUnavailable
from ..events import Done, Error, StreamEvent
from .codec import event_size
from .mirror import Mirror
from .recording import record
from .run import StreamRun
from .store import Status, Store

__all__ = ["Keeper", "status_of"]

log = logging.getLogger("nexus.streams")

_CANCELLED = ("stream_detached", "stream_cancelled", "client_disconnect")
"""Error codes of a stream ended on purpose (its status is ``cancelled``, not ``failed``)."""


def status_of(terminal: StreamEvent) -> Status:
    if type(terminal) is Error:
        return "cancelled" if terminal.code in _CANCELLED else "failed"
    if type(terminal) is Done and terminal.aborted:
        return "cancelled"
    return "completed"


class Keeper:
    """Keeps the logs of a hub's runs (see the module docstring); ``gone(run)`` is
    called once a run no longer counts as running."""

    def __init__(
        self,
        store: Store,
        streams: StreamsConfig,
        cache: CacheConfig,
        gone: Callable[[StreamRun], None],
    ) -> None:
        self.store = store
        self.streams = streams
        self.cache = cache
        self.tasks: set[asyncio.Task[None]] = set()
        self.closing = asyncio.Event()
        """Set at shutdown: a keeper retrying a store that is down makes one last try."""
        self.on_mirror: Callable[[str], None] | None = None
        """Told ``behind``, ``caught_up`` or ``abandoned`` as a stream's mirror into a
        shared store lapses, recovers, or is given up (metrics)."""
        self._gone = gone

    def keep(self, run: StreamRun, record: str | None, stored: bool) -> None:
        """Look after ``run``'s log; ``record``: the cache key to record it under."""
        if self.store.shared:
            self._track(self._keep(run, record, stored))
        else:
            run.on_finish = lambda run: self._track(self._end(run, record, 0))

    def _track(self, keeper: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(keeper)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _keep(self, run: StreamRun, record: str | None, stored: bool) -> None:
        """A shared store's keeper: the log mirrored as it grows, then :meth:`_end`.

        ``written`` entries are in the store; while it fails, the keeper retries from
        there. ``stored`` False: the stream was not begun in the store, which it is
        first, once the store answers.
        """
        store = self.store
        written = 0
        begun = stored
        mirror = Mirror(run, self.on_mirror, self.closing)
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
                        if self.closing.is_set():
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
        self, run: StreamRun, key: str | None, written: int, mirror: Mirror | None = None
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
                    if self.closing.is_set() or loop.time() >= give_up:
                        mirror.abandon()
                        return
                    await mirror.pause()
                except Exception:
                    log.exception("keeping the log of stream %s failed", run.id)
                    break
            if key is not None:
                await record(store, self.cache, run, key)
        finally:
            self._gone(run)

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
