"""What ``nexus serve`` checks and sets before it serves: keys where the gateway is
exposed, what every worker would build, Redis reachable, the open-file limit, the event
loop. A failure is one line and an exit code (:mod:`nexus.cli`), never a restart loop."""

from __future__ import annotations

import logging

from .auth import is_loopback
from .config import Config, RedisStoreConfig
from .errors import ConfigError

__all__ = ["check_buildable", "check_exposure", "install_loop", "open_files_for", "reach"]

log = logging.getLogger("nexus")


def check_exposure(config: Config, source: str) -> None:
    """No keys on a non-loopback interface is refused, and so is any page's origin (``*``)
    without keys, where every site its user visits may spend the providers: unless the
    config says it is meant."""
    auth = config.auth
    if auth.keys or auth.allow_unauthenticated:
        return
    if "*" in config.cors.allow_origins:
        raise ConfigError(
            f"{source}: refusing [cors] allow_origins = ['*'] without API keys: any page its "
            "user opens could use your providers through this gateway. List the origins, add "
            "[[auth.keys]], or set [auth] allow_unauthenticated = true."
        )
    if is_loopback(config.server.host):
        return
    raise ConfigError(
        f"{source}: refusing to serve on {config.server.host} without API keys: anyone who "
        "can reach it could use your providers. Add [[auth.keys]] (make one with `nexus "
        "hash-key`), bind to 127.0.0.1, or set [auth] allow_unauthenticated = true."
    )


def check_buildable(config: Config, source: str) -> None:
    """What a worker builds from the config before it serves, built (and dropped) once
    before any worker forks: a :class:`ConfigError` (a provider's unset ``api_key_env``,
    an encoder that cannot be imported) is then one line, exit 2.
    Nothing here opens a connection or starts a thread."""
    from .encoders.registry import default_registry
    from .engine import Engine
    from .server.app import build_store

    if config.store.kind == "memory" and any(k.budget_usd is not None for k in config.auth.keys):
        raise ConfigError(
            f"{source}: [[auth.keys]] budget_usd with several workers needs [store] kind = "
            '"redis": with the in-memory store each worker would keep its own spend, and '
            "together they would allow each budget once per worker"
        )
    if config.server.uvloop is True:
        install_loop(True, f"{source}: [server] uvloop", install=False)
    default_registry.copy().load_config(config.encoders, source)
    Engine.from_config(config, source=source)
    build_store(config.store)


async def reach(store: RedisStoreConfig) -> None:
    """Redis answers, or :class:`~nexus.cache.redis.RedisUnavailable`: checked once
    before the workers fork (each would fail on it, be restarted and fail again)."""
    from .cache.redis import RedisStore

    probe = RedisStore(store.url, store.prefix, max_connections=1)
    try:
        await probe.start()
    finally:
        await probe.close()


def open_files_for(connections: int) -> None:
    """Raise the soft open-file limit (``ulimit -n``) towards the hard one, to twice
    ``[server] max_connections`` and a margin (a client and its upstream connection are
    a file each); below the cap itself accept() fails before the cap's 503, so warn."""
    try:
        import resource
    except ImportError:  # not on a Unix
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 2 * connections + 256
    if hard != resource.RLIM_INFINITY:
        wanted = min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (ValueError, OSError):
            pass
    if soft != resource.RLIM_INFINITY and soft < connections:
        log.warning(
            "[server] max_connections is %d, but a process may open only %d files "
            "(ulimit -n): past that, connections are refused without the 503",
            connections,
            soft,
        )


def install_loop(uvloop_wanted: bool | str, wanted_by: str, *, install: bool = True) -> None:
    """uvloop as the event loop, where ``uvloop_wanted`` asks for it; a
    :class:`ConfigError` naming ``wanted_by`` (the file's key, or ``--loop``) when it is
    required and not installed."""
    if uvloop_wanted is False:
        return
    try:
        import uvloop  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        if uvloop_wanted is True:
            raise ConfigError(
                f"{wanted_by}: uvloop is not installed (pip install 'nexus-gateway[uvloop]')"
            ) from None
        return
    if install:
        uvloop.install()
