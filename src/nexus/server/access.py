"""Who may call from where, and what each request did: request ids, CORS, the access and
spend lines (the keys and their limits: :mod:`.key_admission`).

:func:`access_middleware` is the outermost layer: it gives every request an id of its own,
which its response carries as ``X-Request-Id`` and ``request-id`` (the id a client gives is
kept beside it, :func:`_client_request_id`; a response the middleware never sees gets one
from :func:`stamp_response`), refuses other sites' pages and rebound ``Host`` names before
any route runs (:mod:`nexus.server.origins`; ``/metrics`` counts them as refusals), answers
CORS preflights, and writes one access line and the metrics per request, inside its span when
tracing (:mod:`nexus.telemetry`). Routes authenticate and admit their callers
(:mod:`.key_admission`); the pump fills in the request's
:class:`~nexus.server.state.Exchange` as it writes.

The access line's fields are :func:`_fields`'s. ``outcome`` is ``ok``,
``error:<code>``, ``mid_stream_error:<code>``, ``cancelled:<reason>``, for a CORS
preflight ``preflight`` (and ``rejected:<kind>`` for a request aiohttp answered without
the app, accounted by :mod:`nexus.server.rejections` through :func:`account`); ``served``
the ``provider/model`` that answered after fallbacks; the spend, what the request's
own stream spent (zeros for a cache hit or a join; estimated for one cut short).
Failed requests are logged at WARNING; in the text form, a value with spaces, quotes
or control characters is JSON-quoted.

A request answered before its body was read to the end has its connection closed
once the answer is out, rather than aiohttp reading the rest (for up to ten seconds)
for a client that may not even have a key.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import replace
from typing import Any

from aiohttp import web

from ..auth import Forbidden, KeyRing
from ..cache.run import LogReader, StreamRun
from ..config import Config
from ..errors import GatewayError
from ..log_context import serve
from ..pricing import NOTHING, Spend
from ..providers.connections import POOL_WAITS
from ..telemetry import Telemetry
from .errors import Handler, client_gone, error_response
from .log_lines import line as _line
from .metrics import Metrics
from .origins import listed, loopback_host, origin_allowed
from .redaction import redact
from .state import CONFIG as _CONFIG
from .state import EXCHANGE, RUNTIME, Exchange, exchange, new_request_id, response_headers

__all__ = [
    "EXCHANGE",
    "KEYS",
    "METRICS",
    "TELEMETRY",
    "Exchange",
    "access_middleware",
    "account",
    "account_at_end",
    "exchange",
    "request_spend",
    "settled_spend",
    "stamp_response",
]

log = logging.getLogger("nexus.server")
access_log = logging.getLogger("nexus.access")
spend_log = logging.getLogger("nexus.spend")

KEYS = web.AppKey("keys", KeyRing)
METRICS = web.AppKey("metrics", Metrics)
TELEMETRY = web.AppKey("telemetry", Telemetry)
"""Set when tracing is on (``[telemetry] otlp_endpoint``): a span per request."""
_UNTRACED = ("/healthz", "/metrics")


_REQUEST_ID = re.compile(r"[A-Za-z0-9._:/+=@-]{1,128}")
_EXPOSED = (
    "X-Request-Id, X-Client-Request-Id, X-Nexus-Stream-Id, X-Nexus-Stream-Format, X-Nexus-Cache, "
    "Location, Retry-After, retry-after-ms, X-Nexus-Resumable, X-Nexus-Store, request-id, "
    "x-should-retry, X-Nexus-Token-Count"
)
_ALLOWED_HEADERS = (
    "Authorization, Content-Type, X-Api-Key, X-Nexus-Stream-Format, Last-Event-ID, "
    "X-Request-Id, X-Client-Request-Id, Accept, X-Nexus-Resumable"
)


_HEADER_NAMES = re.compile(r"[A-Za-z0-9-]{1,64}(?:\s*,\s*[A-Za-z0-9-]{1,64}){0,63}")


def _allowed_headers(request: web.Request) -> str:
    """The headers an allowed page may send: ours, and those its preflight asks for when
    they are plain names (the SDKs' ``x-stainless-*``, ``anthropic-version``,
    ``anthropic-beta``: what a request carries is no secret; its origin is checked)."""
    asked = request.headers.get("Access-Control-Request-Headers", "").strip()
    return f"{_ALLOWED_HEADERS}, {asked}" if _HEADER_NAMES.fullmatch(asked) else _ALLOWED_HEADERS


def _client_request_id(request: web.Request) -> str | None:
    """The id the client gave its request: ``X-Client-Request-Id`` (OpenAI's header for
    it), else ``X-Request-Id`` (a proxy's in front, or a client's of old); None unless it
    is 1 to 128 characters of ``A-Za-z0-9._:/+=@-`` and not a key. Kept beside the
    gateway's id, never as it: a client could give another request's, and two requests
    would share one id in the log and the traces."""
    headers = request.headers
    incoming = headers.get("X-Client-Request-Id") or headers.get("X-Request-Id") or ""
    sane = _REQUEST_ID.fullmatch(incoming) and redact(incoming) == incoming  # (not a key)
    return incoming if sane else None


@web.middleware
async def access_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    request_id = new_request_id()
    serve(request_id)  # its lines carry its id (nexus.log_context)
    ex = Exchange(request_id, time.monotonic(), _client_request_id(request))
    ex.endpoint = _endpoint(request)
    ex.method = request.method
    ex.path = request.path[:MAX_PATH_CHARS]
    ex.client = request.remote
    ex.headers.update(response_headers(request_id))  # (its id; X-Content-Type-Options)
    if ex.client_request_id is not None:
        ex.headers["X-Client-Request-Id"] = ex.client_request_id  # echoed, for the client
    request[EXCHANGE] = ex
    app = request.app
    config = app[_CONFIG]
    origin = request.headers.get("Origin")
    if origin is not None and listed(origin, config.cors.allow_origins):  # its page reads it
        ex.headers["Access-Control-Allow-Origin"] = origin
        ex.headers["Vary"] = "Origin"
        ex.headers["Access-Control-Expose-Headers"] = _EXPOSED
    refusal = _refusal(request, origin)
    if refusal is not None:
        metrics = app.get(METRICS)
        if ex.endpoint == "/metrics" and metrics is not None:  # as the route counts its own
            metrics.metrics_refused.labels(_METRICS_REFUSED[refusal.code]).inc()
        refused = error_response(request, refusal)
        refused.headers.update(ex.headers)
        status = refused.status
        try:
            return await _close_if_unread(request, refused)
        except ConnectionError:  # it hung up mid-body: as below, a quiet 499
            ex.cancelled, status = "client_disconnect", 499
            return web.Response(status=status)
        finally:
            account(config, metrics, ex, status)
    if (
        "Access-Control-Allow-Origin" in ex.headers
        and request.method == "OPTIONS"
        and "Access-Control-Request-Method" in request.headers
    ):
        response: web.StreamResponse = web.Response(status=204, headers=ex.headers)
        response.headers.update(
            {
                "Access-Control-Allow-Methods": "GET, POST, DELETE, OPTIONS",
                "Access-Control-Allow-Headers": _allowed_headers(request),
                "Access-Control-Max-Age": str(config.cors.max_age_s),
            }
        )
        # Its line's endpoint: the route of the method it asks about.
        asked = request.clone(method=request.headers["Access-Control-Request-Method"])
        resource = (await app.router.resolve(asked)).route.resource
        ex.endpoint = "unmatched" if resource is None else resource.canonical
        account(app[_CONFIG], app.get(METRICS), ex, response.status, PREFLIGHT)
        return response
    tracing = app.get(TELEMETRY)
    span = (
        tracing.request_span(
            request.method,
            None if ex.endpoint == "unmatched" else ex.endpoint,
            ex.path,
            request.headers,
            scheme=request.scheme,
            request_id=request_id,
            client_request_id=ex.client_request_id,
        )
        if tracing is not None and ex.endpoint not in _UNTRACED
        else None
    )
    status = 500
    waits = POOL_WAITS.set(ex.pool_waits)  # a stream's run task, started below, inherits it
    runtime = app[RUNTIME]
    answering = ex.endpoint != "/v1/realtime"  # (a socket: counted among the sockets)
    runtime.requests += answering
    try:
        response = await handler(request)
        status = response.status
        if not response.prepared:
            for name, value in ex.headers.items():
                response.headers.setdefault(name, value)
        if request.content.is_eof():  # (the common case: no coroutine for it)
            return response
        return await _close_if_unread(request, response)
    except BaseException as exc:
        left = isinstance(exc, ConnectionError) and client_gone(request)
        if (left or isinstance(exc, asyncio.CancelledError)) and ex.stream_error is None:
            # (After a failure the answer ended with, aiohttp cancelling the handler as the
            # connection closes is no client leaving: a realtime socket closed 1011.)
            ex.cancelled = ex.cancelled or "client_disconnect"
        elif ex.status is not None or request.writer.output_size:
            ex.stream_error = ex.stream_error or "internal_error"  # a bug past the headers
        if ex.status is not None:
            status = ex.status  # the headers were out: the client got this status
        elif isinstance(exc, asyncio.CancelledError):
            status = 499  # the client left before any answer (nginx's convention)
        elif left:
            # It hung up mid-request. Raised, aiohttp would log a traceback at ERROR
            status = 499  # (any client could fill the log so); returned, it is dropped.
            return web.Response(status=status)
        raise
    finally:
        runtime.requests -= answering
        POOL_WAITS.reset(waits)
        if span is not None:
            span.close(status, ex.stream_id, ex.cancelled, ex.stream_failure())
        account(config, app.get(METRICS), ex, status)


_METRICS_REFUSED = {"origin_not_allowed": "origin", "host_not_allowed": "not_local"}
"""The ``nexus_metrics_refused_total`` reason of a ``/metrics`` request :func:`_refusal`
refuses, by its code (``not_local`` as the route's own ``host_not_allowed``)."""


def _refusal(request: web.Request, origin: str | None) -> GatewayError | None:
    """Why a request is not served, before any route sees it (see :mod:`.origins`)."""
    config = request.app[_CONFIG]
    host = request.headers.get("Host")
    if origin is not None and not origin_allowed(
        origin, config.cors.allow_origins, scheme=request.scheme, host=host
    ):
        return Forbidden(
            f"Requests from pages at {origin!r} are not allowed: the gateway serves its "
            "own pages and the origins in [cors] allow_origins.",
            code="origin_not_allowed",
        )
    if (
        host is not None
        and not request.app[KEYS].enabled
        and not config.auth.allow_unauthenticated
        and request.path != "/healthz"  # liveness only, for probes under any name
        and not loopback_host(host)
    ):
        return Forbidden(
            f"Host {host!r} is not served: without API keys the gateway answers only "
            "loopback names (localhost, 127.0.0.1, [::1]). Add [[auth.keys]], or set "
            "[auth] allow_unauthenticated = true to serve any name.",
            code="host_not_allowed",
        )
    return None


async def _close_if_unread(
    request: web.Request, response: web.StreamResponse
) -> web.StreamResponse:
    """Send ``response`` and close the connection if the request's body is not all in:
    its rest is never read (nor inflated), by the route or by aiohttp's lingering read."""
    if request.content.is_eof():
        return response
    response.force_close()  # "Connection: close", while the headers can still say so
    if not response.prepared:
        await response.prepare(request)
    await response.write_eof()
    request.protocol.force_close()
    return response


async def stamp_response(request: web.Request, response: web.StreamResponse) -> None:
    """The app's ``on_response_prepare``: a response the access middleware did not stamp
    gets what every response carries too (:func:`~nexus.server.state.response_headers`: a
    request id, ``X-Content-Type-Options: nosniff``). aiohttp answers an unknown
    ``Expect`` (417, quoting it as text/plain) before any middleware runs: its id is a new
    one, which its access line reads off it (:mod:`nexus.server.rejections`). A 500
    aiohttp makes of an error that got past the middlewares gets the request's own.
    Once the server stops, every response says ``Connection: close``: its connection is
    closed after it, and a client that took it for kept alive would send its next request
    onto a closed socket rather than to a replica that serves."""
    runtime = request.app.get(RUNTIME)
    if runtime is not None and runtime.shutting_down and response.status != 101:
        response.force_close()
        response.headers["Connection"] = "close"  # (aiohttp set its own before this hook)
    if "X-Request-Id" in response.headers:
        return  # (every response the middleware saw: its headers have both)
    ex: Exchange | None = request.get(EXCHANGE)
    response.headers.update(response_headers(new_request_id() if ex is None else ex.request_id))


def _endpoint(request: web.Request) -> str:
    resource = request.match_info.route.resource
    if resource is None:
        return "unmatched"
    return resource.canonical


PREFLIGHT = "preflight"
"""The outcome of a CORS preflight, which the middleware answers itself."""


def account(
    config: Config, metrics: Metrics | None, ex: Exchange, status: int, outcome: str = ""
) -> None:
    """A request's access line and count, once it is answered (by the middleware; by
    :mod:`nexus.server.rejections` for one aiohttp answered without the app)."""
    elapsed = time.monotonic() - ex.started
    outcome = outcome or ex.outcome(status)
    if metrics is not None and ex.endpoint not in ("/metrics",):
        # A WebSocket's turns count what cut each short (realtime_turn), not the socket.
        cancelled = ex.cancelled if ex.upgraded is None else None
        metrics.observe(
            ex.endpoint, ex.model, outcome, elapsed, ex.ttft, cache=ex.cache, cancelled=cancelled
        )
        if ex.ttfb is not None:
            metrics.ttfb.labels(ex.endpoint, ex.format).observe(ex.ttfb)
    if config.logging.access_log and ex.endpoint not in ("/healthz", "/metrics"):
        failed = status >= 400 or outcome not in ("ok", PREFLIGHT)
        level = logging.WARNING if failed else logging.INFO
        if not access_log.isEnabledFor(level):
            return  # (the line is not built for a logger that drops it)
        _line(access_log, level, ex.request_id, _fields(ex, status, outcome, elapsed))


MAX_PATH_CHARS = 512
"""The URL path's longest in the access line and on the span (a client chooses it)."""


def _fields(ex: Exchange, status: int, outcome: str, elapsed: float) -> dict[str, Any]:
    """The access line's fields, in order (None: left out of the text line)."""
    spend = ex.spend
    pool_wait = ex.pool_waits.seconds
    fields: dict[str, Any] = {
        "method": ex.method or None,
        "path": ex.path or None,
        "endpoint": ex.endpoint,
        "status": status,
        "outcome": outcome,
        "model": ex.model,
        "served": ex.served,
        "format": ex.format or None,
        "provider": ex.provider or None,
        "stream_id": ex.stream_id or None,
        "key": ex.key.name if ex.key is not None else None,
        "client": ex.client,
        "client_request_id": ex.client_request_id,
        "cache": ex.cache,
        "pool_wait_ms": None if pool_wait is None else round(pool_wait * 1000, 2),
        "ttfb_ms": None if ex.ttfb is None else round(ex.ttfb * 1000, 2),
        "ttft_ms": None if ex.ttft is None else round(ex.ttft * 1000, 2),
        "duration_ms": round(elapsed * 1000, 2),
        "events": ex.events if ex.streamed else None,
        "bytes": ex.bytes if ex.streamed else None,
        "cancelled": ex.cancelled,
        "refused": ex.refused or None,
        "reason": ex.reason,
    }
    if spend is not None:
        _add_spend(fields, spend)
    return fields


def _add_spend(fields: dict[str, Any], spend: Spend) -> None:
    fields["prompt_tokens"] = spend.prompt_tokens
    fields["completion_tokens"] = spend.completion_tokens
    fields["cached_tokens"] = spend.cached_tokens
    fields["cache_write_tokens"] = spend.cache_write_tokens or None
    fields["prompt_audio_tokens"] = spend.prompt_audio_tokens or None
    fields["completion_audio_tokens"] = spend.completion_audio_tokens or None
    fields["reasoning_tokens"] = spend.reasoning_tokens
    fields["cost_usd"] = None if spend.cost_usd is None else round(spend.cost_usd, 10)
    fields["estimated"] = True if spend.estimated else None
    failed = spend.failed_attempts
    if failed is not None:  # what attempts that failed may have cost too: never charged
        fields["failed_attempts"] = failed.count
        fields["failed_attempts_prompt_tokens"] = failed.prompt_tokens
        cost = failed.cost_usd
        fields["failed_attempts_cost_usd"] = None if cost is None else round(cost, 10)


def account_at_end(
    app: web.Application,
    ex: Exchange,
    run: StreamRun,
    model: str | None = None,
    *,
    refusal: bool = False,
) -> None:
    """What ``run`` spent, in a ``nexus.spend`` line of its own when it ends, for a stream
    that outlives its request's access line: a background request's (its line is the
    202's), a resumable one its client left, each turn of a realtime socket (``model``:
    the turn's). Same request id; that access line has no spend, so no dollar is in two
    lines. ``refusal``: a failure before any output is ``error:<code>``, as the request's
    own (a turn's first frame is then its error, as a stream request's status is)."""
    if app[_CONFIG].logging.access_log:
        run.done.add_done_callback(lambda _: _spend_line(ex, run, model or ex.model, refusal))


def run_ended(run: StreamRun) -> tuple[str | None, str | None]:
    """How ``run`` (done) ended, for the span of the background request that made it
    (:func:`~nexus.telemetry.end_with`): the code of the error it failed with, and the
    reason it was ended early (its spend line's ``cancelled:<reason>``); None for each it
    did not. A cancellation is no failure, as on a stream request's span."""
    ended = Exchange(request_id="", started=0.0)
    ended.ended_with(run.events[-1])
    cause = ended.outcome(200).partition("cancelled:")[2]
    return ended.stream_failure(), cause or None


def request_spend(reader: LogReader, *, hit: bool) -> Spend | None:
    """What the request that made a stream spent, for its access line: nothing for a hit;
    for an HTTP error, only what its failed attempts may have cost (None: none did)."""
    spend = reader.spend
    if hit:
        return NOTHING
    if reader.failure is None or spend is None:
        return spend
    failed = spend.failed_attempts
    return None if failed is None else replace(NOTHING, failed_attempts=failed)


SETTLE_WAIT_S = 1.0
"""How long a request its client left waits for its stream's spend (its access line's)."""


async def settled_spend(
    app: web.Application, ex: Exchange, reader: LogReader, run: StreamRun | None
) -> Spend | None:
    """What the stream of a request its client left spent, for that request's access line:
    the reader's spend once the stream settles (waited for briefly). Else (a resumable or
    shared stream running on, a slow end) ``run``'s spend line at its end has it, and so it
    does when the wait is cancelled: aiohttp cancels the handler of a client that is gone,
    even while its cleanup waits here. Either way its dollars are in exactly one line."""
    spend = None
    try:
        spend = await reader.settled_spend(SETTLE_WAIT_S)
    finally:
        if spend is None and run is not None:
            account_at_end(app, ex, run)
    return spend


def _spend_line(ex: Exchange, run: StreamRun, model: str | None, refusal: bool) -> None:
    spend = run.spend
    if spend is None or not run.events:
        return
    ended = Exchange(request_id=ex.request_id, started=ex.started)
    ended.ended_with(run.events[-1], ex.cancelled)
    failure = run.failure if refusal else None
    outcome = ended.outcome(200) if failure is None else f"error:{failure.code}"
    level = logging.INFO if outcome == "ok" else logging.WARNING
    if not spend_log.isEnabledFor(level):
        return
    meta = run.info.meta
    fields: dict[str, Any] = {
        "endpoint": ex.endpoint,
        "outcome": outcome,
        "model": model,
        # (none for a run no target answered: its meta names the first one tried)
        "served": f"{meta.provider}/{meta.upstream_model}"
        if meta.provider and run.failure is None
        else None,
        "stream_id": run.id,
        "key": ex.key.name if ex.key is not None else None,
        "client_request_id": ex.client_request_id,
    }
    _add_spend(fields, spend)
    _line(spend_log, level, ex.request_id, fields)
