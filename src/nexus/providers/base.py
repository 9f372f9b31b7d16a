"""The provider interface: the outbound edge. A provider turns a request into events.

A provider implements one primitive, :meth:`Provider.batches`: an async iterator
(:class:`~nexus.stream.Batches`: an async generator, or an object with a coroutine
``__anext__`` and ``aclose``) of non-empty lists of :class:`~nexus.events.StreamEvent`,
one list per upstream read (what the engine reads: one step per read, not per token).
Nothing runs before its first step. Before its first event it *raises*
:class:`~nexus.errors.GatewayError` (so the engine can fall back to another target or
answer with an HTTP status); after that it may also raise, and the engine turns the
exception into an error event. ``aclose()`` (which the engine always calls, after a
cancellation too) must release the upstream at once: in a generator, put the cleanup
in ``finally``. :meth:`Provider.stream` is derived: the same events one by one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator
from typing import ClassVar

from ..errors import InvalidRequest
from ..events import StreamEvent
from ..request import ChatRequest
from ..stream import Batches

__all__ = ["Provider", "flatten"]


class Provider(ABC):
    kind: ClassVar[str]
    accepts: ClassVar[frozenset[str]] = frozenset({"text"})
    """Input kinds the provider can take: ``text``, ``image``, ``audio``."""
    default_output_cap: int | None = None
    """The output cap it sends a request that sets none (None: the upstream's own)."""

    def __init__(self, name: str, models: list[str] | None = None) -> None:
        self.name = name
        self._models = list(models or [])

    async def start(self) -> None:
        """Acquire resources (connection pools). Called once before the first request."""

    async def close(self) -> None:
        """Release what :meth:`start` acquired."""

    def refusal(self, request: ChatRequest) -> InvalidRequest | None:
        """The 400 for a request this provider cannot honour: one with a field that
        changes the answer and that its API has no place for (None: it can). The engine
        skips such a target, and refuses the request with the first target's error when
        no target is left. Called once per target and request, before any upstream call."""
        return None

    def advertised_models(self) -> list[str]:
        """Upstream model names listed by ``GET /v1/models`` (without the provider prefix)."""
        return list(self._models)

    @abstractmethod
    def batches(self, request: ChatRequest, model: str) -> Batches:
        """Stream a completion of ``request`` from upstream ``model``, a list per read."""

    def stream(self, request: ChatRequest, model: str) -> AsyncGenerator[StreamEvent, None]:
        """The events of :meth:`batches`, one by one."""
        return flatten(self.batches(request, model))


async def flatten(batches: Batches) -> AsyncGenerator[StreamEvent, None]:
    """The events of ``batches`` one by one; closing it closes ``batches``."""
    try:
        async for batch in batches:
            for event in batch:
                yield event
    finally:
        await batches.aclose()
