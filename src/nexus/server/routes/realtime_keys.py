"""How many realtime sockets a key holds open in this process (``[realtime]
max_sockets_per_key``): without a cap one key could take every place of ``[server]
max_connections`` with idle sockets."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from aiohttp import web

from ...auth import ApiKey
from ...errors import GatewayError
from .. import state

__all__ = ["key_socket"]


@contextmanager
def key_socket(request: web.Request, key: ApiKey) -> Iterator[None]:
    """A place among ``key``'s sockets for the block, or ``429 too_many_sockets``."""
    held = request.app[state.RUNTIME].key_sockets
    limit = request.app[state.CONFIG].realtime.max_sockets_per_key
    if held[key.name] >= limit:
        raise GatewayError(
            f"The API key {key.name!r} has {limit} realtime sockets open, its limit "
            "([realtime] max_sockets_per_key); close one first.",
            code="too_many_sockets",
            status=429,
            error_type="rate_limit_error",
            retryable=True,
        )
    held[key.name] += 1
    try:
        yield
    finally:
        held[key.name] -= 1
        if held[key.name] <= 0:
            del held[key.name]
