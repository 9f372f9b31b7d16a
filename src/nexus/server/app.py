"""The aiohttp application: typed state, lifecycle, routes. The only place that wires things.

``create_app(config)`` builds it; the engine's providers start and stop with
the app (``cleanup_ctx``); the encoder registry is frozen when it starts; on
shutdown, streams get ``[server] shutdown_grace_s`` to finish, then are ended
with a retryable error (see :mod:`nexus.server.streaming`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from aiohttp import web

from ..config import Config
from ..encoders.registry import EncoderRegistry, default_registry
from ..engine import Engine
from .errors import error_middleware
from .routes import chat_completions, messages, models, realtime, responses
from .state import CONFIG, ENGINE, REGISTRY, RUNTIME, Runtime

__all__ = ["create_app"]

log = logging.getLogger("nexus.server")


def create_app(
    config: Config | None = None,
    *,
    engine: Engine | None = None,
    registry: EncoderRegistry | None = None,
    config_source: str = "config.toml",
) -> web.Application:
    """Build the gateway app.

    ``registry`` defaults to the process-wide one that :func:`nexus.register`
    fills; it is frozen when the app starts. ``[encoders]`` from the config are
    added to the app's own copy (a :class:`~nexus.errors.ConfigError` if one
    cannot be imported). ``engine`` defaults to one built from ``config``.
    """
    config = config or Config()
    base = registry if registry is not None else default_registry
    # Fail now on a bad [encoders] entry; the app's registry is filled at start-up,
    # so that encoders registered between create_app() and the start are included.
    base.copy().load_config(config.encoders, config_source)
    formats = EncoderRegistry()
    engine = engine or Engine.from_config(config)

    app = web.Application(
        client_max_size=config.limits.max_body_bytes,
        middlewares=[error_middleware],
    )
    app[CONFIG] = config
    app[ENGINE] = engine
    app[REGISTRY] = formats
    app[RUNTIME] = Runtime()

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        base.freeze()
        formats.include(base)
        formats.load_config(config.encoders, config_source)
        formats.freeze()
        await engine.start()
        yield
        await engine.close()

    app.cleanup_ctx.append(lifecycle)
    app.on_shutdown.append(_drain_streams)

    app.router.add_post("/v1/chat/completions", chat_completions.handle)
    app.router.add_post("/v1/messages", messages.handle)
    app.router.add_post("/v1/responses", responses.handle)
    app.router.add_get("/v1/realtime", realtime.handle)
    app.router.add_get("/v1/models", models.list_models)
    app.router.add_get("/v1/models/{model:.+}", models.get_model)
    app.router.add_get("/healthz", models.healthz)
    return app


async def _drain_streams(app: web.Application) -> None:
    runtime = app[RUNTIME]
    runtime.shutting_down = True
    grace = app[CONFIG].server.shutdown_grace_s
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace

    def busy() -> int:
        return len(runtime.active) + sum(1 for s in runtime.sockets if s.busy)

    if busy():
        log.info("waiting up to %.1fs for %d streams to finish", grace, busy())
    while busy() and loop.time() < deadline:
        await asyncio.sleep(min(0.05, max(deadline - loop.time(), 0)))
    remaining = list(runtime.active)
    if busy():
        log.warning("ending %d streams still running after the grace period", busy())
    for pump in remaining:
        pump.shutdown()
    await asyncio.gather(*(socket.shutdown() for socket in list(runtime.sockets)))
    # Let the cancelled pumps write their error frames and close their providers.
    for _ in range(100):
        if not runtime.active:
            break
        await asyncio.sleep(0.01)
