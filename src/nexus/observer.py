"""One stream's hook calls: :class:`StreamObserver`, made by :meth:`Hooks.observe
<nexus.hooks.Hooks.observe>` (the hooks themselves are told in :mod:`nexus.hooks`).

Its driver calls :meth:`StreamObserver.chunks_of` for each read and
:meth:`StreamObserver.end` once: a run of the server's hub, or, for a stream read from
Python, :meth:`StreamObserver.watch`. A watched stream ends with its end hooks however it
ends: read to its end, failed, closed (read or not), cancelled, or dropped unclosed (a
:class:`~nexus.stream.Stream` collected so closes its source).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

import orjson

from .errors import GatewayError
from .events import Done, Error, StreamEvent
from .hook_calls import end_call, guarded, guarded_each
from .pricing import UNKNOWN, PriceTable, Spend, Tally, terminal_ok
from .stream import Merger, Stream
from .types import Completion, StreamMeta

if TYPE_CHECKING:
    from .hooks import CallContext, Hooks

__all__ = ["StreamObserver"]

_ABORTED = Error(
    error_type="server_error",
    message="The client aborted the stream.",
    code="stream_cancelled",
)
CLOSED = Error(
    error_type="server_error",
    message="The stream was closed before its end.",
    code="stream_cancelled",
)
_BROKEN = Error(
    error_type="server_error",
    message="The stream failed unexpectedly.",
    code="internal_error",
    retryable=True,
)


def failure_of(exc: BaseException) -> Error:
    """The error event a watched stream ended with when ``exc`` ended it: a gateway error's
    own, ``internal_error`` for a bug, ``stream_cancelled`` for a cancellation."""
    if isinstance(exc, GatewayError):
        return exc.to_event()
    return _BROKEN if isinstance(exc, Exception) else CLOSED


class StreamObserver:
    """One stream's hook calls: its chunk count, its end. Made by :meth:`Hooks.observe
    <nexus.hooks.Hooks.observe>`.

    Its driver calls :meth:`chunks_of` for each read (when :attr:`chunks`) and
    :meth:`end` once: a hub's run (:class:`~nexus.cache.run.StreamRun`), or
    :meth:`watch` for a stream read from Python.
    """

    __slots__ = ("_hooks", "_seen", "chunks", "ctx", "meta", "wants_final")

    def __init__(self, hooks: Hooks, ctx: CallContext, meta: StreamMeta) -> None:
        self._hooks = hooks
        self._seen = 0
        self.ctx = ctx
        self.meta = meta
        self.chunks = bool(hooks._chunk)
        """Some plugin watches chunks: else a read costs the observer nothing."""
        self.wants_final = hooks._final

    def watch(self, stream: Stream, prices: PriceTable) -> Stream:
        """``stream`` with the hooks firing as it is read, its spend priced with
        ``prices``; closed before its end (read or not), or cancelled, it ends with
        ``stream_cancelled``."""
        link: list[Stream] = []  # the outer stream, until its meta is settled
        outer = Stream.of_batches(_Watched(stream, self, link, prices), stream.meta)
        link.append(outer)
        return outer

    async def chunks_of(self, batch: list[StreamEvent]) -> None:
        """Count the data events of one read; call the chunk hooks whose turn it is."""
        for event in batch:
            cls = type(event)
            if cls is not Error and cls is not Done:
                await self._chunk(event)

    async def _chunk(self, event: StreamEvent) -> None:
        self._seen = seen = self._seen + 1
        size = -1
        for name, hook, every, timeout in self._hooks._chunk:
            if seen % every:
                continue
            if size < 0:
                size = len(orjson.dumps(event.to_dict()))
            failed = self._hooks._failure(name, "on_chunk_received")
            call = lambda: hook(self.ctx, self.meta.id, event.type, size)  # noqa: E731, B023
            await guarded(call, timeout, failed)

    async def end(
        self,
        terminal: StreamEvent,
        elapsed: float,
        final: Callable[[], Completion],
        spend: Spend = UNKNOWN,
    ) -> None:
        """Call the completed hooks (``final()`` merges the stream) or the failed ones,
        with the stream's ``spend``. Each plugin gets its one: a cancellation that comes
        meanwhile is raised after the last (:func:`~nexus.hook_calls.guarded_each`)."""
        hooks = self._hooks
        meta = self.meta
        error: Error | None = None
        if type(terminal) is Error:
            error = terminal
        elif type(terminal) is Done and terminal.aborted:
            error = _ABORTED
        if error is not None:
            await hooks._call_failed(self.ctx, meta, error, spend)
            return
        if not hooks._completed:
            return
        completion = final() if self.wants_final else _no_final(meta)()
        ended = (self.ctx, meta.id, meta.model, meta.provider, elapsed, completion)
        await guarded_each(
            (
                end_call(hook, ended, spend if takes else None),
                timeout,
                hooks._failure(name, "on_stream_completed"),
            )
            for name, hook, takes, timeout in hooks._completed
        )


class _Watched:
    """A watched stream's source (a :class:`~nexus.stream.Batches`): ``source`` read
    through, the hooks firing as it is; its end told once, however it comes, ``aclose()``
    before the first read included."""

    __slots__ = (
        "_link",
        "_merger",
        "_observer",
        "_over",
        "_prices",
        "_source",
        "_start",
        "_tallied",
        "_terminal",
    )

    def __init__(
        self, source: Stream, observer: StreamObserver, link: list[Stream], prices: PriceTable
    ) -> None:
        self._source = source
        self._observer = observer
        self._link = link
        self._prices = prices
        self._start = asyncio.get_running_loop().time()
        self._merger = Merger(source.meta) if observer.wants_final else None
        self._tallied = Tally()
        self._terminal: StreamEvent | None = None  # an Error event read
        self._over = False

    def __aiter__(self) -> _Watched:
        return self

    async def __anext__(self) -> list[StreamEvent]:
        if self._over:
            raise StopAsyncIteration
        try:
            batch = await self._source.read_batch()
            if batch:
                observer = self._observer
                if observer.chunks:
                    await observer.chunks_of(batch)
                merger = self._merger
                count = self._tallied.add
                for event in batch:
                    cls = type(event)
                    if cls is Error:
                        self._terminal = event
                    elif cls is not Done:
                        count(event)
                        if merger is not None:
                            merger.add(event)
                if self._link:  # the target that answered
                    self._link.pop().meta = observer.meta = self._source.meta
        except BaseException as exc:
            # a gateway error; a bug; closed before the end (from another task), or cancelled
            failure = failure_of(exc)
            await self._end(self._terminal or failure)
            raise
        if not batch:
            await self._end(self._terminal)
            raise StopAsyncIteration
        return batch

    async def aclose(self) -> None:
        await self._end(self._terminal or CLOSED)

    async def _end(self, terminal: StreamEvent | None) -> None:
        """Close the source, then call the end hooks (once)."""
        if self._over:
            return
        self._over = True
        self._link.clear()
        source = self._source
        try:
            await source.close()
        finally:
            end = terminal or Done()
            observer = self._observer
            meta = observer.meta = source.meta
            spend = self._prices.spend(self._tallied, meta, complete=terminal_ok(end))
            merger = self._merger
            await observer.end(
                end,
                asyncio.get_running_loop().time() - self._start,
                merger.result if merger is not None else _no_final(meta),
                spend,
            )


def _no_final(meta: StreamMeta) -> Callable[[], Completion]:
    return lambda: Completion(id=meta.id, model=meta.model, created=meta.created)
