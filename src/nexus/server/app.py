"""The aiohttp application: typed state, lifecycle, routes. The only place that wires things.

``create_app(config)`` builds it; the engine's providers start and stop with
the app (``cleanup_ctx``); the encoder registry is frozen when it starts; on
shutdown, streams get ``[server] shutdown_grace_s`` to finish, then are ended
with a retryable error, and the closing that follows is bounded
(:mod:`nexus.server.shutdown`).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Sequence
from functools import partial

from aiohttp import web

from ..auth import KeyRing
from ..cache.hub import StreamHub
from ..cache.limits import BudgetPlugin, KeyLimits, LocalLimits
from ..cache.memory import MemoryStore
from ..cache.store import Store
from ..config import Config, MemoryStoreConfig, RedisStoreConfig, StoreConfig
from ..encoders.ndjson import NDJSONEncoder
from ..encoders.registry import EncoderRegistry, default_registry
from ..engine import Engine
from ..errors import ConfigError
from ..hooks import Middleware
from ..protocol.realtime import PendingLedger
from ..telemetry import Telemetry
from ..tokens import StreamTokens, new_secret, secret_from_env
from .access import KEYS, METRICS, TELEMETRY, access_middleware, stamp_response
from .connection import HANDLER_ARGS, connection_middleware
from .errors import error_middleware
from .metrics import Metrics, MetricsPlugin, ModelLabels
from .redaction import redact
from .rejections import rejection_args
from .routes import chat_completions, messages, models, realtime, responses, streams, web_console
from .routes import metrics as metrics_page
from .routes.common import expect_later
from .shutdown import closing_deadline, drain, shutdown_event
from .state import CONFIG, ENGINE, HUB, REGISTRY, REQUEST_HANDLER_ARGS, RUNTIME, TOKENS, Runtime

__all__ = ["build_store", "create_app"]

log = logging.getLogger("nexus.server")

DEFAULT_FORMATS = {
    "/v1/chat/completions": chat_completions.DEFAULT_FORMAT,
    "/v1/messages": messages.DEFAULT_FORMAT,
    "/v1/responses": responses.DEFAULT_FORMAT,
    "/v1/realtime": NDJSONEncoder.media_type,  # its streams, read at /v1/streams/{id}
}
"""The format each endpoint answers in when the client asks for none: the app's registry
must have them all."""


def create_app(
    config: Config | None = None,
    *,
    engine: Engine | None = None,
    registry: EncoderRegistry | None = None,
    store: Store | None = None,
    config_source: str = "config.toml",
    telemetry: Telemetry | None = None,
    middleware: Sequence[Middleware] = (),
) -> web.Application:
    """Build the gateway app.

    ``registry`` defaults to the process-wide one that :func:`nexus.register`
    fills; it is frozen when the app starts. ``[encoders]`` from the config are
    added to the app's own copy (a :class:`~nexus.errors.ConfigError` if one
    cannot be imported, or if the registry lacks an endpoint's default format).
    ``engine`` defaults to one built from ``config`` with ``middleware`` (to give
    both is a ``ValueError``), and ``store`` to the one ``[store]`` names
    (connected when the app starts).
    ``telemetry`` (traces) defaults to what ``[telemetry]`` describes (none without an
    ``otlp_endpoint``; a :class:`~nexus.errors.ConfigError` when it is set and the
    ``otel`` extra is not installed); the app shuts it down when it stops.
    """
    config = config or Config()
    base = registry if registry is not None else default_registry
    # Fail now on a bad [encoders] entry; the app's registry is filled at start-up,
    # so that encoders registered between create_app() and the start are included.
    _check_formats(base, config.encoders, config_source)
    formats = EncoderRegistry()
    if engine is None:
        engine = Engine.from_config(config, source=config_source)
        engine.middleware = tuple(middleware)
    elif middleware:
        raise ValueError("create_app: give the middleware to the Engine passed as engine=")
    if store is None:  # (not "store or": an empty MemoryStore is falsy, it has a len)
        store = build_store(config.store, max_log_bytes=config.streams.max_log_bytes)
    if telemetry is None:
        telemetry = Telemetry.from_config(config.telemetry)
    engine.telemetry = telemetry
    hub = StreamHub(
        engine,
        store,
        streams=config.streams,
        cache=config.cache,
        max_duration_s=config.limits.max_stream_duration_s,
        store_required=not isinstance(config.store, RedisStoreConfig) or config.store.required,
    )

    metrics = Metrics() if config.metrics.enabled else None
    # Every request handler serving the app, aiohttp's or nexus serve's: bodies inflated by
    # the routes, and an access line for what aiohttp answers without the app.
    handler_args = {**HANDLER_ARGS, **rejection_args(config, metrics)}
    app = web.Application(
        client_max_size=config.limits.max_body_bytes,
        middlewares=[connection_middleware, access_middleware, error_middleware],
        handler_args=handler_args,
    )
    app[REQUEST_HANDLER_ARGS] = handler_args
    app.on_response_prepare.append(stamp_response)  # (what the middlewares never see)
    app[CONFIG] = config
    app[ENGINE] = engine
    app[HUB] = hub
    app[KEYS] = keys = KeyRing(config.auth.keys)
    hub.limits = limits = build_limits(config, store, hub)
    # The app's plugins go to a copy of the engine's: a Hooks shared with other engines (as
    # Python callers may) hears of no stream but theirs, and one frozen by them takes these.
    if engine.served:
        raise ValueError("this Engine already serves an app: build an Engine for each app")
    engine.served, engine.hooks = True, engine.hooks.copy()
    # Budgets and metrics run before every plugin: none can keep a stream from being
    # charged and counted (one that hangs until its timeout, or raises CancelledError).
    if keys.enabled:
        budgets = BudgetPlugin(limits, keys.keys, hub.admission.slot_of)
        engine.hooks.add(budgets, name="budgets", first=True)
    app[TOKENS] = StreamTokens(_token_secret(config))
    labels = ModelLabels(engine.models(), engine.providers)  # one bound for metrics and spans
    if metrics is not None:
        app[METRICS] = metrics
        metrics.watch(hub, engine.hooks)
        metrics.model_label = labels
        engine.hooks.add(MetricsPlugin(metrics), name="metrics", first=True)
        page = metrics_page.endpoint(
            metrics_token(config), served_to_others=metrics_page.needs_token(config)
        )
        app.router.add_get("/metrics", page)
    if telemetry is not None:
        # Span names bounded as the metrics' labels; a client's text redacted as in the log.
        telemetry.model_label, telemetry.redact = labels, redact
        app[TELEMETRY] = telemetry
    app[REGISTRY] = formats
    app[RUNTIME] = Runtime(pending=PendingLedger(config.realtime.max_pending_bytes_per_key))

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        base.freeze()
        formats.include(base)
        formats.load_config(config.encoders, config_source)
        formats.freeze()
        await store.start()
        try:
            await limits.start()
            await engine.start()
            try:
                yield
                deadline = closing_deadline(app)
                await hub.shutdown(shutdown_event(), timeout_s=_left(deadline, 1.0))
            finally:
                await engine.close()
                # Spend not yet charged: retried until then, else logged as not charged.
                await limits.close(deadline=closing_deadline(app) - 0.5)
        finally:
            await _store_closed(store, closing_deadline(app))
            # The spans still queued, within the bound.
            flushed = telemetry is None or await telemetry.close(
                _left(closing_deadline(app)) or 0.1
            )
            if not flushed:
                log.warning("shutdown: the trace collector did not take the last spans")

    app.cleanup_ctx.append(lifecycle)
    app.on_shutdown.append(drain)

    # Bodies: "100 Continue" once the body is read, not before the key is checked.
    post = partial(app.router.add_post, expect_handler=expect_later)
    post("/v1/chat/completions", chat_completions.handle)
    post("/v1/messages", messages.handle)
    post("/v1/messages/count_tokens", messages.count_tokens)
    post("/v1/responses", responses.handle)
    app.router.add_get("/v1/responses/{id}", responses.retrieve)
    post("/v1/responses/{id}/cancel", responses.cancel)
    app.router.add_get("/v1/realtime", realtime.handle)
    app.router.add_get("/v1/streams/{id}", streams.get)
    app.router.add_delete("/v1/streams/{id}", streams.cancel)
    app.router.add_get("/v1/models", models.list_models)
    app.router.add_get("/v1/models/{model:.+}", models.get_model)
    app.router.add_get("/healthz", models.healthz)
    web_console.add_routes(app)
    return app


def _check_formats(base: EncoderRegistry, encoders: dict[str, str], source: str) -> None:
    """Fail now on a bad ``[encoders]`` entry, or on a registry that lacks an endpoint's
    default format (every request there would fail). Registering can only add formats,
    so what holds now holds when the app starts."""
    registry = base.copy()
    registry.load_config(encoders, source)
    for endpoint, media_type in DEFAULT_FORMATS.items():
        if registry.resolve(media_type) is None:
            raise ConfigError(
                f"the encoder registry has no {media_type!r}, the default format of "
                f"{endpoint}: start it from the built-in formats, "
                "EncoderRegistry(builtins=True)"
            )


def metrics_token(config: Config) -> bytes | None:
    """The token ``[metrics] token_env`` names (a trailing newline, as a secret file may
    leave, is not part of it); a :class:`ConfigError` when it is unset, unless ``/metrics``
    is off (``enabled = false``: no token is asked for)."""
    name = config.metrics.token_env
    if name is None or not config.metrics.enabled:
        return None
    value = os.environ.get(name, "").strip()
    if not value:
        # Its name is not repeated: a token put there by mistake looks like a name too.
        raise ConfigError("[metrics] token_env: the environment variable it names is not set")
    return value.encode()


def _left(deadline: float, keep: float = 0.0) -> float:
    """Seconds until ``keep`` seconds before ``deadline`` (event loop time), 0 if past."""
    return max(deadline - keep - asyncio.get_running_loop().time(), 0.0)


async def _store_closed(store: Store, deadline: float) -> None:
    """Close ``store``, given up at ``deadline`` (a Redis that does not answer)."""
    try:
        async with asyncio.timeout(_left(deadline) or 0.1):
            await store.close()
    except TimeoutError:
        log.warning("the store did not close in time (unreachable?): left as it is")


def _token_secret(config: Config) -> str:
    """The secret of the read tokens: from ``[auth] token_secret_env``, else a new one.

    Raises :class:`~nexus.errors.ConfigError` for a secret too short to trust. A made
    one signs tokens that only this process accepts: with keys (tokens matter) and a
    shared store (replicas), that is worth a warning.
    """
    name = config.auth.token_secret_env
    secret = secret_from_env(name, os.environ)
    if secret is None:
        secret = new_secret()
        if config.auth.keys and config.store.kind == "redis":
            log.warning(
                "read tokens are signed with a secret made by this process: a token from "
                "another replica fails here; set %s to one secret (32+ characters) on every "
                "replica sharing the store",
                name,
            )
    return secret


def build_store(config: StoreConfig, *, max_log_bytes: int | None = None) -> Store:
    """The store ``[store]`` describes (not yet connected); a shared one trims a live
    log mirrored past ``max_log_bytes`` (``[streams] max_log_bytes``)."""
    if isinstance(config, MemoryStoreConfig):
        return MemoryStore(config.max_bytes, max_bytes_per_key=config.max_bytes_per_key)
    from ..cache.redis import RedisStore

    return RedisStore(
        config.url,
        prefix=config.prefix,
        max_connections=config.max_connections,
        pool_timeout_s=config.pool_timeout_s,
        max_log_bytes=max_log_bytes,
        max_bytes_per_key=config.max_bytes_per_key,
        mirror_interval_s=config.mirror_interval_ms / 1000,
    )


def build_limits(config: Config, store: Store, hub: StreamHub) -> KeyLimits:
    """The per-key limits: in Redis with a Redis store (shared by the replicas), else
    in this process, beside the hub's count of each key's streams."""
    limits = config.limits
    local = LocalLimits(
        limits.requests_per_second_per_key, limits.max_concurrent_streams_per_key, hub.running
    )
    if not store.shared:
        return local  # (and redis-py not imported: it pulls in more than it needs)
    from ..cache.redis import RedisStore

    if not isinstance(store, RedisStore):
        return local
    from ..cache.redis_limits import RedisLimits

    return RedisLimits(
        store,
        rate=limits.requests_per_second_per_key,
        per_key=limits.max_concurrent_streams_per_key,
        lease_s=limits.stream_lease_s,
        fallback=local,
    )
