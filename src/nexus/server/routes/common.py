"""What every completion endpoint does, in one place: read, negotiate, stream or answer.

An endpoint supplies its request parsing (body bytes to a :class:`ChatRequest`),
its default stream format and its non-streaming JSON; :func:`complete` does the
rest through the one engine and the one pump.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson
from aiohttp import web

from ...errors import RequestTooLarge, ServerShuttingDown, TooManyStreams
from ...protocol.negotiation import select_format
from ...request import ChatRequest
from ...types import Completion
from .. import state
from ..streaming import pump

__all__ = ["complete", "json_response", "read_body"]


async def read_body(request: web.Request) -> bytes:
    """The request body, or :class:`RequestTooLarge` past ``[limits] max_body_bytes``."""
    limit = request.app[state.CONFIG].limits.max_body_bytes
    too_large = RequestTooLarge(f"The request body is larger than the limit of {limit} bytes.")
    if request.content_length is not None and request.content_length > limit:
        raise too_large
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise too_large from None


def json_response(body: dict[str, Any]) -> web.Response:
    return web.Response(body=orjson.dumps(body), content_type="application/json")


async def complete(
    request: web.Request,
    *,
    parse: Callable[[bytes], ChatRequest],
    default_format: str,
    render: Callable[[Completion], dict[str, Any]],
) -> web.StreamResponse:
    """Serve one completion request in the endpoint's shapes.

    The stream format is negotiated before the body is read, so an unknown
    format is refused whatever the body holds.
    """
    app = request.app
    runtime = app[state.RUNTIME]
    if runtime.shutting_down:
        raise ServerShuttingDown("The server is shutting down; retry the request.")
    formats = app[state.REGISTRY]
    media_type = select_format(
        request.query.get("stream_format"),
        request.headers.get("X-Nexus-Stream-Format"),
        request.headers.get("Accept"),
        default_format,
        formats,
    )
    chat = parse(await read_body(request))
    engine = app[state.ENGINE]
    if not chat.stream:
        return json_response(render(await engine.complete(chat)))
    config = app[state.CONFIG]
    if len(runtime.active) >= config.limits.max_concurrent_streams:
        raise TooManyStreams(
            f"The gateway is at its limit of {config.limits.max_concurrent_streams} "
            "concurrent streams; retry shortly.",
            headers={"Retry-After": "1"},
        )
    return await pump(
        request,
        engine.complete_stream(chat),
        formats.get(media_type),
        heartbeat_s=config.server.heartbeat_interval_s,
        write_timeout_s=config.server.write_timeout_s,
        active=runtime.active,
    )
