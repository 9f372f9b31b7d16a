"""The engine: routes a request to a provider and hands back a :class:`~nexus.stream.Stream`.

A model id is an alias from ``[models."<alias>"]`` (its targets tried in order) or
``<provider>/<upstream model>``; anything else is :class:`~nexus.errors.ModelNotFound`.
The targets are tried, and the one that answered read, by :mod:`nexus.routed` (what a
provider's failure becomes is told there).

An engine serves the event loop it started on: its providers' connection pools belong
to that loop. A call from another loop raises :class:`RuntimeError` at once (start an
engine per loop, or per thread), and so does a call after :meth:`Engine.close`, or
before :meth:`Engine.start` when a provider has something to start (an HTTP one's
connection pool; the mock has none).

Middleware and hooks (:mod:`nexus.hooks`) run for every caller:
:meth:`Engine.open_stream` runs the middleware chain around the routed call, then
``on_stream_started``, and returns the stream the other hooks watch as it is read.
:meth:`Engine.complete_stream` is the same, started at the first read (so it stays
a plain call); :meth:`Engine.complete` accumulates it. The server's hub opens with
``observe=False`` and has the hooks watch its runs' sources instead.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, NoReturn

from .config_errors import in_file
from .errors import ConfigError, ModelNotFound, UnsupportedInput
from .estimates import prompt_audio_estimate, prompt_estimate
from .events import StreamEvent, Usage
from .hooks import CallContext, Hooks, Middleware, Next
from .pricing import Price, PriceTable, unpriced, worst_cost
from .protocol.openai_chat import validated
from .providers.base import Provider
from .providers.http import HTTPProvider
from .request import ChatRequest, input_kinds
from .routed import RoutedRun, Target
from .stream import Stream, accumulate
from .types import Completion, FailedAttempt, StreamMeta

if TYPE_CHECKING:
    from .telemetry import Telemetry

__all__ = ["Engine"]

log = logging.getLogger("nexus.engine")


class Engine:
    """Providers plus routing. Use as ``async with Engine(...)`` or call start()/close().

    ``hooks``: the plugins (:class:`~nexus.hooks.Hooks`; frozen when the engine
    starts). ``middleware``: wraps every call of :meth:`open_stream` and
    :meth:`complete`, the first one outermost.
    """

    def __init__(
        self,
        providers: Sequence[Provider] | Mapping[str, Provider],
        models: Mapping[str, Sequence[str]] | None = None,
        *,
        retry_ms: int | None = None,
        hooks: Hooks | None = None,
        middleware: Sequence[Middleware] = (),
        prices: PriceTable | None = None,
    ) -> None:
        if isinstance(providers, Mapping):
            for name, provider in providers.items():
                if name != provider.name:
                    raise ValueError(f"providers: {name!r} maps to the provider {provider.name!r}")
            providers = list(providers.values())
        self.providers: dict[str, Provider] = {p.name: p for p in providers}
        if len(self.providers) != len(providers) or any("/" in n for n in self.providers):
            raise ValueError(
                "providers: each needs a name of its own, without '/' (a model is "
                f"'<provider>/<model>'): {[p.name for p in providers]}"
            )
        self.aliases: dict[str, list[str]] = {k: list(v) for k, v in (models or {}).items()}
        self.retry_ms = retry_ms
        self.hooks = hooks if hooks is not None else Hooks()
        self.middleware: tuple[Middleware, ...] = tuple(middleware)
        self.prices = prices if prices is not None else PriceTable()
        """What each model costs (:mod:`nexus.pricing`); this engine's hook spends use it."""
        self.telemetry: Telemetry | None = None
        """A span per upstream attempt when set (:mod:`nexus.telemetry`; the app sets it)."""
        self.on_upstream_error: Callable[[str, str], None] | None = None
        """Called with the provider and the error code of every failed upstream attempt,
        those a fallback recovered from and those after output included (the app counts
        them in ``/metrics``)."""
        self._loop: asyncio.AbstractEventLoop | None = None  # the one it started on
        self.served = False
        """An app serves it (:func:`~nexus.server.create_app`, which adds its plugins)."""
        self._closed = False
        # An HTTP provider has its connection pool from start() to close() (the mock none).
        self._needs_start = any(isinstance(p, HTTPProvider) for p in providers)
        for alias, targets in self.aliases.items():
            if not targets:
                raise ValueError(f"models.{alias}: no target")
            for target in targets:
                if self._split(target) is None:
                    raise ValueError(
                        f"models.{alias}: target {target!r} names no configured provider"
                    )

    @classmethod
    def from_config(cls, config: Any, source: str | None = None) -> Engine:
        """Build the engine a :class:`~nexus.config.Config` describes, its ``[[plugins]]`` loaded.

        Raises :class:`~nexus.errors.ConfigError` for a plugin that cannot be loaded, an
        unset ``api_key_env``, or no provider left once the optional ones without their key
        were left out (the message starts with ``source``, the file, when given).
        """
        from .config import price_table
        from .providers import build_provider

        built = [build_provider(name, cfg, source) for name, cfg in config.providers.items()]
        providers = [p for p in built if p is not None]
        if not providers:  # it would serve, every request model_not_found
            raise ConfigError(
                in_file(
                    "[providers]: at least one provider is required, and every one is "
                    "optional = true with its api_key_env unset: all were left out",
                    source,
                )
            )
        names = {p.name for p in providers}
        models: dict[str, list[str]] = {}
        for alias, cfg in config.models.items():
            if cfg.targets is None:
                continue  # a '<provider>/<model>' price entry, not an alias
            targets = [t for t in cfg.targets if t.partition("/")[0] in names]
            if targets:
                models[alias] = targets
            else:
                log.warning("alias %r left out: none of its targets' providers is available", alias)
        hooks = Hooks()
        hooks.load(config.plugins, source)
        return cls(
            providers,
            models,
            retry_ms=config.server.retry_ms,
            hooks=hooks,
            prices=price_table(config),
        )

    async def start(self) -> None:
        """Start the providers (their connection pools) on the running loop; the engine
        serves it from then on, until :meth:`close` (it may be started again after).
        Raises :class:`RuntimeError` when it is started already: a second start would
        replace its pools with the first's connections still open."""
        if self._loop is not None and not self._closed:
            raise RuntimeError("this engine is started already: close it before starting it again")
        self.hooks.freeze()
        self._loop = asyncio.get_running_loop()
        self._closed = False
        started: list[Provider] = []
        try:
            for provider in self.providers.values():
                await provider.start()
                started.append(provider)
        except BaseException:
            for provider in started:
                await provider.close()
            self._loop = None  # not started: it may be started again
            raise

    async def close(self) -> None:
        self._closed = True
        self._loop = None
        for provider in self.providers.values():
            try:
                await provider.close()
            except Exception:
                log.exception("closing provider %s failed", provider.name)

    async def __aenter__(self) -> Engine:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def _split(self, model: str) -> Target | None:
        """``<provider>/<model>`` as a target; None when it names no provider."""
        name, slash, upstream = model.partition("/")
        provider = self.providers.get(name) if slash and upstream else None
        return None if provider is None else (provider, upstream)

    def route(self, model: str) -> list[Target]:
        """The targets for ``model`` in fallback order. Raises :class:`ModelNotFound`."""
        routed = [self._split(t) for t in self.aliases.get(model, [model])]
        targets = [t for t in routed if t is not None]
        if len(targets) < len(routed):
            raise ModelNotFound(
                f"The model {model!r} does not exist. Use '<provider>/<model>' with one of "
                f"the providers {sorted(self.providers)} or one of the aliases "
                f"{sorted(self.aliases)}.",
                param="model",
            )
        return targets

    def priced(self, model: str) -> bool:
        """Whether every target of ``model`` has a price, so that any stream it serves,
        after any fallback, has a cost to charge (a key with a budget needs one). An
        unknown model is True: routing refuses it with its own error."""
        return None not in self._target_prices(model)

    def hold_usd(self, request: ChatRequest) -> float:
        """A budget's hold for ``request`` (:func:`~nexus.pricing.worst_cost`); 0: unknown."""
        return worst_cost(request, self._target_prices(request.model))

    def unpriced(self, request: ChatRequest) -> tuple[str, str] | None:
        """What ``request`` asks for that its targets' prices do not cover, as
        (``param``, why) (:func:`~nexus.pricing.unpriced`); None: nothing."""
        return unpriced(request, self._target_prices(request.model))

    def _target_prices(self, model: str) -> list[Price | None]:
        try:
            targets = self.route(model)
        except ModelNotFound:
            return []
        price = self.prices.price
        return [price(f"{p.name}/{upstream}", model) for p, upstream in targets]

    def models(self) -> list[str]:
        """Model ids to advertise: aliases, then each provider's models."""
        ids = list(self.aliases)
        for provider in self.providers.values():
            ids.extend(f"{provider.name}/{m}" for m in provider.advertised_models())
        return ids

    def _targets(self, request: ChatRequest) -> list[Target]:
        """The targets that can take ``request``: its input, and every field that changes
        the answer (:meth:`Provider.refusal`). Raises :class:`ModelNotFound`,
        :class:`UnsupportedInput`, and the first target's refusal when none is left."""
        targets = self.route(request.model)
        needs = input_kinds(request)
        if needs and not (targets := [t for t in targets if needs <= t[0].accepts]):
            raise UnsupportedInput(
                f"The model {request.model!r} cannot take {' and '.join(sorted(needs))} input."
            )
        refusals = [provider.refusal(request) for provider, _ in targets]
        able = [t for t, refused in zip(targets, refusals, strict=True) if refused is None]
        if not able:
            raise next(refused for refused in refusals if refused is not None)
        return able

    def _meta(self, request: ChatRequest, target: Target) -> StreamMeta:
        return StreamMeta.new(
            request.model,
            include_usage=request.include_usage or request.include_cost,  # (cost rides on it)
            include_cost=request.include_cost,
            provider=target[0].name,
            upstream_model=target[1],
            retry_ms=self.retry_ms,
            prompt_estimate=prompt_estimate(request),
            prompt_audio_estimate=prompt_audio_estimate(request),
            echo=request.responses_echo,
        )

    def complete_stream(
        self, request: ChatRequest | Mapping[str, Any], ctx: CallContext | None = None
    ) -> Stream:
        """:meth:`open_stream`, started when the stream is first read: nothing runs (no
        middleware, no hook, no upstream call) until then.

        Raises :class:`~nexus.errors.InvalidRequest` for an invalid mapping,
        :class:`~nexus.errors.ModelNotFound` for an unknown model, and :class:`RuntimeError`
        for an engine not started (or closed, or on another loop), right away; a
        middleware's refusal and a plugin's :class:`~nexus.hooks.StreamRejected` at
        the first read. The stream's ``meta`` is the opened one's from its first event on.
        """
        self._on_its_loop()
        request = _validated(request)
        targets = self._targets(request)
        link: list[Stream] = []  # the outer stream, until its meta is settled
        outer = Stream.of_batches(self._opened(request, ctx, link), self._meta(request, targets[0]))
        link.append(outer)
        return outer

    async def _opened(
        self, request: ChatRequest, ctx: CallContext | None, link: list[Stream]
    ) -> AsyncGenerator[list[StreamEvent], None]:
        stream = await self.open_stream(request, ctx)
        del request  # not held for the stream's length
        try:
            while batch := await stream.read_batch():
                if link:
                    link.pop().meta = stream.meta
                yield batch
        finally:
            link.clear()
            await stream.close()

    def _routed(self, request: ChatRequest, targets: list[Target]) -> Stream:
        """The routed call itself: the end of the middleware chain."""
        meta = self._meta(request, targets[0])

        def served(provider: Provider, model: str, accepted: bool, prompt: Usage | None) -> None:
            # A fallback answered: the stream's meta names it from its first event on;
            # or a target took the request and the stream ends before any event came.
            stream.meta = replace(
                stream.meta,
                provider=provider.name,
                upstream_model=model,
                upstream_accepted=accepted,
                upstream_prompt=prompt,
            )

        def lost(provider: Provider, model: str, prompt: Usage | None) -> None:
            # A target took the request, then failed before any event: it may bill it.
            failed = FailedAttempt(f"{provider.name}/{model}", prompt)
            stream.meta = replace(
                stream.meta, failed_attempts=(*stream.meta.failed_attempts, failed)
            )

        stream = Stream.of_batches(RoutedRun(self, targets, request, served, lost), meta)
        return stream

    async def open_stream(
        self,
        request: ChatRequest | Mapping[str, Any],
        ctx: CallContext | None = None,
        *,
        observe: bool = True,
    ) -> Stream:
        """The routed call through the middleware, then ``on_stream_started``.

        The stream it returns fires the chunk hooks as it is read and
        ``on_stream_completed`` / ``on_stream_failed`` when it ends (closed
        early: failed, ``stream_cancelled``). ``ctx`` defaults to a new
        :class:`~nexus.hooks.CallContext`. ``observe=False`` skips the hooks
        (the stream hub has them watch its runs). Raises
        :class:`~nexus.errors.InvalidRequest`, :class:`~nexus.errors.ModelNotFound`, a
        middleware's refusal, and a plugin's :class:`~nexus.hooks.StreamRejected`;
        :class:`RuntimeError` before :meth:`start`, after :meth:`close`, and on another
        event loop than the one it started on; :class:`TypeError` for a middleware that
        returns no :class:`~nexus.stream.Stream`.
        """
        self._on_its_loop()
        request = _validated(request)
        if ctx is None:
            ctx = CallContext()
        stream = await self._pipeline(ctx)(request)
        if not observe or not self.hooks:
            return stream
        await self.hooks.started(stream, ctx)
        return self.hooks.observed(stream, ctx, self.prices)

    def _on_its_loop(self) -> None:
        """Raise a clear error for a call the engine cannot serve: after :meth:`close`, or
        before :meth:`start` with an HTTP provider (it has no connection pool yet: else a
        bare failure of the provider), or from another event loop than
        the engine's: its providers' connections belong to that loop (they fail there with
        a bare "Event loop is closed", or worse, in a loop still running)."""
        if self._closed:
            raise RuntimeError(
                "This Engine is closed: its providers' connections are gone. Start it again "
                "('await engine.start()') to use it."
            )
        if self._loop is None and self._needs_start:
            raise RuntimeError(
                "This Engine is not started: use it in 'async with engine:', or call "
                "'await engine.start()' first (and 'await engine.close()' when done)."
            )
        if self._loop is not None and asyncio.get_running_loop() is not self._loop:
            raise RuntimeError(
                "This Engine was started on another event loop. An engine serves only the "
                "event loop it started on (its providers' connections belong to it): start "
                "an engine in each loop, or thread, that uses one."
            )

    def _pipeline(self, ctx: CallContext) -> Next:
        """The middleware chain for one call, the engine at its end."""

        async def engine(request: ChatRequest) -> Stream:
            return self._routed(request, self._targets(request))

        call: Next = engine
        for middleware in reversed(self.middleware):
            call = _link(middleware, ctx, call)
        return call

    async def complete(
        self, request: ChatRequest | Mapping[str, Any], ctx: CallContext | None = None
    ) -> Completion:
        """The non-streaming call: :func:`accumulate` over :meth:`open_stream`.

        Raises :class:`~nexus.errors.StreamError` when the stream fails.
        """
        return await accumulate(await self.open_stream(request, ctx))


def _validated(request: ChatRequest | Mapping[str, Any]) -> ChatRequest:
    """``request`` as a :class:`ChatRequest`. Raises :class:`~nexus.errors.InvalidRequest`."""
    return request if isinstance(request, ChatRequest) else validated(ChatRequest, request)


def _link(middleware: Middleware, ctx: CallContext, call_next: Next) -> Next:
    async def call(request: ChatRequest) -> Stream:
        stream = await middleware(ctx, request, call_next)
        if not isinstance(stream, Stream):
            _misbehaved(middleware, stream)
        return stream

    return call


def _misbehaved(middleware: Middleware, returned: object) -> NoReturn:
    """Raise :class:`TypeError` for a middleware that returned ``returned``, not a stream."""
    name = getattr(middleware, "__qualname__", None) or repr(middleware)
    hint = "return the stream of 'await call_next(request)'"
    if inspect.isawaitable(returned):
        hint = "did it forget to await call_next(request)?"
        if inspect.iscoroutine(returned):
            returned.close()  # (never awaited: no warning of it at collection)
    raise TypeError(f"middleware {name} returned {type(returned).__name__}, not a Stream: {hint}")
