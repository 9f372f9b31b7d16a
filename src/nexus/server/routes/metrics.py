"""``GET /metrics``: who may read it, and the page.

The page names every key and what each spent, so it is for the operator only:

- With ``[metrics] token_env`` set, for whoever sends that bearer token (compared in
  constant time), under any ``Host`` name.
- Without a token, on a gateway that serves others (API keys, or ``[auth]
  allow_unauthenticated``), for no one: ``403 metrics_token_not_set``. Neither the
  peer's address nor the ``Host`` header can tell a client on this machine from one
  that a reverse proxy on this machine relays: nginx's default ``proxy_pass
  http://127.0.0.1:PORT;`` connects from 127.0.0.1 and sends ``Host: 127.0.0.1:PORT``
  for every client it serves.
- Without a token, on a keyless gateway (which answers loopback ``Host`` names only,
  the whole API): a loopback client, by a loopback name (against DNS rebinding), else
  ``403 host_not_allowed``. A proxy in front of it opens the API as much as this page,
  which then tells nothing the API does not give.

Every refusal counts in ``nexus_metrics_refused_total{reason}``, those the access
middleware makes before this route runs too (:mod:`nexus.server.access`: a keyless
gateway's ``host_not_allowed`` for a name not loopback, ``not_local`` as here; another
site's page, ``origin``); refused tokens (a scraper with a stale one, or someone guessing)
are also logged, at most once a minute.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
from collections.abc import Awaitable, Callable
from time import monotonic

from aiohttp import web

from ...auth import Forbidden, Unauthorized
from ...config import Config
from ...errors import GatewayError
from ..access import METRICS
from ..metrics import CONTENT_TYPE_LATEST
from ..origins import loopback_host

__all__ = ["WARN_EVERY_S", "endpoint", "needs_token"]

log = logging.getLogger("nexus.server")

WARN_EVERY_S = 60.0
"""The least time between two warnings of refused ``/metrics`` tokens."""


def needs_token(config: Config) -> bool:
    """Whether ``/metrics`` answers only its bearer token: the gateway serves others."""
    return bool(config.auth.keys) or config.auth.allow_unauthenticated


def endpoint(
    token: bytes | None, *, served_to_others: bool
) -> Callable[[web.Request], Awaitable[web.Response]]:
    """The ``GET /metrics`` handler: ``token`` is ``[metrics] token_env``'s, if set;
    ``served_to_others`` is :func:`needs_token` of the config."""
    warned_at = -WARN_EVERY_S
    unwarned = 0  # refused tokens since the last warning

    def refused_token(request: web.Request) -> None:
        nonlocal warned_at, unwarned
        unwarned += 1
        now = monotonic()
        if now - warned_at < WARN_EVERY_S:
            return
        log.warning(
            "/metrics refused %d request(s) for a missing or wrong bearer token since the "
            "last warning (the latest from %s)",
            unwarned,
            request.remote or "a local socket",
        )
        warned_at, unwarned = now, 0

    async def serve(request: web.Request) -> web.Response:
        metrics = request.app[METRICS]
        refusal = _refusal(request, token, served_to_others)
        if refusal is not None:
            reason, error = refusal
            metrics.metrics_refused.labels(reason).inc()
            if reason == "token":
                refused_token(request)
            raise error
        body = await metrics.scrape()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    return serve


def _refusal(
    request: web.Request, token: bytes | None, served_to_others: bool
) -> tuple[str, GatewayError] | None:
    """Why ``request`` may not read the page (the ``reason`` label, the error), or None."""
    if token is not None:
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        sent = given.strip().encode("utf-8", "surrogateescape")  # any bytes: a 401
        if scheme.lower() == "bearer" and hmac.compare_digest(sent, token):
            return None
        return "token", Unauthorized(
            "/metrics needs its bearer token ([metrics] token_env).",
            headers={"WWW-Authenticate": 'Bearer realm="nexus-metrics"'},
        )
    if served_to_others:
        return "token_not_set", Forbidden(
            "/metrics is closed: a gateway with API keys (or [auth] allow_unauthenticated) "
            "serves it only with a bearer token, and [metrics] token_env names none. Set "
            "[metrics] token_env and give the scraper that token.",
            code="metrics_token_not_set",
        )
    host = request.headers.get("Host")
    if _loopback_peer(request.remote) and (host is None or loopback_host(host)):
        return None
    return "not_local", Forbidden(
        "/metrics without [metrics] token_env answers this machine only: a loopback "
        "client, by a loopback name (localhost, 127.0.0.1, [::1]).",
        code="host_not_allowed",
    )


def _loopback_peer(remote: str | None) -> bool:
    """Whether the client's address is this machine's (a Unix socket's has none)."""
    if not remote:
        return True
    try:
        return ipaddress.ip_address(remote).is_loopback
    except ValueError:
        return False
