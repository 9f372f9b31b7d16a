"""How many HTTP readers that hold no stream slot a key runs at once (``[limits]
max_readers_per_key``): per process with the memory store; with the Redis store, on every
replica together (:meth:`~nexus.cache.limits.KeyLimits.enter`).

A stream's slot (``max_concurrent_streams_per_key``) is held by its run, not by who reads
it: a ``GET /v1/streams/{id}``, a resume (``Last-Event-ID``), a read-token read and a
request that joins an identical stream in flight all read a log whose slot another
request holds (a cached replay is a run of its own, with its own slot). Each costs one
rate token however large the log, so without this cap one key could render its own big
log a thousand times at once (the event loop, shared by every key, renders them) or hold
every place of ``[server] max_connections`` with followers. A read-token read counts
against the key the token was issued to, as its rate token does (with
``[cache] share_across_keys``, possibly not the stream's owner). Without keys there is no tenant
to keep apart from another: nothing is counted (``[server] max_connections`` still
bounds the connections).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

from aiohttp import web

from ...cache.limits import KeyLimits, Slot
from ...errors import GatewayError
from .. import state

__all__ = ["key_reader"]


@contextmanager
def _held(limits: KeyLimits, place: Slot) -> Iterator[None]:
    """``place`` for the block that reads, let go as it leaves (however it leaves)."""
    try:
        yield
    finally:
        limits.leave(place)


async def key_reader(request: web.Request, owner: str | None) -> AbstractContextManager[None]:
    """A place among ``owner``'s readers, held by the block the returned context manager
    is entered for; or ``429 too_many_readers`` (``Retry-After: 1``). ``owner`` None (no
    keys): no place is counted."""
    if owner is None:
        return nullcontext()
    limits = request.app[state.HUB].limits
    limit = request.app[state.CONFIG].limits.max_readers_per_key
    place = await limits.enter("readers", owner, limit)
    if place is None:
        raise GatewayError(
            f"The API key {owner!r} has {limit} stream readers open, its limit "
            "([limits] max_readers_per_key); retry once one of them has ended.",
            code="too_many_readers",
            status=429,
            error_type="rate_limit_error",
            retryable=True,
            headers={"Retry-After": "1"},
        )
    return _held(limits, place)
