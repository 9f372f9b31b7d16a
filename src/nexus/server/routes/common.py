"""What every completion endpoint does, in one place: read, negotiate, stream or answer.

An endpoint supplies its request parsing (body bytes to a :class:`ChatRequest`),
its default stream format and its non-streaming JSON; :func:`complete` does the
rest through the one hub and the one pump. :func:`resume` serves a stream that
already exists (``GET /v1/streams/{id}``, and a POST carrying ``Last-Event-ID``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable, Coroutine
from typing import Any, Protocol

import orjson
from aiohttp import web

from ...auth import Forbidden, credential
from ...cache.cursor import Cursor, parse_cursor
from ...cache.hub import describe, with_usage
from ...cache.run import LogReader
from ...encoders.base import Encoder
from ...errors import (
    InvalidLastEventId,
    ServerShuttingDown,
    StreamError,
    StreamNotFound,
)
from ...events import Done, Error, StreamEvent
from ...hooks import CallContext
from ...protocol.content_encoding import Inflater, content_coding, too_large
from ...protocol.negotiation import select_format
from ...request import ChatRequest
from ...stream import Stream, accumulate
from ...types import Completion
from .. import state
from ..access import KEYS, METRICS, admit, authenticate, exchange
from ..streaming import pump

__all__ = ["check_owner", "complete", "json_response", "last_event_id", "read_body", "resume"]

ATTACH_WAIT_S = 0.05
"""An attach sends its headers with the log so far, or after this long with nothing."""


class ParseBody(Protocol):
    """An endpoint's request parser: body bytes to a :class:`ChatRequest`, refusing JSON
    nested deeper than ``max_depth``."""

    def __call__(self, body: bytes, /, *, max_depth: int) -> ChatRequest: ...


async def read_body(request: web.Request) -> bytes:
    """The request body, as sent or inflated from gzip or deflate.

    Raises :class:`RequestTooLarge` past ``[limits] max_body_bytes`` (of the inflated
    size, and of the sent one), :class:`UnsupportedMediaType` for a ``Content-Encoding``
    other than gzip and deflate (before any of the body is read), and
    :class:`InvalidRequest` for compressed data that is not valid. Call it after the
    key is checked: nothing reads or inflates a body before (aiohttp's own
    decompression is off, see :func:`nexus.server.app.create_app`). A compressed body
    is inflated in pieces (:mod:`nexus.protocol.content_encoding`), with a turn of the
    event loop between them.

    Read from the payload, not with ``request.read()``, which keeps the bytes on the
    request for as long as it lives: a stream's whole length, for a body that can be
    a long conversation. Here they go once the request is parsed.
    """
    limit = request.app[state.CONFIG].limits.max_body_bytes
    coding = content_coding(request.headers.getall("Content-Encoding", ()))
    if request.content_length is not None and request.content_length > limit:
        raise too_large(limit)
    content = request.content
    chunks: list[bytes] = []
    if coding is None:
        size = 0
        while chunk := await content.readany():
            size += len(chunk)
            if size > limit:
                raise too_large(limit)
            chunks.append(chunk)
    else:
        inflater = Inflater(coding, limit=limit)
        while chunk := await content.readany():
            for piece in inflater.decode(chunk):
                chunks.append(piece)
                await asyncio.sleep(0)  # the loop serves others between pieces
        inflater.flush()
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def json_response(
    body: dict[str, Any], *, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    return web.Response(
        body=orjson.dumps(body), status=status, content_type="application/json", headers=headers
    )


def negotiate(request: web.Request, default_format: str) -> type[Encoder]:
    formats = request.app[state.REGISTRY]
    media_type = select_format(
        request.query.get("stream_format"),
        request.headers.get("X-Nexus-Stream-Format"),
        request.headers.get("Accept"),
        default_format,
        formats,
    )
    return formats.get(media_type)


def last_event_id(request: web.Request) -> Cursor | None:
    """The resume point: the ``Last-Event-ID`` header, else ``?last_event_id=``."""
    value = request.headers.get("Last-Event-ID")
    if value is None:
        value = request.query.get("last_event_id")
    if value is None or not value.strip():
        return None
    return parse_cursor(value)


def _check_open(request: web.Request) -> None:
    if request.app[state.RUNTIME].shutting_down:
        raise ServerShuttingDown("The server is shutting down; retry the request.")


async def complete(
    request: web.Request,
    *,
    parse: ParseBody,
    default_format: str,
    render: Callable[[Completion], dict[str, Any]],
) -> web.StreamResponse:
    """Serve one completion request in the endpoint's shapes.

    The stream format is negotiated before the body is read, so an unknown
    format is refused whatever the body holds. With ``Last-Event-ID`` the
    request resumes the stream it names (the body is not used).
    """
    _check_open(request)
    app = request.app
    key = authenticate(request)
    encoder = negotiate(request, default_format)
    body = await read_body(request)
    cursor = last_event_id(request)
    if cursor is not None:
        if cursor.stream_id is None:
            raise InvalidLastEventId(
                "A POST resumes the stream its Last-Event-ID names: send the id of an "
                "event ('<stream id>.<step>'), not a count.",
                param="last_event_id",
            )
        admit(request, key, None)
        return await resume(request, cursor.stream_id, encoder, cursor)
    chat = parse(body, max_depth=app[state.CONFIG].limits.max_json_depth)
    admit(request, key, chat.model)
    owner = key.name if key is not None else None
    hub = app[state.HUB]
    ex = exchange(request)
    streaming = chat.stream or chat.background
    ctx = CallContext(
        request_id=ex.request_id,
        key=owner,
        endpoint=ex.endpoint,
        format=encoder.media_type if streaming else "application/json",
    )
    if not streaming:
        ex.format = "application/json"
        if not hub.cache.enabled:
            return json_response(render(await app[state.ENGINE].complete(chat, ctx)))
        opened = await hub.open(chat, format=default_format, owner=owner, ctx=ctx)
        _count_cache(request, opened.cache)
        reader = await hub.attach(opened.id, meta=with_usage(opened.info.meta, False))
        completion = await accumulate(Stream(_events(reader), reader.meta))
        return json_response(render(completion), headers={"X-Nexus-Cache": opened.cache or "miss"})
    limits = app[state.CONFIG].limits
    with hub.admit(owner, limits.max_concurrent_streams, limits.max_concurrent_streams_per_key):
        opened = await hub.open(
            chat, format=default_format, background=chat.background, owner=owner, ctx=ctx
        )
    _count_cache(request, opened.cache)
    headers = {"X-Nexus-Cache": opened.cache} if opened.cache else {}
    if chat.background:
        headers.update({"Location": f"/v1/streams/{opened.id}", "X-Nexus-Stream-Id": opened.id})
        return json_response(describe(opened.info), status=202, headers=headers)
    reader = await hub.attach(opened.id, meta=with_usage(opened.info.meta, chat.include_usage))
    del chat, body, ctx, opened  # not held for the stream's length: the run has what it needs
    return await _pump(request, reader, encoder, None, headers)


async def resume(
    request: web.Request, stream_id: str, encoder: type[Encoder], cursor: Cursor | None
) -> web.StreamResponse:
    """Attach to an existing stream and write it from after ``cursor`` (from the start if None)."""
    if cursor is not None and cursor.stream_id not in (None, stream_id):
        raise InvalidLastEventId(
            f"Last-Event-ID {str(cursor)!r} belongs to another stream than {stream_id!r}.",
            param="last_event_id",
        )
    hub = request.app[state.HUB]
    info = await hub.info(stream_id)
    if info is None:
        raise StreamNotFound(f"No stream {stream_id!r}: unknown, or expired.", param="id")
    check_owner(request, info.owner)
    reader = await hub.attach(stream_id)
    if cursor is not None:
        metrics = request.app.get(METRICS)
        if metrics is not None:
            metrics.resumes.inc()
    return await _pump(
        request, reader, encoder, cursor, {}, first_wait_s=ATTACH_WAIT_S, origin=False
    )


def check_owner(request: web.Request, owner: str | None) -> None:
    """A stream is read with its id alone, or by the key that made it: a request that
    presents another key is refused (403 ``stream_forbidden``)."""
    key = exchange(request).key
    if key is None and request.app[KEYS].enabled and credential(request.headers) is not None:
        key = authenticate(request)
    if key is not None and owner is not None and key.name != owner:
        raise Forbidden(
            "This stream was made with another API key.", code="stream_forbidden", param="id"
        )


def _count_cache(request: web.Request, result: str | None) -> None:
    metrics = request.app.get(METRICS)
    if metrics is not None and result is not None:
        metrics.cache.labels(result).inc()


def _pump(
    request: web.Request,
    reader: LogReader,
    encoder: type[Encoder],
    cursor: Cursor | None,
    headers: dict[str, str],
    first_wait_s: float | None = None,
    origin: bool = True,
) -> Coroutine[Any, Any, web.StreamResponse]:
    config = request.app[state.CONFIG]
    return pump(
        request,
        reader,
        encoder,
        heartbeat_s=config.server.heartbeat_interval_s,
        write_timeout_s=config.server.write_timeout_s,
        after=cursor,
        headers=headers,
        active=request.app[state.RUNTIME].active,
        first_wait_s=first_wait_s,
        origin=origin,
        watchdog=request.app[state.RUNTIME].watchdog,
    )


async def _events(reader: LogReader) -> AsyncGenerator[StreamEvent, None]:
    """A log as a plain event stream (for :func:`accumulate`): no terminal ``Done``."""
    try:
        async for batch in reader:
            for event in batch:
                if type(event) is Done:
                    return
                if type(event) is Error and reader.failure is not None:
                    raise reader.failure
                yield event
        raise StreamError(
            Error(
                error_type="server_error",
                message="The stream's log ended without its last event.",
                code="stream_incomplete",
                retryable=True,
            )
        )
    finally:
        await reader.close()
