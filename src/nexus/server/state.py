"""Typed app state (``web.AppKey``) and the request's :class:`Exchange`, in a module of
their own: routes, middlewares and the pump import it; it imports none of them."""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from aiohttp import web

from ..auth import ApiKey
from ..cache.hub import StreamHub
from ..cache.run import LogReader
from ..config import Config
from ..encoders.registry import EncoderRegistry
from ..engine import Engine
from ..events import Done, Error, StreamEvent
from ..pricing import Spend
from ..protocol.realtime import PendingLedger
from ..providers.connections import PoolWaits
from ..tokens import StreamTokens
from ..watchdog import Watchdog
from .metrics import CANCEL_CAUSES

__all__ = [
    "CONFIG",
    "ENGINE",
    "EXCHANGE",
    "HUB",
    "NOSNIFF",
    "REGISTRY",
    "REQUEST_HANDLER_ARGS",
    "REQUEST_ID_HEADERS",
    "RUNTIME",
    "TOKENS",
    "Exchange",
    "Runtime",
    "exchange",
    "response_headers",
]


class Pump(Protocol):
    """A streaming response in flight (:class:`~nexus.server.streaming.StreamPump`)."""

    reader: LogReader

    def shutdown(self) -> None: ...


class Socket(Protocol):
    """A realtime connection (:class:`~nexus.server.routes.realtime.RealtimeConnection`)."""

    @property
    def busy(self) -> bool: ...

    async def shutdown(self) -> None: ...


@dataclass
class Runtime:
    """Mutable per-app state: streams and sockets in flight, and whether we are stopping."""

    active: set[Pump] = field(default_factory=set)
    sockets: set[Socket] = field(default_factory=set)
    requests: int = 0
    """HTTP requests being answered (WebSockets are in ``sockets``): the grace of a
    shutdown waits for those still uploading or opening their stream too."""
    watchdog: Watchdog = field(default_factory=Watchdog)
    """The timers of every streaming response (heartbeats, write stalls)."""
    pending: PendingLedger = field(default_factory=lambda: PendingLedger(0))
    """Each key's pending realtime input, over all its connections (the app sets it)."""
    draining: bool = False
    """``[server] drain_delay_s`` runs: ``/healthz`` answers 503, all else is served."""
    shutting_down: bool = False
    """The listener is closed (or closing): a new request is 503 ``server_shutting_down``."""
    stop_by: float | None = None
    """When the shutdown must be over (event loop time), once it began
    (:mod:`nexus.server.shutdown`)."""
    hurry: asyncio.Event = field(default_factory=asyncio.Event)
    """Set by a second stop signal: the drain delay and the grace are cut short."""


CONFIG = web.AppKey("config", Config)
ENGINE = web.AppKey("engine", Engine)
HUB = web.AppKey("hub", StreamHub)
REGISTRY = web.AppKey("registry", EncoderRegistry)
RUNTIME = web.AppKey("runtime", Runtime)
TOKENS = web.AppKey("tokens", StreamTokens)
"""Makes and checks the read tokens of background streams (``?token=``)."""
REQUEST_HANDLER_ARGS = web.AppKey("request_handler_args", dict[str, Any])
"""What every request handler serving the app is built with: its ``handler_args``, which
aiohttp's runners apply, and which ``nexus serve``'s connection layer reads from here."""


def _request_key() -> Any:
    # aiohttp 3.14 warns on string keys in request storage; older ones have no RequestKey.
    factory = getattr(web, "RequestKey", None)
    return factory("exchange", Exchange) if factory is not None else "nexus.exchange"


@dataclass(slots=True)
class Exchange:
    """One request, as the access log and the metrics see it."""

    request_id: str
    """The gateway's own id (``req_…``), unique: what the access line, the spans and the
    response's ``X-Request-Id`` carry."""
    started: float
    client_request_id: str | None = None
    """The id the client gave its request (``X-Client-Request-Id``), if sane: kept beside
    the gateway's, never in its place (a client could give another request's)."""
    endpoint: str = ""
    format: str = ""
    provider: str = ""
    stream_id: str = ""
    key: ApiKey | None = None
    ttfb: float | None = None
    events: int = 0
    bytes: int = 0
    cancelled: str | None = None
    refused: int = 0
    """Realtime ``start`` frames the socket had refused (admission, model, input)."""
    status: int | None = None
    """The status sent, once the headers are out (a stream cut short keeps its 200)."""
    headers: dict[str, str] = field(default_factory=dict)
    """Headers every response to this request carries (request id, nosniff, CORS)."""
    method: str = ""
    path: str = ""
    """The URL's path, never its query (a read token travels there)."""
    client: str | None = None
    model: str | None = None
    """The model asked for, once the request was routed (an alias stays an alias)."""
    served: str | None = None
    """``provider/model``: the target that answered, after fallbacks."""
    streamed: bool = False
    """The pump wrote the body, or a realtime socket is open (its turns' frames: the
    socket's :class:`~nexus.server.routes.realtime_turn.FrameMeter`): events and bytes
    count; false for a JSON answer."""
    ttft: float | None = None
    """From the request to the stream's first event."""
    error: str | None = None
    """The code of the error the response carries (an HTTP error's)."""
    stream_error: str | None = None
    """The code of the error a stream ended with, after its headers went out."""
    spend: Spend | None = None
    """What the request spent upstream (its own stream's; zero for a cache hit)."""
    cache: str | None = None
    pool_waits: PoolWaits = field(default_factory=PoolWaits)
    """What the request waited for pooled upstream connections (the providers add to it)."""
    rejected: str | None = None
    """The kind of a request aiohttp answered without the app (:mod:`.rejections`)."""
    reason: str | None = None
    """What the parser said was wrong with it (never the bytes it quotes)."""
    upgraded: web.WebSocketResponse | None = None
    """The request's WebSocket (a realtime handshake): once it is prepared, the socket is
    no longer HTTP, and an unexpected error closes it 1011 instead of answering a 500."""

    def stream_failure(self) -> str | None:
        """The code of the error the stream ended with after its headers, unless it ended
        the stream on purpose (a cancellation, see :meth:`outcome`)."""
        error = self.stream_error
        return None if error is None or error in _OUTCOME_CAUSES else error

    def outcome(self, status: int) -> str:
        """``ok``, ``error:<code>``, ``cancelled:<reason>``, ``mid_stream_error:<code>`` or
        ``rejected:<kind>``."""
        if self.rejected is not None:
            return f"rejected:{self.rejected}"
        if self.stream_error is not None:
            cause = _OUTCOME_CAUSES.get(self.stream_error)
            if cause is not None:
                return f"cancelled:{cause}"
            return f"mid_stream_error:{self.stream_error}"
        if self.cancelled is not None:
            return f"cancelled:{self.cancelled}"
        if status >= 400:
            return f"error:{self.error or status}"
        return "ok"

    def ended_with(self, terminal: StreamEvent | None, cause: str | None = None) -> None:
        """Note the terminal event of the stream this request wrote; ``cause``: why it was
        ended early, if known (else its reader left: ``client_disconnect``)."""
        if type(terminal) is Error:
            code = terminal.code or terminal.error_type
            if code == "client_disconnect" and cause is not None:  # why its reader left
                self.cancelled = self.cancelled or cause
            else:
                self.stream_error = code
        elif type(terminal) is Done and terminal.aborted:
            self.cancelled = self.cancelled or cause or "client_disconnect"


EXCHANGE: Any = _request_key()

_OUTCOME_CAUSES = {
    **CANCEL_CAUSES,
    "stream_cancelled": "aborted",
    "client_disconnect": "client_disconnect",
}
"""The ``cancelled:<reason>`` of a stream that ended with one of these error codes
(``aborted``: ``DELETE /v1/streams/{id}``, or its producer cancelled; ``client_disconnect``:
the stream's one reader left, as its spend line says when it comes after the access line)."""


def exchange(request: web.Request) -> Exchange:
    found: Exchange | None = request.get(EXCHANGE)
    if found is None:  # a handler run without the middleware (unit tests)
        found = Exchange(new_request_id(), time.monotonic())
        request[EXCHANGE] = found
    return found


def new_request_id() -> str:
    return "req_" + os.urandom(12).hex()


REQUEST_ID_HEADERS = ("X-Request-Id", "request-id")
"""The headers every response carries its request's id in: ``X-Request-Id`` (Nexus's own,
where the ``openai`` SDK reads it) and ``request-id`` (Anthropic's API's, where the
``anthropic`` SDK reads it, whatever path it called)."""


NOSNIFF = ("X-Content-Type-Options", "nosniff")
"""No response is to be read as anything but its type: errors quote a client's strings
(a 417 its ``Expect`` as text/plain), and the console shares the origin and keeps a key."""


def response_headers(request_id: str) -> dict[str, str]:
    """The headers every response carries, whoever writes it (the access middleware,
    :func:`~nexus.server.access.stamp_response` for what aiohttp answers itself, a
    :class:`~nexus.server.rejections.Rejected`, the connection cap's 503):
    :data:`REQUEST_ID_HEADERS`, each with ``request_id``, and :data:`NOSNIFF`."""
    headers = dict.fromkeys(REQUEST_ID_HEADERS, request_id)
    headers[NOSNIFF[0]] = NOSNIFF[1]
    return headers
