"""How many realtime sockets a key holds open (``[realtime] max_sockets_per_key``): without
a cap one key could take every place of ``[server] max_connections`` with idle sockets.
Counted per process with the memory store; with the Redis store, by every replica
together (:meth:`~nexus.cache.limits.KeyLimits.enter`)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from aiohttp import web

from ...auth import ApiKey
from ...errors import GatewayError
from .. import state

__all__ = ["key_socket"]


@asynccontextmanager
async def key_socket(request: web.Request, key: ApiKey) -> AsyncIterator[None]:
    """A place among ``key``'s sockets for the block, or ``429 too_many_sockets``."""
    limits = request.app[state.HUB].limits
    limit = request.app[state.CONFIG].realtime.max_sockets_per_key
    place = await limits.enter("sockets", key.name, limit)
    if place is None:
        raise GatewayError(
            f"The API key {key.name!r} has {limit} realtime sockets open, its limit "
            "([realtime] max_sockets_per_key); close one first.",
            code="too_many_sockets",
            status=429,
            error_type="rate_limit_error",
            retryable=True,
        )
    try:
        yield
    finally:
        limits.leave(place)
