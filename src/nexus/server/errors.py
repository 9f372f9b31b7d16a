"""Errors at the HTTP edge: one middleware renders every failure as JSON.

The body's shape is the endpoint's: a handler may carry an ``error_body``
attribute (a function of :class:`~nexus.errors.GatewayError` and the request id to
a dict); the default is OpenAI's ``{"error": {"message", "type", "param", "code",
"request_id"}}``. The request id is the ``X-Request-Id`` the response carries.
Each error response also says whether the SDKs should retry it (``x-should-retry``:
:func:`retry_advice`).
Unknown routes and methods get the same JSON shape, and an unexpected
exception a 500 whose message reveals nothing internal; but nothing is written
after a response's headers went out: a WebSocket is closed 1011, another
connection dropped. A request that arrives
while the server stops is 503 ``server_shutting_down``, its connection closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import WSCloseCode, web

from ..errors import GatewayError, ServerShuttingDown
from ..protocol.anthropic_output import anthropic_error_body
from .state import EXCHANGE, RUNTIME, new_request_id

__all__ = ["SHOULD_RETRY", "error_middleware", "error_response", "retry_advice"]

log = logging.getLogger("nexus.server")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
ErrorBody = Callable[[GatewayError, str | None], dict[str, Any]]


SHOULD_RETRY = "x-should-retry"
"""The header the OpenAI and Anthropic SDKs obey before their own rules (which retry every
408, 409, 429 and 5xx): ``true`` or ``false``."""
SDK_RETRY_AFTER_MAX_S = 60
"""The longest ``Retry-After`` the SDKs wait out; past it they give up or ignore it."""


def error_response(
    request: web.Request, error: GatewayError, *, advise: bool = True
) -> web.Response:
    """``error`` as the endpoint's JSON; with ``advise`` (not for a failure the gateway did
    not foresee), its :func:`retry_advice` in ``x-should-retry``."""
    exchange = request.get(EXCHANGE)
    if exchange is not None:
        exchange.error = error.code  # the access line's outcome: error:<code>
    handler = getattr(request.match_info, "handler", None)
    # Anthropic's shape under its path too (a 404 count_tokens, a 405 GET): its SDK's.
    shape = anthropic_error_body if request.path.startswith("/v1/messages") else None
    body: ErrorBody = getattr(handler, "error_body", shape or GatewayError.openai_body)
    headers = dict(error.headers)
    if advise:
        headers[SHOULD_RETRY] = "true" if retry_advice(error) else "false"
    status = error.status
    if body is anthropic_error_body and error.error_type == "overloaded_error":
        status = 529  # Anthropic's own word for it (the SDK's OverloadedError), not a 502
    return web.Response(
        status=status,
        body=orjson.dumps(body(error, _known_request_id(request))),
        content_type="application/json",
        headers=headers,
    )


def retry_advice(error: GatewayError) -> bool:
    """Whether an SDK's automatic retry (within seconds, a minute at most) may succeed.

    A ``Retry-After`` in seconds decides: within :data:`SDK_RETRY_AFTER_MAX_S`, yes (a
    budget whose running streams will give back their holds); longer, no (a budget window
    that resets tomorrow: the client waits itself, or not). Without one, the error's
    ``retryable``: an upstream's refusal of the gateway's own key, a request whose worst
    case is over the whole budget, a bad request are answered the same way every time."""
    told = error.headers.get(SHOULD_RETRY)
    if told is not None:  # the error knows better (an upstream's wait too long to pass on)
        return told == "true"
    retry_after = error.headers.get("Retry-After", "")
    if retry_after.isascii() and retry_after.isdigit():
        return int(retry_after) <= SDK_RETRY_AFTER_MAX_S
    return error.retryable


_STOPPING = "The server is shutting down; retry the request."
_RETRY = {"Retry-After": "1"}
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


def _known_request_id(request: web.Request) -> str | None:
    """The id the access middleware gave the request; None without it."""
    request_id = getattr(request.get(EXCHANGE), "request_id", None)
    return request_id if isinstance(request_id, str) and request_id else None


def client_gone(request: web.Request) -> bool:
    """Whether the client's connection is closed (or closing): no answer can reach it."""
    transport = request.transport
    return transport is None or transport.is_closing()


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    runtime = request.app.get(RUNTIME)
    if runtime is not None and runtime.shutting_down:
        # A request on a connection still open while the server stops: answered, and
        # the connection closed after it (the listener is gone; a retry goes elsewhere).
        refused = error_response(request, ServerShuttingDown(_STOPPING, headers=_RETRY))
        refused.force_close()
        return refused
    try:
        response = await handler(request)
    except GatewayError as exc:
        response = error_response(request, exc)
        # Answered. A stream's run keeps its failure for its readers: with its traceback
        # (the frames that raised it, the run's among them) it would hold the run in a cycle.
        exc.__traceback__ = None
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        path = request.rel_url.raw_path  # as sent: /v1%2Fchat is no /v1/chat
        if exc.status == 405:
            message = f"Method {request.method} is not allowed on {path}."
        elif exc.status == 404:
            message = f"No route for {request.method} {path}."
        else:  # aiohttp's own explanation (a WebSocket handshake's), else the reason
            text = exc.text or ""
            message = (
                exc.reason if text.startswith(f"{exc.status}:") else " ".join(text.split())[:200]
            )
        error = GatewayError(
            message,
            status=exc.status,
            code=_HTTP_CODES.get(exc.status, "http_error"),
            error_type="invalid_request_error",
            headers={k: v for k, v in exc.headers.items() if k.lower() == "allow"},
        )
        response = error_response(request, error)
    except Exception as exc:
        if isinstance(exc, ConnectionError) and client_gone(request):
            raise  # the client hung up mid-request: nothing broke (its access line: 499)
        request_id = _known_request_id(request) or new_request_id()
        log.exception("unhandled error in %s %s (%s)", request.method, request.path, request_id)
        upgraded = getattr(request.get(EXCHANGE), "upgraded", None)
        if upgraded is not None and upgraded.prepared:
            return await _closed_1011(request, upgraded)
        if request.writer.output_size:
            raise  # a response is on its way: aiohttp drops the connection, writing nothing
        error = GatewayError(f"Internal server error (request {request_id}).")
        response = error_response(request, error, advise=False)  # the SDKs' own rules
    return response


_CLOSE_WAIT_S = 1.0
"""How long the peer of a WebSocket closed on an error has to answer the close frame."""


async def _closed_1011(request: web.Request, ws: web.WebSocketResponse) -> web.StreamResponse:
    """An unexpected error after a WebSocket handshake: the 101 is out and the socket
    speaks WebSocket frames, so an HTTP answer there would be garbage to the client
    (a bad frame header, "reserved bits must be 0"). It is closed 1011 instead."""
    ex = request[EXCHANGE]
    ex.status = ex.status or ws.status
    ex.stream_error = ex.stream_error or "internal_error"
    ws.force_close()
    with contextlib.suppress(Exception):  # (the peer may be gone already)
        async with asyncio.timeout(_CLOSE_WAIT_S):
            await ws.close(code=WSCloseCode.INTERNAL_ERROR, message=b"internal error")
    return ws
