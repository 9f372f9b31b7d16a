"""How many HTTP readers that hold no stream slot a key runs at once in this process
(``[limits] max_readers_per_key``).

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
from contextlib import contextmanager

from aiohttp import web

from ...errors import GatewayError
from .. import state

__all__ = ["key_reader"]


@contextmanager
def key_reader(request: web.Request, owner: str | None) -> Iterator[None]:
    """A place among ``owner``'s readers for the block, or ``429 too_many_readers``
    (``Retry-After: 1``). ``owner`` None (no keys): no place is counted."""
    if owner is None:
        yield
        return
    held = request.app[state.RUNTIME].key_readers
    limit = request.app[state.CONFIG].limits.max_readers_per_key
    if held[owner] >= limit:
        raise GatewayError(
            f"The API key {owner!r} has {limit} stream readers open in this process, its "
            "limit ([limits] max_readers_per_key); retry once one of them has ended.",
            code="too_many_readers",
            status=429,
            error_type="rate_limit_error",
            retryable=True,
            headers={"Retry-After": "1"},
        )
    held[owner] += 1
    try:
        yield
    finally:
        held[owner] -= 1
        if held[owner] <= 0:
            del held[owner]
