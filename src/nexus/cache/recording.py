"""Record and replay: the cache key of a request, a finished run kept as a
:class:`~nexus.cache.store.Recording`, and a recording played back as a stream.

The owner is the API key's name (``anonymous`` without keys): a key never gets
another key's recording, usage included, nor joins its stream, unless
``[cache] share_across_keys`` says the keys share one cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import AsyncGenerator
from dataclasses import replace

import orjson

from ..config import CacheConfig
from ..errors import StoreUnavailable
from ..events import Done, StreamEvent, Usage
from ..request import ChatRequest
from .run import MAX_BATCH, StreamRun
from .store import Recording, Store

__all__ = ["ANONYMOUS", "SHARED", "cache_key", "record", "replay"]

log = logging.getLogger("nexus.streams")

ANONYMOUS = "anonymous"
"""Whose cache a request without an API key (auth off) uses."""
SHARED = "*"
"""The one cache every key uses with ``[cache] share_across_keys`` (never a key's name)."""

_NOT_IN_KEY = {"stream", "stream_options", "background"}
_OURS = {"include_usage", "include_cost", "include_obfuscation"}
"""Stream options each listener gets rendered for itself; others (an upstream's own, as
vLLM's ``continuous_usage_stats``) go upstream and change the stream: in the key."""


def cache_key(request: ChatRequest, owner: str | None = None, *, shared: bool = False) -> str:
    """The canonical request in its owner's cache: what decides the output (model,
    messages, parameters, stream options passed upstream; not the wire format, not the
    options each listener gets rendered for itself), and whose it is.

    ``owner`` is the API key's name (None: no key, the ``anonymous`` cache); with
    ``shared`` every owner has the same key. The in-flight claim uses this key too,
    so a request joins only a stream it could have replayed.
    """
    scope = SHARED if shared else ANONYMOUS if owner is None else "key:" + owner
    body = request.model_dump(mode="json", exclude=_NOT_IN_KEY, exclude_none=True)
    options = request.stream_options
    if options is not None and options.model_extra:
        body["stream_options"] = {k: v for k, v in options.model_extra.items() if k not in _OURS}
    if request.responses_echo:  # (not sent upstream, but in every answer: its own)
        body["responses_echo"] = request.responses_echo
    canonical = orjson.dumps(body, option=orjson.OPT_SORT_KEYS)
    return hashlib.sha256(scope.encode() + b"\n" + canonical).hexdigest()


async def record(store: Store, cache: CacheConfig, run: StreamRun, key: str) -> None:
    """Keep a finished run under ``key`` when it ended well and fits ``[cache]``; release
    the in-flight claim either way. A store that fails is not a traceback per stream: it
    warned already (a line per cause and 10 s); a claim left holds a finished stream, which
    the next identical request releases."""
    try:
        terminal = run.events[-1]
        if (
            type(terminal) is Done
            and not terminal.aborted
            and len(run.events) - 1 <= cache.max_frames
            and run.size <= cache.max_bytes
            and run.offsets is not None
        ):
            meta = run.info.meta
            recording = Recording(
                _free(run.events[:-1]), run.offsets[:-1], meta.provider, meta.upstream_model
            )
            with contextlib.suppress(StoreUnavailable):
                await store.put_recording(key, recording, cache.ttl_s, run.info.owner)
        await store.release(key, run.id)
    except StoreUnavailable:
        pass
    except Exception:
        log.exception("recording stream %s failed", run.id)


async def replay(
    recording: Recording, cache: CacheConfig
) -> AsyncGenerator[list[StreamEvent], None]:
    """``recording``'s events: at once (``burst``), at their pace, or ``ff_divisor``
    times faster (``fast_forward``)."""
    mode = cache.mode
    if mode == "burst":
        for at in range(0, len(recording.events), MAX_BATCH):
            yield recording.events[at : at + MAX_BATCH]
        return
    divisor = cache.ff_divisor if mode == "fast_forward" else 1.0
    loop = asyncio.get_running_loop()
    start = loop.time()
    for event, offset in zip(recording.events, recording.offsets, strict=True):
        delay = start + offset / divisor - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        yield [event]


def _free(events: list[StreamEvent]) -> list[StreamEvent]:
    """A recording's events: its replays cost nothing upstream, so their usage says 0."""
    return [
        replace(e, cost_usd=0.0) if type(e) is Usage and e.cost_usd is not None else e
        for e in events
    ]
