"""``POST /v1/chat/completions``: OpenAI-compatible, streaming and not."""

from __future__ import annotations

import orjson
from aiohttp import web

from ...errors import RequestTooLarge, ServerShuttingDown, TooManyStreams
from ...protocol.negotiation import select_format
from ...protocol.openai_chat import completion_body, parse_chat_request
from .. import state
from ..streaming import pump

DEFAULT_FORMAT = "text/event-stream"


async def read_body(request: web.Request) -> bytes:
    """The request body, or :class:`RequestTooLarge` past ``[limits] max_body_bytes``."""
    limit = request.app[state.CONFIG].limits.max_body_bytes
    too_large = RequestTooLarge(
        f"The request body is larger than the limit of {limit} bytes.", param=None
    )
    if request.content_length is not None and request.content_length > limit:
        raise too_large
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise too_large from None


def negotiate(request: web.Request, default: str) -> str:
    return select_format(
        request.query.get("stream_format"),
        request.headers.get("X-Nexus-Stream-Format"),
        request.headers.get("Accept"),
        default,
        request.app[state.REGISTRY],
    )


async def handle(request: web.Request) -> web.StreamResponse:
    app = request.app
    if app[state.RUNTIME].shutting_down:
        raise ServerShuttingDown("The server is shutting down; retry the request.")
    media_type = negotiate(request, DEFAULT_FORMAT)
    chat = parse_chat_request(await read_body(request))
    engine = app[state.ENGINE]
    if not chat.stream:
        completion = await engine.complete(chat)
        return web.Response(
            body=orjson.dumps(completion_body(completion)), content_type="application/json"
        )
    runtime = app[state.RUNTIME]
    config = app[state.CONFIG]
    if len(runtime.active) >= config.limits.max_concurrent_streams:
        raise TooManyStreams(
            f"The gateway is at its limit of {config.limits.max_concurrent_streams} "
            "concurrent streams; retry shortly.",
            headers={"Retry-After": "1"},
        )
    stream = engine.complete_stream(chat)
    return await pump(
        request,
        stream,
        app[state.REGISTRY].get(media_type),
        heartbeat_s=config.server.heartbeat_interval_s,
        write_timeout_s=config.server.write_timeout_s,
        active=runtime.active,
    )
