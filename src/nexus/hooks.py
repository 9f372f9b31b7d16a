"""Lifecycle hooks and middleware: what plugins see of each stream, and what wraps the engine.

Hooks
    A plugin is any object with some of these four async methods::

        async def on_stream_started(self, ctx, request_id, model, provider): ...
        async def on_chunk_received(self, ctx, request_id, kind, byte_size): ...
        async def on_stream_completed(self, ctx, request_id, model, provider, elapsed, final,
                                      *, spend): ...
        async def on_stream_failed(self, ctx, request_id, model, error, *, spend): ...

    ``ctx``: the request's :class:`CallContext` (one object for all its hooks).
    ``request_id``: the stream id (``GET /v1/streams/{id}``). ``model``: as asked
    (an alias stays an alias). ``provider``: in ``on_stream_started``, the first
    target; in the end hooks, the target that answered, after fallbacks. ``kind``:
    the event's type tag; ``byte_size``: the length of its JSON form. ``elapsed``:
    seconds. ``final``: the merged :class:`~nexus.types.Completion` (shared: do not
    mutate it; empty but for its id, model and creation time when every plugin's
    class sets ``wants_final = False``). ``error``: the :class:`~nexus.events.Error`
    the stream ended with (an abort is ``stream_cancelled``; a stream that was not
    resumable, cancelled as its last client left, ``client_disconnect``). ``spend``:
    the stream's :class:`~nexus.pricing.Spend` (``estimated=True`` for one that ended
    before its final usage; zero for a cache hit), passed only to methods that take
    ``spend`` (or ``**kwargs``).

    Raising :class:`StreamRejected` from ``on_stream_started`` refuses the request
    (an HTTP error, even for a background request). Any other exception from a hook
    (``SystemExit`` included), a call past its plugin's ``timeout_s`` or a
    ``CancelledError`` of its own is logged, counted in :attr:`Hooks.errors`, and the
    stream goes on (:mod:`nexus.hook_calls`), except that an ``on_stream_started`` past
    its ``timeout_s`` refuses the request. Plain (not ``async``) methods are refused
    when the plugin is added. Hooks run inline, in registration order (the
    server's own budgets and metrics first): a slow hook slows its stream. ``on_chunk_received``
    runs for every Nth data event (``chunk_every``). A stream ends with exactly one
    of ``on_stream_completed`` / ``on_stream_failed``.

    They fire for every caller: :meth:`StreamObserver.watch` wraps the stream being
    read (by a run of the server's hub, or by the Python caller of the engine). The
    server calls ``on_stream_started`` for every request, replays and joins
    included; a join makes no stream, so it gets no other hook. A run's end hooks
    have run before its last entry reaches its readers (a budget is up to date for
    the client's next request).

Middleware
    ``async def middleware(ctx, request, call_next) -> Stream`` wraps the engine for
    streaming and non-streaming calls alike, the first one outermost. It may return
    ``await call_next(other)`` with a changed copy of the request (never mutate it),
    raise a :class:`~nexus.errors.GatewayError` to refuse, or wrap the stream
    (:func:`map_stream`). With ``[cache]`` on, the key is the request as sent and a
    recording holds what the middleware returned: a hit replays it without calling
    the middleware; a join passes the middleware, then reads the other's output. A
    refusal that must hold for hits belongs in ``on_stream_started``.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import Counter
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson

from .errors import ConfigError, GatewayError, RegistryFrozen
from .events import Done, Error, StreamEvent
from .hook_calls import AFTER_FAILURE, HOOK_TIMEOUT_S, guarded, is_async, takes_spend
from .pricing import UNKNOWN, PriceTable, Spend, Tally, terminal_ok
from .request import ChatRequest
from .stream import Merger, Stream, map_stream
from .types import Completion, StreamMeta

if TYPE_CHECKING:
    from .config import PluginConfig

__all__ = [
    "CallContext",
    "Hooks",
    "Middleware",
    "Next",
    "StreamObserver",
    "StreamRejected",
    "map_stream",
]

log = logging.getLogger("nexus.hooks")

HOOK_NAMES = ("on_stream_started", "on_chunk_received", "on_stream_completed", "on_stream_failed")


def _new_request_id() -> str:
    return "req_" + os.urandom(12).hex()


@dataclass(slots=True)
class CallContext:
    """What hooks and middleware know of the call beyond the request itself.

    ``request_id`` is the call's id (the HTTP ``X-Request-Id``; a new one when
    not given), ``key`` the name of the API key used (None without auth),
    ``endpoint`` the route (``"/v1/messages"``; empty from Python), ``format``
    the media type of the response. ``metadata`` is for plugins and middleware
    to share whatever they like along one call.
    """

    request_id: str = field(default_factory=_new_request_id)
    key: str | None = None
    endpoint: str = ""
    format: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)


class StreamRejected(GatewayError):
    """Raised by ``on_stream_started`` to refuse a request (policy, budgets).

    403 ``stream_rejected`` unless given others: ``StreamRejected("Monthly
    budget spent.", code="budget_exceeded", status=429)``. ``error_type``
    follows the status unless given (429: ``rate_limit_error``, 400:
    ``invalid_request_error``, else ``permission_error``).
    """

    status = 403
    code = "stream_rejected"
    error_type = "permission_error"

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        status: int | None = None,
        error_type: str | None = None,
        param: str | None = None,
        retryable: bool | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(
            message, code=code, status=status, param=param, retryable=retryable, headers=headers
        )
        if error_type is not None:
            self.error_type = error_type
        elif status is not None:
            self.error_type = _REJECTION_TYPES.get(status, "permission_error")


_REJECTION_TYPES = {429: "rate_limit_error", 400: "invalid_request_error"}


Next = Callable[[ChatRequest], Awaitable[Stream]]
"""The rest of the pipeline: the next middleware, at the end the engine."""

Middleware = Callable[[CallContext, ChatRequest, Next], Awaitable[Stream]]
"""``async def middleware(ctx, request, call_next) -> Stream`` (see the module docstring)."""

StartedHook = Callable[[CallContext, str, str, str], Awaitable[object]]
ChunkHook = Callable[[CallContext, str, str, int], Awaitable[object]]
CompletedHook = Callable[..., Awaitable[object]]
FailedHook = Callable[..., Awaitable[object]]


_ABORTED = Error(
    error_type="server_error",
    message="The client aborted the stream.",
    code="stream_cancelled",
)
_CLOSED = Error(
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


class Hooks:
    """The registered plugins and their hooks; see the module docstring.

    Register with :meth:`add` (Python) or :meth:`load` (``[[plugins]]``), before
    the engine starts: it freezes then. ``errors`` counts hooks that raised,
    by hook name; ``on_error`` callbacks hear of each as it happens (metrics).
    """

    def __init__(self) -> None:
        self.plugins: list[object] = []
        self.errors: Counter[str] = Counter()
        self.on_error: list[Callable[[str], None]] = []
        # (plugin name, method, [chunk_every,] [takes spend,] timeout_s)
        self._started: list[tuple[str, StartedHook, float | None]] = []
        self._chunk: list[tuple[str, ChunkHook, int, float | None]] = []
        self._completed: list[tuple[str, CompletedHook, bool, float | None]] = []
        self._failed: list[tuple[str, FailedHook, bool, float | None]] = []
        self._leading: Counter[str] = Counter()  # entries added with first=True, per list
        self._final = False  # a completed hook uses the merged completion
        self._frozen = False

    def __bool__(self) -> bool:
        return bool(self.plugins)

    def __len__(self) -> int:
        return len(self.plugins)

    def add(
        self,
        plugin: object,
        chunk_every: int = 1,
        *,
        name: str | None = None,
        timeout_s: float | None = HOOK_TIMEOUT_S,
        first: bool = False,
    ) -> None:
        """Register ``plugin``: each of the four hook methods it has is called.

        ``chunk_every``: call its ``on_chunk_received`` for every Nth chunk of a stream.
        ``name`` (for logs) defaults to its class name. ``timeout_s``: how long one of its
        calls may take (None: no bound). ``first``: its hooks run before those of the
        plugins not added so (the server's budgets and metrics: no plugin can keep a stream
        from being charged and counted). Raises :class:`TypeError` for an object with none
        of the hooks (or one not callable, or not ``async``), a class, or an ``on_*`` name
        that is no hook (misspelt); :class:`ValueError` for ``chunk_every < 1``;
        :class:`~nexus.errors.RegistryFrozen` once the engine started."""
        if self._frozen:
            raise RegistryFrozen(
                "Plugins must be added before the engine starts (the hooks froze at start-up)."
            )
        if chunk_every < 1:
            raise ValueError(f"chunk_every must be at least 1, not {chunk_every!r}")
        if isinstance(plugin, type):  # its hooks would be unbound: each call a TypeError
            raise TypeError(f"plugin {plugin.__qualname__} is a class: add an instance of it")
        label = name or type(plugin).__qualname__
        unknown = [n for n in dir(plugin) if n.startswith("on_") and n not in HOOK_NAMES]
        if unknown:  # a misspelt hook would never be called
            raise TypeError(f"plugin {label}: {', '.join(unknown)} is none of {HOOK_NAMES}")
        methods = {n: getattr(plugin, n, None) for n in HOOK_NAMES}
        found = {n: m for n, m in methods.items() if m is not None}
        if not found:
            raise TypeError(f"plugin {label} has none of the hooks {', '.join(HOOK_NAMES)}")
        for hook_name, method in found.items():
            if not callable(method):
                raise TypeError(f"plugin {label}: {hook_name} is not callable")
            if not is_async(method):
                raise TypeError(
                    f"plugin {label}: {hook_name} must be a coroutine function (async def); "
                    "hooks are awaited"
                )
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s must be more than 0, not {timeout_s!r}")
        self.plugins.insert(self._leading["plugins"] if first else len(self.plugins), plugin)

        def place(hooks: list[Any], hook: str, entry: tuple[Any, ...]) -> None:
            hooks.insert(self._leading[hook] if first else len(hooks), entry)
            self._leading[hook] += first

        if "on_stream_started" in found:
            place(self._started, "started", (label, found["on_stream_started"], timeout_s))
        if "on_chunk_received" in found:
            entry = (label, found["on_chunk_received"], chunk_every, timeout_s)
            place(self._chunk, "chunk", entry)
        if "on_stream_completed" in found:
            method = found["on_stream_completed"]
            place(self._completed, "completed", (label, method, takes_spend(method), timeout_s))
            self._final = self._final or getattr(plugin, "wants_final", True) is not False
        if "on_stream_failed" in found:
            method = found["on_stream_failed"]
            place(self._failed, "failed", (label, method, takes_spend(method), timeout_s))
        self._leading["plugins"] += first

    def load(self, configs: Iterable[PluginConfig], source: str | None = None) -> None:
        """Add the plugins ``[[plugins]]`` describes, in order.

        ``path = "module:attr"`` names a plugin object, or a class or factory
        that is called with ``options`` as keyword arguments. Raises
        :class:`~nexus.errors.ConfigError` naming ``[[plugins]] #N path`` when it
        cannot be imported, built or registered.
        """
        from .encoders.registry import load_object

        for number, config in enumerate(configs, 1):
            where = f"[[plugins]] #{number} path"
            if source:
                where = f"{source}: {where}"
            obj = load_object(config.path, where)
            if isinstance(obj, type) or (
                callable(obj) and not any(hasattr(obj, n) for n in HOOK_NAMES)
            ):
                try:
                    obj = obj(**config.options)
                except Exception as exc:
                    raise ConfigError(
                        f"{where}: {config.path!r} could not be built with its options: "
                        f"{type(exc).__name__}: {exc}"
                    ) from None
            elif config.options:
                raise ConfigError(
                    f"{where}: {config.path!r} is a plugin object already; it takes no options"
                )
            try:
                self.add(obj, config.chunk_every, name=config.path, timeout_s=config.timeout_s)
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"{where}: {exc}") from None

    def freeze(self) -> None:
        """No more plugins from now on (the engine calls it when it starts)."""
        self._frozen = True

    def _failure(self, plugin: str, hook: str) -> Callable[[str, bool], None]:
        """What :func:`~nexus.hook_calls.guarded` tells of one failed call: counted, logged
        with what follows from it (an abandoned ``on_stream_started`` refuses its request:
        :meth:`started`)."""

        def failed(what: str, abandoned: bool) -> None:
            self.errors[hook] += 1
            for listener in self.on_error:
                listener(hook)
            then = AFTER_FAILURE[hook]
            if abandoned and hook == "on_stream_started":
                then = "the request is refused (503 plugin_timeout)"
            log.error("plugin %s %s in %s; %s", plugin, what, hook, then, exc_info=not abandoned)

        return failed

    async def started(self, stream: Stream, ctx: CallContext) -> None:
        """Call every ``on_stream_started`` for ``stream`` (the engine's, and the hub's
        for every stream it opens, replays and joins included). Raises the
        :class:`StreamRejected` one raised, and 503 ``plugin_timeout`` for one that did not
        return in time: a gate that cannot decide (its quota or moderation backend slow)
        must not let the request through. Refused, ``stream`` is closed unread."""
        if not self._started:
            return
        try:
            await self._call_started(ctx, stream.meta)
        except BaseException:
            await stream.close()
            raise

    async def _call_started(self, ctx: CallContext, meta: StreamMeta) -> None:
        request_id, model, provider = meta.id, meta.model, meta.provider
        for name, hook, timeout in self._started:
            failed = self._failure(name, "on_stream_started")
            call = lambda: hook(ctx, request_id, model, provider)  # noqa: E731, B023
            if await guarded(call, timeout, failed, StreamRejected):
                raise GatewayError(
                    f"The plugin {name!r} did not decide on this request in time; retry.",
                    code="plugin_timeout",
                    status=503,
                    retryable=True,
                    headers={"Retry-After": "1"},
                )

    def observe(self, ctx: CallContext, meta: StreamMeta) -> StreamObserver | None:
        """The observer of one stream, or None when no plugin watches streams."""
        if self._chunk or self._completed or self._failed:
            return StreamObserver(self, ctx, meta)
        return None

    def observed(self, stream: Stream, ctx: CallContext, prices: PriceTable) -> Stream:
        """``stream`` with its chunk and end hooks firing as it is read
        (:meth:`StreamObserver.watch`; its spend priced with ``prices``, those of the
        engine that made it: one :class:`Hooks` may serve engines with different prices);
        ``stream`` itself when no plugin watches streams."""
        observer = self.observe(ctx, stream.meta)
        return stream if observer is None else observer.watch(stream, prices)


class StreamObserver:
    """One stream's hook calls: its chunk count, its end. Made by :meth:`Hooks.observe`.

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
        ``prices``; closed before its end (or cancelled) it ends with ``stream_cancelled``."""
        link: list[Stream] = []  # the outer stream, until its meta is settled
        outer = Stream.of_batches(_observe(stream, self, link, prices), stream.meta)
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
        with the stream's ``spend``."""
        hooks = self._hooks
        meta = self.meta
        error: Error | None = None
        if type(terminal) is Error:
            error = terminal
        elif type(terminal) is Done and terminal.aborted:
            error = _ABORTED
        if error is not None:
            for name, hook, takes, timeout in hooks._failed:
                args = (self.ctx, meta.id, meta.model, error)
                kwargs = {"spend": spend} if takes else {}
                call = lambda: hook(*args, **kwargs)  # noqa: E731, B023
                await guarded(call, timeout, hooks._failure(name, "on_stream_failed"))
            return
        if not hooks._completed:
            return
        completion = final() if self.wants_final else _no_final(meta)()
        for name, hook, takes, timeout in hooks._completed:
            ended = (self.ctx, meta.id, meta.model, meta.provider, elapsed, completion)
            kwargs = {"spend": spend} if takes else {}
            call = lambda: hook(*ended, **kwargs)  # noqa: E731, B023
            await guarded(call, timeout, hooks._failure(name, "on_stream_completed"))


async def _observe(
    source: Stream, observer: StreamObserver, link: list[Stream], prices: PriceTable
) -> AsyncGenerator[list[StreamEvent], None]:
    loop = asyncio.get_running_loop()
    start = loop.time()
    merger = Merger(source.meta) if observer.wants_final else None
    chunks = observer.chunks
    terminal: StreamEvent | None = None
    tallied = Tally()
    count = tallied.add
    try:
        while batch := await source.read_batch():
            if chunks:
                await observer.chunks_of(batch)
            for event in batch:
                cls = type(event)
                if cls is Error:
                    terminal = event
                elif cls is not Done:
                    count(event)
                    if merger is not None:
                        merger.add(event)
            if link:
                link.pop().meta = observer.meta = source.meta  # the target that answered
            yield batch
    except GatewayError as exc:
        terminal = terminal or exc.to_event()
        raise
    except Exception:
        terminal = terminal or _BROKEN
        raise
    except BaseException:  # closed before the end (GeneratorExit), or cancelled
        terminal = terminal or _CLOSED
        raise
    finally:
        link.clear()
        try:
            await source.close()
        finally:
            end = terminal or Done()
            meta = observer.meta = source.meta
            spend = prices.spend(tallied, meta, complete=terminal_ok(end))
            await observer.end(
                end,
                loop.time() - start,
                merger.result if merger is not None else _no_final(meta),
                spend,
            )


def _no_final(meta: StreamMeta) -> Callable[[], Completion]:
    return lambda: Completion(id=meta.id, model=meta.model, created=meta.created)
