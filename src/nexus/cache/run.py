"""A stream resource in this process: one producer task, one log, any number of readers.

:class:`StreamRun` reads its source (the engine's stream, or a replayed recording)
in a task of its own into ``events``, whose last entry is terminal (:class:`Done`
or an :class:`Error`). A :class:`~nexus.cache.readers.RunReader` follows the log from
any index and gets all that arrived since its last read as one batch.

When the last reader leaves, a *resumable* stream (``info.resumable``) runs on for
``detach_timeout_s``, then ends with ``stream_detached`` if nobody came back; any
other stream is cancelled at once (``client_disconnect``: the upstream is not paid
to generate for nobody; or the error the gateway failed its last reader's response
with, the outcome that client's access line tells). With a shared store, the leases of
readers on other replicas keep either running until the last lapses (asked when the last
reader here leaves, then when the lease would lapse: :meth:`~nexus.cache.store.Store.held`),
and a resumable request there that joined a plain stream makes it resumable. A log past
``max_log_bytes`` ends with ``stream_too_large``; :meth:`StreamRun.cancel` ends it
with the entry given.

A run drives its ``observer`` (:class:`~nexus.hooks.StreamObserver`) itself, with no
layer between its source and its log: the chunk hooks see each read before it is
logged, and the end hooks (given the spend and the merge of the log), then ``on_end``,
have run before the terminal entry is appended: a client that saw the end finds its
spend charged and its key's place given back.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Protocol

from ..errors import GatewayError
from ..events import Delta, Done, Error, StreamEvent
from ..hooks import StreamObserver
from ..log_context import inherit
from ..pricing import NOTHING, PriceTable, Spend, tally, terminal_ok
from ..stream import Stream, merge_events
from ..types import StreamMeta
from ..watchdog import Watchdog
from .codec import event_size
from .store import StreamInfo

__all__ = ["CLIENT_GONE", "MAX_BATCH", "Held", "LogReader", "Push", "StreamRun", "too_long"]

if TYPE_CHECKING:
    from .readers import RunReader

log = logging.getLogger("nexus.streams")

Held = Callable[[bool], Awaitable[tuple[float, bool]]]
"""Asked (with whether the run is resumable) once its last reader here left: how long
readers elsewhere still hold it, and whether a join elsewhere made it resumable
(:meth:`~nexus.cache.store.Store.held`)."""


Push = Callable[[list[StreamEvent]], bool]
"""Takes a batch as it is logged, in the producer's task: True when it took it (a
reader's sink renders and writes it then), False to leave it to the reader's task."""


class LogReader(Protocol):
    """What the pump reads: a log's entries in batches, from where it was opened.
    ``failure``: the error a local source raised before any event (an HTTP status).
    ``sink``: see :class:`~nexus.cache.readers.RunReader` (others ignore it).
    ``cancel_safe``: a read may be cancelled and made again without loss (so a deadline
    may be put on it directly, without a task to read in)."""

    meta: StreamMeta
    sink: Push | None
    cancel_safe: bool

    @property
    def failure(self) -> GatewayError | None: ...

    @property
    def spend(self) -> Spend | None: ...  # once it ended here (None: not yet, or elsewhere)

    @property
    def served(self) -> StreamMeta: ...  # the meta now (after a fallback: who answered)

    @property
    def run(self) -> StreamRun | None: ...  # the local run it follows (None: elsewhere)

    async def settled_spend(self, wait_s: float) -> Spend | None:
        """:attr:`spend`, after up to ``wait_s`` for a stream being cancelled (its last
        reader gone) to end. Call it after :meth:`close`."""

    def __aiter__(self) -> AsyncIterator[list[StreamEvent]]: ...

    async def close(self, failed: Error | None = None) -> None:
        """Stop reading. ``failed``: the gateway failed this reader's client (not the
        client gone): a stream that ends because its last reader left ends with it."""


def _size(batch: list[StreamEvent]) -> int:
    """What ``batch`` adds to the log's size (:func:`event_size`, inlined for content
    deltas); -1 when it holds an :class:`Error` or :class:`Done`."""
    size = 0
    for event in batch:
        cls = type(event)
        if cls is Delta and event.content is not None and event.tool_calls is None:  # type: ignore[union-attr]
            size += 128 + len(event.content)  # type: ignore[union-attr]
        elif cls is Error or cls is Done:
            return -1
        else:
            size += event_size(event)
    return size


def _without_terminals(batch: list[StreamEvent]) -> tuple[list[StreamEvent], Error | None, int]:
    """The batch up to its first :class:`Error` (which ends the log), without any
    :class:`Done` (not logged: the log's own end says it); that error; their size."""
    kept: list[StreamEvent] = []
    for event in batch:
        cls = type(event)
        if cls is Error:
            return kept, event, _size(kept)  # type: ignore[return-value]
        if cls is not Done:
            kept.append(event)
    return kept, None, _size(kept)


def _error(code: str, message: str, *, retryable: bool = False) -> Error:
    return Error(error_type="server_error", message=message, code=code, retryable=retryable)


CLIENT_GONE = _error(  # the end of a stream whose last client went away
    "client_disconnect",
    'Every client of this stream went away and it was not resumable (ask with "background": '
    'true, "stream_options": {"resumable": true} or the header X-Nexus-Resumable: true).',
)


def too_long(limit_s: float) -> Error:
    """The end of a stream that ran for ``[limits] max_stream_duration_s``."""
    return _error(
        "max_stream_duration",
        f"The stream ran past the gateway's limit of {limit_s:g}s "
        "([limits] max_stream_duration_s) and was ended.",
    )


class StreamRun:
    """One live stream: its producer task, its log, its readers. See the module docstring."""

    # Slots: one per stream, and with more than 29 attributes CPython 3.11 gives each
    # instance a dict of its own (~1.6 KB) where slots take ~0.3 (bench/README.md).
    __slots__ = (
        "_cancel_with", "_detach_timeout_s", "_ends_at", "_finished", "_held", "_lease_check",
        "_left_with", "_loop", "_max_duration_s", "_max_log_bytes", "_observer", "_prices",
        "_replayed", "_running", "_settled", "_source", "_start", "_stopped", "_task", "_terminal",
        "_timer", "_waiters", "_watchdog",
        "attached", "events", "failure", "finished", "id", "info", "offsets", "on_end",
        "on_finish", "size", "spend"
    )  # fmt: skip

    def __init__(
        self,
        info: StreamInfo,
        source: Stream,
        *,
        detach_timeout_s: float,
        max_log_bytes: int,
        held: Held | None = None,
        watchdog: Watchdog,
        max_duration_s: float | None = None,
        observer: StreamObserver | None = None,
        timed: bool = True,
        prices: PriceTable | None = None,
        replayed: bool = False,
    ) -> None:
        self.info = info
        self.id = info.meta.id
        self.events: list[StreamEvent] = []
        self.offsets: list[float] | None = [] if timed else None
        """Seconds from the start to each entry, when ``timed`` (to be recorded)."""
        self.finished = False
        self.failure: GatewayError | None = None
        """The error the source raised before any event (the origin answers with its status)."""
        self.size = 0
        self.attached = 0
        self._start = 0.0
        self._terminal: StreamEvent = Done()  # the log's end, once the source gave it
        self._stopped = False  # the log has its end: the source is read no more
        self._source = source
        self._detach_timeout_s = detach_timeout_s
        self._max_log_bytes = max_log_bytes
        self._held = held
        self._max_duration_s = max_duration_s
        self._observer = observer
        self._watchdog = watchdog
        self._ends_at = 0.0
        self._prices = prices if prices is not None else PriceTable()
        self._replayed = replayed
        self.spend: Spend | None = None
        """What it spent upstream, once finished (a replay: nothing)."""
        self.on_end: Callable[[StreamRun], Awaitable[object]] | None = None
        """Awaited once the end hooks ran, before the terminal entry is in: what must be
        over before any reader can see the end (its key's place in a shared count)."""
        self.on_finish: Callable[[StreamRun], object] | None = None
        """Called with the run once its log is finished (the terminal entry is in)."""
        self._loop = asyncio.get_running_loop()
        self._waiters: dict[asyncio.Future[None], Push | None] = {}
        """Readers waiting at the end of the log, in arrival order (a dict: a reader that
        leaves is dropped at once, however many wait)."""
        self._timer: asyncio.TimerHandle | None = None
        self._lease_check: asyncio.Task[None] | None = None
        self._cancel_with: StreamEvent | None = None
        self._left_with: Error | None = None  # why the last reader left, if not its client
        self._task: asyncio.Task[None] | None = None
        self._running = False
        self._settled = False
        self._finished = self._loop.create_future()

    def start(self, *, detached: bool = False) -> None:
        """Start producing. ``detached``: nobody reads yet (a background request, which
        is resumable: the detach timer starts)."""
        self._task = self._loop.create_task(self._produce(), name=f"nexus-stream-{self.id}")
        inherit(self._task)  # its lines are its request's (an upstream's error, a fallback)
        limit = self._max_duration_s
        if limit is not None:
            # Checked by the hub's one ticker, at worst 1/8 of the limit (5 s) late:
            # not a timer handle per stream.
            self._ends_at = self._loop.time() + limit
            self._watchdog.add(self, min(limit / 8, 5.0))
        if detached:
            self._arm()

    def check(self, now: float) -> None:
        """The watchdog's tick: end the stream once it has run for its limit."""
        if now >= self._ends_at and self._max_duration_s is not None:
            self._watchdog.discard(self)
            self.cancel(too_long(self._max_duration_s))

    @property
    def answered(self) -> bool:  # a target answered: the log has an event before its end
        return bool(self.events) and type(self.events[0]) not in (Error, Done)

    def reader(self, start: int = 0) -> RunReader:
        from .readers import RunReader  # which imports this module

        return RunReader(self, start)

    def cancel(self, terminal: StreamEvent) -> bool:
        """End the stream now; ``terminal`` closes the log (unless it already ended).
        Whether this call ended it (False: it had ended, or its end was decided)."""
        if self.finished or self._task is None or self._cancel_with is not None or self._settled:
            return False  # once, and never once the end is decided: its end hooks run
        self._cancel_with = terminal
        if self._running:
            self._task.cancel()
        # else: the task has not run yet; it sees _cancel_with when it does.
        return True

    async def wait(self) -> None:
        """Until the log is finished (the source closed)."""
        await asyncio.shield(self._finished)

    @property
    def done(self) -> asyncio.Future[None]:
        """Done when the log is finished (do not cancel it: :meth:`wait` is for waiting)."""
        return self._finished

    def _waiter(self, push: Push | None = None) -> asyncio.Future[None]:
        """A future done at the next entry (or batch ``push`` did not take), for the
        caller to await itself (an idle reader then holds no frame of this run's);
        :meth:`_drop` it if cancelled."""
        waiter = self._loop.create_future()
        self._waiters[waiter] = push
        return waiter

    def _drop(self, waiter: asyncio.Future[None]) -> None:
        """A reader that leaves an idle stream must not leave its waiter behind."""
        self._waiters.pop(waiter, None)

    async def _produce(self) -> None:
        source = self._source
        now = self._loop.time
        start = self._start = now()
        self._running = True
        unyielded = 0
        read = source.read_batch
        observer = self._observer
        chunks = observer is not None and observer.chunks
        # Once under way, a source may push each read's batch to the log in the socket's
        # callback (no task woken per read); not while chunk hooks need awaiting.
        push = None if chunks else source.push_to
        take = self._take
        try:
            if self._cancel_with is not None:
                raise asyncio.CancelledError
            batch = await read()
            if source.meta is not self.info.meta:  # a fallback target answered
                self.info.meta = source.meta
            while batch:
                if chunks:
                    await observer.chunks_of(batch)  # type: ignore[union-attr]
                if not take(batch):
                    break
                if push is not None and (pushing := push(take)) is not None:
                    await pushing  # until the source stops pushing: its end, or take's no
                    if self._stopped:
                        break
                else:
                    unyielded += len(batch)
                    if unyielded >= 256:
                        unyielded = 0
                        await asyncio.sleep(0)  # a source that never waits must not starve writers
                batch = await read()
            terminal = self._terminal
        except asyncio.CancelledError:
            terminal = self._cancel_with or _error("stream_cancelled", "The stream was cancelled.")
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
        except GatewayError as exc:
            if not self.events:
                self.failure = exc
            terminal = exc.to_event()
        except Exception:
            log.exception("stream %s failed", self.id)
            terminal = _error(
                "internal_error",
                "The gateway failed while streaming; the response is incomplete.",
                retryable=True,
            )
        self._running = False
        self._settled = True  # the end is decided: cancel() must not cut the end hooks
        try:
            await source.close()
        except Exception:
            log.exception("closing the source of stream %s failed", self.id)
        finally:
            if source.meta is not self.info.meta:  # a target took it, then no event came
                self.info.meta = source.meta
            self.spend = self._spent(terminal)
            try:
                if observer is not None:
                    meta = observer.meta = self.info.meta
                    log_events = self.events
                    await observer.end(
                        terminal, now() - start, lambda: merge_events(log_events, meta), self.spend
                    )
                if self.on_end is not None:
                    await self.on_end(self)
            finally:
                self._finish(terminal, now() - start)

    def _take(self, batch: list[StreamEvent]) -> bool:
        """Log one read's ``batch`` and hand it to the readers; False once the log has its
        end (an :class:`Error` in the batch, or the log past ``max_log_bytes``): the run
        reads no more. Called in the run's task, or in the socket's callback when pushed."""
        added = _size(batch)
        if added < 0:
            batch, error, added = _without_terminals(batch)
            if error is not None:
                self._terminal = error
                self._stopped = True
        self.size += added
        self.events += batch
        if self.offsets is not None:
            self.offsets += [self._loop.time() - self._start] * len(batch)
        if self._waiters:
            self._wake(batch)
        if self._stopped:
            return False
        if self.size > self._max_log_bytes:
            self._terminal = _error(
                "stream_too_large",
                f"The stream passed the gateway's limit of {self._max_log_bytes} bytes "
                "([streams] max_log_bytes) and was ended.",
            )
            self._stopped = True
            return False
        return True

    def _spent(self, terminal: StreamEvent) -> Spend:
        """The stream's spend, from its log (once, at its end)."""
        if self._replayed:
            return NOTHING
        complete = terminal_ok(terminal)
        tallied = tally(self.events, complete=complete)
        return self._prices.spend(tallied, self.info.meta, complete=complete)

    def _finish(self, terminal: StreamEvent, offset: float) -> None:
        self.events.append(terminal)
        if self.offsets is not None:
            self.offsets.append(offset)
        self.finished = True
        self._disarm()
        self._watchdog.discard(self)
        self._wake()
        if not self._finished.done():
            self._finished.set_result(None)
        if self.on_finish is not None:
            self.on_finish(self)

    def _wake(self, batch: list[StreamEvent] | None = None) -> None:
        """Hand ``batch`` (just logged) to the readers that take it, wake the others."""
        waiters = self._waiters
        self._waiters = kept = {}
        for waiter, push in waiters.items():
            if waiter.done():
                continue
            if push is not None and batch is not None and push(batch):
                kept[waiter] = push
            else:
                waiter.set_result(None)

    # Attachment.
    def _attach(self) -> None:
        self.attached += 1
        self._left_with = None
        self._disarm()

    def _detach(self, failed: Error | None = None) -> None:
        self.attached -= 1
        if self.attached == 0 and not self.finished:
            self._left_with = failed
            if self.info.resumable:
                self._arm()
            else:
                self._expire()  # nobody will come back for it: now, not after a timer

    @property
    def ending(self) -> bool:
        """Finished, or being cancelled: no new request should join it."""
        return self.finished or self._cancel_with is not None

    def _arm(self, wait: float | None = None) -> None:
        """Expire in ``wait`` seconds (by default, a resumable stream's wait for its
        readers)."""
        self._disarm()
        if wait is None:
            wait = self._detach_timeout_s
        if wait <= 0:
            self._expire()
        else:
            self._timer = self._loop.call_later(wait, self._expire)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        self._timer = None
        if self.attached or self.finished:
            return
        if self._held is None:
            self._abandon()
        else:
            self._lease_check = self._loop.create_task(self._check_lease(self._held))

    async def _check_lease(self, held: Held) -> None:
        """Readers elsewhere hold it: expire again when their lease would lapse (a reader
        that leaves there sets it to lapse when the stream may end for its sake)."""
        try:
            left, made_resumable = await held(self.info.resumable)
        except GatewayError as exc:  # the store down: nobody elsewhere can read it now
            log.warning("stream %s: its readers elsewhere cannot be counted: %s", self.id, exc.code)
            left, made_resumable = 0.0, False
        except Exception:
            log.exception("checking the lease of stream %s failed", self.id)
            left, made_resumable = 0.0, False
        # A reader that came (and maybe left, arming a new timer) meanwhile decides instead.
        if self.attached or self.finished or self._timer is not None:
            return
        if made_resumable and not self.info.resumable:
            # A resumable request elsewhere joined it: its last reader here just left.
            self.info.resumable = True
            left = max(left, self._detach_timeout_s)
        if left > 0:
            self._arm(left)
        else:
            self._abandon()

    def _abandon(self) -> None:
        """Nobody reads it any more: cancel it, saying why."""
        if self.info.resumable:
            self.cancel(
                _error(
                    "stream_detached",
                    f"No client was attached for {self._detach_timeout_s:g}s "
                    "([streams] detach_timeout_s); the stream was cancelled.",
                )
            )
        elif self._left_with is not None:
            # Its last client's response failed in the gateway (its encoder): the
            # stream's hooks hear the error that client's access line tells.
            self.cancel(self._left_with)
        else:
            self.cancel(CLIENT_GONE)


MAX_BATCH = 256
"""Most events a reader returns at once. Live batches are what upstream delivered
together and are smaller; a backlog (a late attach, a resume, a replay) comes in
slices of this many, so that a connection renders and holds a slice, not a log."""
