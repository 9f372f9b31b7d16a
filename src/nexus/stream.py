"""The consumer side of a completion: :class:`Stream`, :class:`Channel`, :func:`accumulate`.

A :class:`Stream` is pull-based: nothing is produced until it is read, and
reading slowly slows the provider down (memory stays bounded). Three ways to
read one::

    async with engine.complete_stream(request) as stream:
        async for event in stream:              # 1. iterate
            ...

    event = await stream.next()                 # 2. step; raises EndOfStream at the end

    async with stream.channel(buffer=32) as ch: # 3. a bounded queue filled by a task
        async for event in ch:
            ...

End of stream is not an event: iteration stops, and ``next()`` raises
:class:`EndOfStream`. A failure after the stream started arrives as an
:class:`~nexus.events.Error` event, always the last one. ``close()`` stops the
provider at once (its cleanup runs before ``close()`` returns) and is safe to
call twice. A stream dropped before its end without ``close()`` has its source
closed on its event loop when it is collected (soon, not at once), with a
``ResourceWarning``, as asyncio does for a transport left open.
"""

from __future__ import annotations

import asyncio
import contextlib
import warnings
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from types import TracebackType
from typing import Any, Protocol

from .errors import StreamError
from .events import Error, StreamEvent
from .merger import Merger, merge_events
from .types import Completion, StreamMeta

__all__ = [
    "Batches",
    "Channel",
    "EndOfStream",
    "Merger",
    "Stream",
    "accumulate",
    "map_stream",
    "merge_events",
]


class Batches(Protocol):
    """What :meth:`Stream.of_batches` reads: lists of events, one per upstream read. An
    async generator is one; an object whose ``__anext__`` is a plain coroutine is cheaper
    per step (no generator layer to resume). ``aclose()`` releases what it holds.

    A provider's may say ``accepted`` (true once the upstream took the request): a stream
    closed before its first event is then charged its prompt's estimate, or the
    ``prompt_usage`` (a :class:`~nexus.events.Usage`) the upstream said before any event;
    and ``response_model``, the model the upstream said answered (for the attempt's span).

    And it may ``push_to(sink)``: from then on, call ``sink(batch)`` with each read's
    events as they arrive (in the socket's callback: no task woken per read) while the sink
    returns true, and give a future that is done when the pushing stops (the end, an
    error, a batch it leaves to ``__anext__``, the sink's no); ``__anext__`` then says
    what came. None when it cannot push now: read it. A layer between a reader and the
    upstream pushes through only what it would return from ``__anext__`` unchanged."""

    def __aiter__(self) -> AsyncIterator[list[StreamEvent]]: ...

    def __anext__(self) -> Awaitable[list[StreamEvent]]: ...

    def aclose(self) -> Awaitable[object]: ...


class EndOfStream(Exception):
    """Raised by :meth:`Stream.next` and :meth:`Channel.next` when no event is left."""


class Stream:
    """One completion's events, in order. Single reader; not restartable.

    Made from an async generator of events, or (:meth:`of_batches`) of lists of
    events, one per upstream read (:class:`Batches`): :meth:`read_batch` hands such a list over in
    one step, which is how the gateway reads (one step per read, not per token).
    """

    __slots__ = (
        "_at",
        "_batch",
        "_batched",
        "_close_cancels",
        "_closing",
        "_ended",
        "_events",
        "_loop",
        "_read_done",
        "_reader",
        "meta",
    )

    def __init__(self, events: AsyncGenerator[StreamEvent, None], meta: StreamMeta) -> None:
        self._events: AsyncGenerator[Any, None] | Batches = events
        self._batched = False
        self._batch: list[StreamEvent] = []
        self._at = 0
        self._closing = False
        self._ended = False  # its source ended (or raised): nothing of it is left to close
        self._close_cancels = 0
        self._reader: asyncio.Task[object] | None = None
        self._read_done: asyncio.Future[None] | None = None
        self.meta = meta
        try:  # where a stream dropped unclosed has its source closed (see __del__)
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None

    def __del__(self) -> None:
        """Dropped before its end and unclosed (``async for ...: break``): its source
        (the upstream connection, its end hooks) is closed on its loop, as asyncio closes
        an async generator dropped unfinished; then a ``ResourceWarning`` says so."""
        if self._closing or self._ended:
            return
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        loop.call_soon_threadsafe(_close_dropped, self._events)
        warnings.warn(
            f"stream {self.meta.id} was not closed: close it, or read it in 'async with'",
            ResourceWarning,
            stacklevel=1,
            source=self,
        )

    @classmethod
    def of_batches(cls, batches: Batches, meta: StreamMeta) -> Stream:
        """A stream read from lists of events (empty lists are skipped)."""
        stream = cls(batches, meta)  # type: ignore[arg-type]
        stream._batched = True
        return stream

    def __aiter__(self) -> Stream:
        return self

    async def __anext__(self) -> StreamEvent:
        batch = self._batch
        at = self._at
        if at >= len(batch):
            batch = await self.read_batch()
            if not batch:
                raise StopAsyncIteration
            self._batch = batch
            at = 0
        self._at = at + 1
        return batch[at]

    async def read_batch(self) -> list[StreamEvent]:
        """The next events, at least one, as they arrived together; ``[]`` at the end."""
        batch: list[StreamEvent] = self._batch
        if self._at < len(batch):
            batch = batch[self._at :]
            self._batch = []
            self._at = 0
            return batch
        self._reader = asyncio.current_task()
        events = self._events
        try:
            while True:
                item: Any = await events.__anext__()
                if not self._batched:
                    return [item]
                if item:
                    return item  # type: ignore[no-any-return]
        except StopAsyncIteration:
            self._ended = True
            return []
        except asyncio.CancelledError:
            if not self._closed_under_reader():
                raise
        except Exception:
            self._ended = True  # (a source that raised is over)
            raise
        finally:
            self._reader = None  # no read under way
            if self._read_done is not None and not self._read_done.done():
                self._read_done.set_result(None)
        return []  # close() from another task ended this read (the stream ends)

    def push_to(self, sink: Callable[[list[StreamEvent]], bool]) -> asyncio.Future[None] | None:
        """Have the source push each read's events to ``sink`` as they arrive, while it
        returns true, instead of waiting to be read (see :class:`Batches`); the future is
        done when it stops, and :meth:`read_batch` then goes on. None when the source
        cannot (or has something to read now): read on."""
        if not self._batched or self._at < len(self._batch) or self._closing:
            return None
        push = getattr(self._events, "push_to", None)
        return None if push is None else push(sink)

    async def next(self) -> StreamEvent:
        """The next event. Raises :class:`EndOfStream` when the stream is over."""
        try:
            return await self.__anext__()
        except StopAsyncIteration:
            raise EndOfStream from None

    def _closed_under_reader(self) -> bool:
        """Whether this read was cancelled by close() alone (then it ends the stream).

        Only the cancellations close() issued are withdrawn: a cancellation from
        anywhere else still propagates.
        """
        task = self._reader
        if not self._close_cancels or task is None:
            return False
        for _ in range(self._close_cancels):
            task.uncancel()
        self._close_cancels = 0
        return task.cancelling() == 0

    async def close(self) -> None:
        """Stop the stream and the provider behind it; idempotent.

        Safe from another task while a read is in progress: that read ends
        the stream (``StopAsyncIteration`` / :class:`EndOfStream`).
        """
        self._closing = True
        self._batch = []
        self._at = 0
        events = self._events
        reader = self._reader  # a read under way
        if reader is not None and reader is not asyncio.current_task():
            self._read_done = asyncio.get_running_loop().create_future()
            self._close_cancels += 1
            reader.cancel()
            await self._read_done
        await events.aclose()

    async def __aenter__(self) -> Stream:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    def channel(self, buffer: int = 32) -> Channel:
        """Read this stream through a bounded queue filled by a background task.

        The task reads ahead by at most ``buffer`` events. Must be called from
        a running event loop.
        """
        return Channel(self, buffer)


_END = object()


class Channel:
    """A bounded queue over a :class:`Stream` (see :meth:`Stream.channel`).

    Iterate it or call :meth:`next`; an exception raised by the producer side
    is re-raised to the reader after the events before it. ``close()`` stops
    the filling task and closes the stream.
    """

    def __init__(self, stream: Stream, buffer: int = 32) -> None:
        if buffer < 1:
            raise ValueError("buffer must be at least 1")
        self._stream = stream
        self._queue: asyncio.Queue[object] = asyncio.Queue(buffer)
        self._failure: list[BaseException] = []  # the producer's exception, once
        self._done = False
        # The task holds the stream and the queue, not the channel: a channel dropped
        # without close() is collected, and its task cancelled, which closes the stream
        # (the upstream connection goes, the end hooks run).
        self._task = asyncio.get_running_loop().create_task(
            _fill(stream, self._queue, self._failure)
        )
        weakref.finalize(self, _drop, self._task)

    @property
    def meta(self) -> StreamMeta:
        return self._stream.meta

    def __aiter__(self) -> Channel:
        return self

    async def __anext__(self) -> StreamEvent:
        try:
            return await self.next()
        except EndOfStream:
            raise StopAsyncIteration from None

    async def next(self) -> StreamEvent:
        """The next event. Raises :class:`EndOfStream` at the end."""
        if self._done:
            raise EndOfStream
        item = await self._queue.get()
        if item is _END:
            self._done = True
            if self._failure:
                raise self._failure[0]
            raise EndOfStream
        return item  # type: ignore[return-value]

    async def close(self) -> None:
        self._done = True
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        # Wake a reader blocked in next() from another task: it gets the end.
        while True:
            try:
                self._queue.put_nowait(_END)
                break
            except asyncio.QueueFull:
                self._queue.get_nowait()
        await self._stream.close()

    async def __aenter__(self) -> Channel:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


def map_stream(stream: Stream, fn: Callable[[StreamEvent], StreamEvent | None]) -> Stream:
    """A stream of ``fn(event)`` for each event of ``stream`` (None drops the event).

    Same ``meta``; closing it closes ``stream``. For a middleware that edits
    or filters what the client gets::

        async def redact(ctx, request, call_next):
            return map_stream(await call_next(request), scrub)
    """
    link: list[Stream] = []  # the outer stream, until its meta is settled
    outer = Stream.of_batches(_mapped(stream, fn, link), stream.meta)
    link.append(outer)
    return outer


async def _mapped(
    stream: Stream, fn: Callable[[StreamEvent], StreamEvent | None], link: list[Stream]
) -> AsyncGenerator[list[StreamEvent], None]:
    try:
        while batch := await stream.read_batch():
            if link:
                link.pop().meta = stream.meta  # the target that answered (after fallbacks)
            out: list[StreamEvent] = []
            try:
                for event in batch:
                    mapped = fn(event)
                    if mapped is not None:
                        out.append(mapped)
            except BaseException:
                if out:
                    yield out  # the events before the one fn failed on still go out
                raise
            if out:
                yield out
    finally:
        link.clear()
        await stream.close()


async def _fill(stream: Stream, queue: asyncio.Queue[object], failure: list[BaseException]) -> None:
    """A :class:`Channel`'s task: ``stream`` into ``queue``, then the end marker."""
    try:
        async for event in stream:
            await queue.put(event)
    except asyncio.CancelledError:
        await stream.close()  # closed, or its channel dropped: the provider stops now
        raise
    except Exception as exc:
        failure.append(exc)
    await queue.put(_END)


_DROPPED: set[asyncio.Task[object]] = set()  # sources being closed for dropped streams


def _close_dropped(source: AsyncGenerator[Any, None] | Batches) -> None:
    """Close the source of a :class:`Stream` that was collected unclosed (its loop's
    callback)."""
    task: asyncio.Task[object] = asyncio.ensure_future(source.aclose())
    _DROPPED.add(task)
    task.add_done_callback(_DROPPED.discard)


def _drop(task: asyncio.Task[None]) -> None:
    """A :class:`Channel` was collected: stop its task, if its loop still runs, and say so
    (as a :class:`Stream` dropped unclosed does)."""
    if not task.done() and not task.get_loop().is_closed():
        task.get_loop().call_soon_threadsafe(task.cancel)
        message = "a channel was not closed: close it, or read it in 'async with'"
        warnings.warn(message, ResourceWarning, stacklevel=1)


async def accumulate(stream: Stream | Channel) -> Completion:
    """Read ``stream`` to its end and merge it into one :class:`~nexus.types.Completion`.

    Content and reasoning are concatenated (and kept block by block, each with its
    signature, in ``reasoning_blocks``), tool calls merged by index (and by id when a
    fragment repeats one; a fragment with a new id for an index whose call has another
    begins a call of its own), usage is taken from the last usage event.
    The stream is closed afterwards. Raises :class:`~nexus.errors.StreamError`
    when the stream carries an :class:`~nexus.events.Error` event, and
    :class:`RuntimeError` for a stream already read to its end, or closed (a stream
    cannot be restarted: it would merge into an empty completion).
    """
    read = stream._done if isinstance(stream, Channel) else stream._ended or stream._closing
    if read:
        raise RuntimeError(
            f"stream {stream.meta.id} already read (or closed): a stream is read once"
        )
    merger = None  # made at the first event: a stream's meta may be settled by its opening
    async with stream:
        async for event in stream:
            if type(event) is Error:
                raise StreamError(event)
            if merger is None:
                merger = Merger(stream.meta)
            merger.add(event)
    return (merger or Merger(stream.meta)).result()
