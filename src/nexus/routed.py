"""The routed call: a request's targets tried in fallback order, then the one that
answered read through (:class:`RoutedRun`, the stream :meth:`Engine.open_stream
<nexus.engine.Engine.open_stream>` returns reads it).

A :class:`~nexus.errors.GatewayError` a provider raises *before its first event* is
raised to the reader (after trying the next target, when it is retryable); so is an
:class:`~nexus.events.Error` it yields first, and any other exception, as a
:class:`~nexus.errors.GatewayError` (``internal_error``, the original chained). After
an event, a failure becomes the stream's last event, an :class:`~nexus.events.Error`;
an ``Error`` the provider yields ends the stream too (what it yields after is dropped,
and it is closed). Each failed attempt is counted (``Engine.on_upstream_error``).

An attempt that fails after its upstream took the request (a 2xx), before its first
event, may be billed its prompt upstream: the stream's meta lists it
(:class:`~nexus.types.FailedAttempt`), for the logs and metrics, never for a budget. One
after its first event is the stream's own (no other target is tried then): its spend.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from .errors import GatewayError, StreamError
from .events import Error, StreamEvent, Usage
from .pricing import Price, Tally, spend_of
from .providers.base import Provider
from .request import ChatRequest
from .stream import Batches

if TYPE_CHECKING:
    from .engine import Engine
    from .telemetry import Attempt

__all__ = ["FALLBACK_BACKOFF_S", "RoutedRun", "Target"]

log = logging.getLogger("nexus.engine")

Target = tuple[Provider, str]

FALLBACK_BACKOFF_S = 0.05
"""Pause before the next target: 50 ms, then 100, 200, ... (bounded by the number of targets)."""


class RoutedRun:
    """The routed call's :class:`~nexus.stream.Batches`: the targets in fallback order,
    then the one that answered, read through (its ``__anext__`` a plain coroutine: no
    generator layer per read). See the module docstring for what it raises and ends on."""

    __slots__ = (
        "_attempt",
        "_batches",
        "_before",
        "_engine",
        "_held",
        "_lapse",
        "_latest",
        "_lost",
        "_price",
        "_request",
        "_served",
        "_span",
        "_targets",
    )

    def __init__(
        self,
        engine: Engine,
        targets: list[Target],
        request: ChatRequest,
        served: Callable[[Provider, str, bool, Usage | None], None],
        lost: Callable[[Provider, str, Usage | None], None],
    ) -> None:
        self._engine = engine
        self._targets = targets
        self._request: ChatRequest | None = request  # until a target answers
        self._served = served
        self._lost = lost
        self._attempt = -1
        self._batches: Batches | None = None  # the target's, while it is read
        self._held: list[StreamEvent] | None = None  # a pushed batch left to __anext__
        self._lapse: Exception | None = None  # the pushed-to reader's own failure
        self._span: Attempt | None = None
        self._price: Price | None = None
        # The last two reads: where a stream's finish reason and usage are (for the span).
        self._before: list[StreamEvent] | None = None
        self._latest: list[StreamEvent] | None = None

    def __aiter__(self) -> RoutedRun:
        return self

    async def __anext__(self) -> list[StreamEvent]:
        if self._lapse is not None:  # the reader's, not the provider's: raised as it is
            lapse, self._lapse = self._lapse, None
            raise lapse
        while True:
            batches = self._batches
            if batches is None:
                batches = await self._next_target()
            try:
                batch = self._held
                if batch is None:
                    batch = await batches.__anext__()
                else:
                    self._held = None
                if batch and Error in map(type, batch):  # (in C: no loop of ours per read)
                    batch = await self._ended_by(batch)
            except StopAsyncIteration:
                if self._span is not None:
                    self._span.answered(self._before, self._latest)
                await self._end(len(self._targets))
                raise
            except GatewayError as exc:
                self._failed(exc.code)
                if self._request is None:  # started
                    await self._end(len(self._targets), failed=True)
                    return [exc.to_event()]
                attempt, provider = self._attempt, self._targets[self._attempt][0]
                if exc.retryable and attempt < len(self._targets) - 1:
                    log.warning(
                        "provider %s failed before output (%s); trying the next target",
                        provider.name,
                        exc.code,
                    )
                    await self._end(attempt + 1, failed=True)
                    await asyncio.sleep(FALLBACK_BACKOFF_S * 2**attempt)
                    continue
                await self._end(len(self._targets), failed=True)
                raise
            except Exception as exc:
                provider = self._targets[self._attempt][0]
                log.exception("provider %s raised", provider.name)
                self._failed("internal_error")
                await self._end(len(self._targets), failed=True)
                failure = GatewayError(
                    f"provider {provider.name!r} failed unexpectedly",
                    code="internal_error",
                    retryable=True,
                )
                if self._request is not None:
                    raise failure from exc
                return [failure.to_event()]
            if batch:
                price = self._price
                if price is not None and type(batch[-1]) is Usage:
                    # A provider's usage ends the read it came in: one check a read.
                    batch[-1] = _priced(batch[-1], price)
                if self._request is not None:
                    self._first_output()
                self._before, self._latest = self._latest, batch
                return batch

    def push_to(self, sink: Callable[[list[StreamEvent]], bool]) -> asyncio.Future[None] | None:
        """Once the target that answered is read through, its reads pushed to ``sink`` as
        ``__anext__`` would return them (see :class:`~nexus.stream.Batches`); a batch with
        an :class:`Error` stops the pushing and is left to ``__anext__``."""
        batches = self._batches
        if self._request is not None or batches is None or self._held is not None:
            return None
        push = getattr(batches, "push_to", None)
        if push is None:
            return None
        price = self._price

        def pushed(batch: list[StreamEvent]) -> bool:
            if Error in map(type, batch):
                self._held = batch
                return False
            if price is not None and type(batch[-1]) is Usage:
                batch[-1] = _priced(batch[-1], price)
            self._before, self._latest = self._latest, batch
            try:
                return sink(batch)
            except Exception as exc:  # in the socket's callback, it would be the upstream's
                self._lapse = exc
                return False

        return push(pushed)  # type: ignore[no-any-return]

    async def _next_target(self) -> Batches:
        """The next target's batches (its span begun); StopAsyncIteration when none is left
        (all tried, or closed)."""
        attempt = self._attempt = self._attempt + 1
        request = self._request
        if request is None or attempt >= len(self._targets):
            raise StopAsyncIteration
        provider, model = self._targets[attempt]
        engine = self._engine
        self._price = engine.prices.price(f"{provider.name}/{model}", request.model)
        telemetry = engine.telemetry
        if telemetry is not None:
            self._span = telemetry.attempt(provider.name, provider.kind, model, request, attempt)
        try:
            self._batches = provider.batches(request, model)
        except Exception as exc:  # (a plain ``def batches`` that raised before its iterator)
            self._batches = _raising(exc)
        return self._batches

    async def _ended_by(self, batch: list[StreamEvent]) -> list[StreamEvent]:
        """A provider yielded an :class:`Error`: the stream ends there (what follows is
        dropped, the provider closed), counted as a failed attempt. One before any output
        is raised, as a :class:`~nexus.errors.StreamError` (a fallback may take it)."""
        at = next(i for i, event in enumerate(batch) if type(event) is Error)
        error: Error = batch[at]  # type: ignore[assignment]
        if at == 0 and self._request is not None:
            raise StreamError(error)
        del batch[at + 1 :]
        self._failed(error.code or "upstream_error")
        if self._request is not None:
            self._first_output()
        await self._end(len(self._targets), failed=True)
        return batch

    def _failed(self, code: str) -> None:
        """The current attempt failed with ``code``: its span and the error counter."""
        if self._span is not None:
            self._span.failed(code)
        counted = self._engine.on_upstream_error
        if counted is not None:
            counted(self._targets[self._attempt][0].name, code)

    def _first_output(self) -> None:
        if self._span is not None:
            self._span.first_output()
        # No other target will be tried: the request need not stay alive for the
        # stream's length.
        self._request = None
        if self._attempt:
            self._served(*self._targets[self._attempt], False, None)

    async def _end(self, attempt: int, *, failed: bool = False) -> None:
        """Close the current target's batches and end its span; go on at ``attempt``.
        ``failed``: the target failed (a stream that fails is charged nothing)."""
        batches, span = self._batches, self._span
        self._batches = self._span = None
        if self._request is not None and getattr(batches, "accepted", False):
            # Taken, then ended before its first event: its prompt is billed upstream (its
            # count, if the upstream gave it). Closed (the client left), it is the stream's
            # spend; failed, a failed attempt's (logged and counted, never charged).
            prompt = getattr(batches, "prompt_usage", None)
            target = self._targets[self._attempt]
            if failed:
                self._lost(*target, prompt)
            else:
                self._served(*target, True, prompt)
        if attempt >= len(self._targets):
            # The last end: the callbacks (closures over the stream that holds this run)
            # are let go, so that a finished stream is freed by its count, not the collector.
            self._served = self._lost = _told_nothing
        self._attempt = attempt - 1
        try:
            if batches is not None:
                await batches.aclose()
        finally:
            if span is not None:
                span.end(getattr(batches, "response_model", None))

    async def aclose(self) -> None:
        await self._end(len(self._targets))


def _told_nothing(*_: object) -> None:
    """What an ended run tells of a target (nothing: its stream's meta is final)."""


def _priced(usage: Usage, price: Price) -> Usage:
    """``usage`` with its cost at ``price``: the spend of a stream that ended with it."""
    return replace(usage, cost_usd=spend_of(Tally(usage), price, complete=True).cost_usd)


async def _raising(exc: Exception) -> AsyncGenerator[list[StreamEvent], None]:
    """What a provider raised as it was asked for its batches, raised at the first read,
    where a retryable error falls back to the next target as one from its stream does."""
    raise exc
    yield []  # (an async generator)
