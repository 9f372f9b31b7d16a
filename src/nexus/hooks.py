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
    (an HTTP error, even for a background request); the plugins told of its start
    before get ``on_stream_failed`` with the refusal. Any other exception from a hook
    (``SystemExit`` included), a call past its plugin's ``timeout_s`` or a
    ``CancelledError`` of its own is logged, counted in :attr:`Hooks.errors`, and the
    stream goes on (:mod:`nexus.hook_calls`), except that an ``on_stream_started`` past
    its ``timeout_s`` refuses the request. Plain (not ``async``) methods are refused
    when the plugin is added. Hooks run inline, in registration order (the
    server's own budgets and metrics first): a slow hook slows its stream. ``on_chunk_received``
    runs for every Nth data event (``chunk_every``). A stream ends with exactly one
    of ``on_stream_completed`` / ``on_stream_failed`` (:mod:`nexus.observer`), each
    plugin's called even when the caller is cancelled meanwhile.

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

import logging
import os
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .errors import ConfigError, GatewayError, RegistryFrozen
from .events import Error
from .hook_calls import (
    AFTER_FAILURE,
    HOOK_TIMEOUT_S,
    end_call,
    guarded,
    guarded_each,
    is_async,
    takes_spend,
)
from .observer import StreamObserver, failure_of
from .pricing import NOTHING, PriceTable, Spend
from .request import ChatRequest
from .stream import Stream, map_stream
from .types import StreamMeta

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
        # (plugin name, method, [chunk_every,] [takes spend,] timeout_s[, plugin])
        self._started: list[tuple[str, StartedHook, float | None, object]] = []
        self._chunk: list[tuple[str, ChunkHook, int, float | None]] = []
        self._completed: list[tuple[str, CompletedHook, bool, float | None]] = []
        self._failed: list[tuple[str, FailedHook, bool, float | None, object]] = []
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
            place(self._started, "started", (label, found["on_stream_started"], timeout_s, plugin))
        if "on_chunk_received" in found:
            entry = (label, found["on_chunk_received"], chunk_every, timeout_s)
            place(self._chunk, "chunk", entry)
        if "on_stream_completed" in found:
            method = found["on_stream_completed"]
            place(self._completed, "completed", (label, method, takes_spend(method), timeout_s))
            self._final = self._final or getattr(plugin, "wants_final", True) is not False
        if "on_stream_failed" in found:
            method = found["on_stream_failed"]
            ended = (label, method, takes_spend(method), timeout_s, plugin)
            place(self._failed, "failed", ended)
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

    def copy(self) -> Hooks:
        """These plugins in a new, unfrozen :class:`Hooks`: what is added to the copy is its
        own (an app's budgets and metrics, which a ``Hooks`` shared by engines must not
        hear of another engine's streams through). Its errors add up in :attr:`errors` of
        both; its ``on_error`` listeners are its own."""
        other = Hooks()
        other.errors = self.errors
        other.plugins = list(self.plugins)
        other._started, other._chunk = list(self._started), list(self._chunk)
        other._completed, other._failed = list(self._completed), list(self._failed)
        other._leading, other._final = self._leading.copy(), self._final
        return other

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
        must not let the request through. Refused, ``stream`` is closed unread, and the
        plugins told of the start before the one that refused get ``on_stream_failed``
        with the refusal (cancelled meanwhile: ``stream_cancelled``), ``spend`` nothing."""
        if not self._started:
            return
        told: list[object] = []  # the plugins called so far
        try:
            await self._call_started(ctx, stream.meta, told)
        except BaseException as exc:
            try:
                await stream.close()
            finally:
                await self._call_failed(ctx, stream.meta, failure_of(exc), NOTHING, told)
            raise

    async def given_up(self, ctx: CallContext, meta: StreamMeta, exc: BaseException) -> None:
        """The end of a stream whose start the plugins were told of, given up before it
        ran (the store failed as it was claimed): ``on_stream_failed`` with ``exc`` (a
        cancellation: ``stream_cancelled``), ``spend`` nothing. Each plugin gets its one."""
        await self._call_failed(ctx, meta, failure_of(exc), NOTHING)

    async def _call_started(self, ctx: CallContext, meta: StreamMeta, told: list[object]) -> None:
        request_id, model, provider = meta.id, meta.model, meta.provider
        for name, hook, timeout, plugin in self._started:
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
            told.append(plugin)  # (the one that refuses is not: it knows)

    async def _call_failed(
        self,
        ctx: CallContext,
        meta: StreamMeta,
        error: Error,
        spend: Spend,
        plugins: list[object] | None = None,
    ) -> None:
        """Call the ``on_stream_failed`` hooks of a stream that ended with ``error``: every
        plugin's, or those of ``plugins`` only (told of a refused request's start)."""
        args = (ctx, meta.id, meta.model, error)
        await guarded_each(
            (
                end_call(hook, args, spend if takes else None),
                timeout,
                self._failure(name, "on_stream_failed"),
            )
            for name, hook, takes, timeout, plugin in self._failed
            if plugins is None or any(plugin is one for one in plugins)
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
