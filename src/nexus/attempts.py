"""The routed call's attempts: each target in fallback order until one gives an event,
then that one read through; and what the attempts cost that an upstream took, then
failed before any event (it bills their prompts all the same), kept apart from
:mod:`nexus.engine`, which builds the call.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from .errors import GatewayError
from .events import Error, StreamEvent, Usage
from .pricing import Price, Spend, Tally, cost_usd, prompt_estimate, spend_of
from .providers.base import Provider
from .request import ChatRequest
from .stream import Batches

if TYPE_CHECKING:
    from .engine import Engine
    from .telemetry import Attempt

__all__ = ["FALLBACK_BACKOFF_S", "Attempts", "Target", "priced"]

log = logging.getLogger("nexus.engine")

Target = tuple[Provider, str]

FALLBACK_BACKOFF_S = 0.05
"""Pause before the next target: 50 ms, then 100, 200, ... (bounded by the number of targets)."""


class Attempts:
    """The routed call's :class:`~nexus.stream.Batches`: the targets in fallback order,
    then the one that answered, read through (its ``__anext__`` a plain coroutine: no
    generator layer per read). See :mod:`nexus.engine` for what it raises.

    ``served(provider, model, accepted, prompt)``: a fallback answered, or a target took
    the request and the stream ended before any event. ``charged(spend)``: a target took
    the request (2xx), then failed before any event: the upstream bills that prompt
    whatever comes next, so its spend is the stream's too."""

    __slots__ = (
        "_attempt",
        "_batches",
        "_before",
        "_charged",
        "_engine",
        "_latest",
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
        charged: Callable[[Spend], None],
    ) -> None:
        self._engine = engine
        self._targets = targets
        self._request: ChatRequest | None = request  # until a target answers
        self._served = served
        self._charged = charged
        self._attempt = -1
        self._batches: Batches | None = None  # the target's, while it is read
        self._span: Attempt | None = None
        self._price: Price | None = None
        # The last two reads: where a stream's finish reason and usage are (for the span).
        self._before: list[StreamEvent] | None = None
        self._latest: list[StreamEvent] | None = None

    def __aiter__(self) -> Attempts:
        return self

    async def __anext__(self) -> list[StreamEvent]:
        while True:
            batches = self._batches
            if batches is None:
                batches = await self._next_target()
            try:
                batch = await batches.__anext__()
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
                    await asyncio.sleep(FALLBACK_BACKOFF_S * 2**attempt)
                    await self._end(attempt + 1, failed=True)
                    continue
                await self._end(len(self._targets), failed=True)
                raise
            except Exception:
                provider = self._targets[self._attempt][0]
                log.exception("provider %s raised", provider.name)
                self._failed("internal_error")
                await self._end(len(self._targets), failed=True)
                if self._request is not None:
                    raise
                return [
                    Error(
                        error_type="server_error",
                        message=f"provider {provider.name!r} failed unexpectedly",
                        code="internal_error",
                        retryable=True,
                    )
                ]
            if batch:
                price = self._price
                if price is not None and type(batch[-1]) is Usage:
                    # A provider's usage ends the read it came in: one check a read.
                    batch[-1] = priced(batch[-1], price)
                if self._request is not None:
                    self._first_output()
                self._before, self._latest = self._latest, batch
                return batch

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
        self._batches = provider.batches(request, model)
        return self._batches

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
        ``failed``: the target failed (after its first event, what it sent is charged by
        the stream's log; before, its prompt, if it took the request)."""
        batches, span = self._batches, self._span
        self._batches = self._span = None
        request = self._request
        if request is not None and getattr(batches, "accepted", False):
            # Taken, then ended before its first event (the client left, or the upstream
            # failed): its prompt is billed upstream (its count, if the upstream gave it).
            prompt = getattr(batches, "prompt_usage", None)
            if failed:
                estimate = prompt_estimate(request) if prompt is None else 0
                spent = spend_of(
                    Tally(),
                    self._price,
                    complete=False,
                    prompt_estimate=estimate,
                    accepted=True,
                    upstream_prompt=prompt,
                )
                self._charged(spent)
            else:
                self._served(*self._targets[self._attempt], True, prompt)
        self._attempt = attempt - 1
        try:
            if batches is not None:
                await batches.aclose()
        finally:
            if span is not None:
                span.end()

    async def aclose(self) -> None:
        await self._end(len(self._targets))


def priced(usage: Usage, price: Price) -> Usage:
    """``usage`` with its cost at ``price``."""
    cost = cost_usd(
        price,
        usage.prompt_tokens,
        usage.completion_tokens,
        usage.cached_tokens or 0,
        usage.cache_write_tokens or 0,
    )
    return replace(usage, cost_usd=cost)
