"""The ``nexus`` command: ``nexus serve``, ``nexus hash-key`` and ``nexus keys``."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

from aiohttp import web
from pydantic import ValidationError

from .auth import ApiKey, KeyRing, hash_key, new_key
from .budgets import key_table, window
from .cache.limits import KeyLimits, LocalLimits
from .config import AuthKeyConfig, Config, RedisStoreConfig, load_config
from .config_errors import in_file
from .errors import ConfigError
from .log_context import RequestIds
from .serve_checks import check_buildable, check_exposure, install_loop, open_files_for, reach
from .server import redaction
from .server.log_lines import JsonFormatter, WorkerTag, text_formatter
from .supervisor import (
    CONFIG_ERROR,
    HURRY_SIGNAL,
    STOP_SIGNALS,
    STORE_UNREACHABLE,
    Supervisor,
    cpu_count,
)
from .telemetry import check_installed

log = logging.getLogger("nexus")

GC_THRESHOLD = 10_000
"""The collector's first threshold in a gateway process."""

DEFAULT_CONFIG = "config.toml"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nexus", description="Nexus, a streaming LLM gateway.")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the gateway")
    serve.add_argument(
        "--config",
        help=f"path of the config file (default: ./{DEFAULT_CONFIG}, "
        "else the built-in default with the mock provider)",
    )
    serve.add_argument("--host", help="interface to bind (default: [server] host, 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port to bind (default: [server] port, 8080)")
    serve.add_argument(
        "--workers",
        type=_workers_arg,
        help="worker processes sharing the port, or 'auto' for one per core "
        "(default: [server] workers, 1)",
    )
    serve.add_argument(
        "--loop",
        choices=("auto", "uvloop", "asyncio"),
        help="event loop: uvloop where installed (auto), required, or asyncio's own "
        "(default: [server] uvloop, auto)",
    )
    serve.add_argument(
        "--log-level",
        default="INFO",
        type=str.upper,
        choices=LOG_LEVELS,
        help="logging level (default: INFO)",
    )
    hash_key = commands.add_parser(
        "hash-key",
        help="make a new API key and print it with its SHA-256 for [[auth.keys]]",
        description="Without options: a new random key, and the [[auth.keys]] entry that "
        "admits it. With --stdin: the SHA-256 of a key read from standard input (keys on "
        "the command line would show in the process list).",
    )
    hash_key.add_argument("--stdin", action="store_true", help="hash a key read from stdin")
    hash_key.add_argument("--name", default="my-app", help="the key's name in the entry")
    keys = commands.add_parser(
        "keys",
        help="print each API key's models, budget and spend in the current period",
        description="Each [[auth.keys]] entry: its models, budget, period, what it spent in "
        "the current period and when that resets, read from the configured store (Redis: "
        "what every replica charged; the memory store lives in the gateway's process, "
        "so its spend is not shown).",
    )
    keys.add_argument("--config", help=f"path of the config file (default: ./{DEFAULT_CONFIG})")
    args = parser.parse_args(argv)
    if args.command == "hash-key":
        return _hash_key(args.stdin, args.name)
    source: str | None = None
    try:
        config, source = _load(args.config)
        if args.command == "keys":
            if source == BUILT_IN:  # (it has no keys: the gateway's config is elsewhere)
                raise ConfigError(f"keys: no ./{DEFAULT_CONFIG} here; give --config PATH")
            return asyncio.run(_keys(config))
        if args.port is not None and not 0 <= args.port <= 65535:
            raise ConfigError(f"--port: {args.port} is not a port number (0-65535)")
        uvloop = {"auto": "auto", "uvloop": True, "asyncio": False}.get(args.loop)
        if uvloop is True:  # checked here, where the flag can be named
            install_loop(True, "--loop uvloop", install=False)
        given = {"host": args.host, "port": args.port, "workers": args.workers, "uvloop": uvloop}
        server = {name: value for name, value in given.items() if value is not None}
        if server:
            config = config.model_copy(update={"server": config.server.model_copy(update=server)})
        _setup_logging(args.log_level.upper(), config.logging.format)
        check_exposure(config, source)
        check_installed(config.telemetry)  # once, before any worker starts
        from .server.app import metrics_token
        from .server.routes.metrics import needs_token

        token = metrics_token(config)  # set when named: checked before any worker starts
        if token is None and config.metrics.enabled and needs_token(config):
            log.warning(
                "/metrics answers 403 to every client until [metrics] token_env names its "
                "bearer token: with API keys (or allow_unauthenticated) a client on this "
                "machine cannot be told from one a reverse proxy here relays"
            )
        return _serve(config, source)
    except ConfigError as exc:
        print(f"nexus: config error: {in_file(str(exc), source)}", file=sys.stderr)
        return CONFIG_ERROR


def _workers_arg(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        count = int(value)
    except ValueError:
        count = 0
    if count < 1:
        raise argparse.ArgumentTypeError(f"{value!r}: a number of workers (1 or more) or 'auto'")
    return count


def _hash_key(from_stdin: bool, name: str) -> int:
    if from_stdin:
        key = sys.stdin.readline().strip()
        if not key:
            print("nexus: hash-key: no key on standard input", file=sys.stderr)
            return 2
        print(hash_key(key))
        return 0
    try:  # the rule [[auth.keys]] applies: the entry printed must load, and be one entry
        AuthKeyConfig.model_validate({"name": name, "sha256": "0" * 64})
    except ValidationError:
        print(
            "nexus: hash-key: --name: a key name is 1 to 64 characters of A-Z, a-z, 0-9 "
            "and _ . @ : -",
            file=sys.stderr,
        )
        return 2
    key = new_key()
    print(f"key:    {key}")
    print(f"sha256: {hash_key(key)}")
    print("\n# config.toml (the key itself is not stored):")
    print(f'[[auth.keys]]\nname = "{name}"\nsha256 = "{hash_key(key)}"')
    return 0


async def _keys(config: Config) -> int:
    """``nexus keys``: one line per key (see :func:`nexus.budgets.key_table`)."""
    ring = KeyRing(config.auth.keys)
    if not ring.enabled:
        print("No [[auth.keys]] configured.")
        return 0
    store = config.store
    limits: KeyLimits | None = None
    client = None
    errors: tuple[type[Exception], ...] = (OSError,)
    if isinstance(store, RedisStoreConfig):
        import redis.asyncio as aioredis
        from redis.exceptions import RedisError

        from .cache.redis import RedisStore
        from .cache.redis_limits import RedisLimits
        from .cache.redis_url import redact_url

        client = aioredis.Redis.from_url(store.url, socket_timeout=5.0, socket_connect_timeout=5.0)
        limits = RedisLimits(
            RedisStore(store.url, store.prefix, client=client),
            rate=0.0,
            per_key=None,
            lease_s=config.limits.stream_lease_s,
            fallback=LocalLimits(0.0, None),
        )
        errors = (OSError, RedisError)
    now = time.time()
    rows = []
    try:
        for key in ring.keys:
            row = {
                "name": key.name,
                "models": ",".join(key.models) if key.models is not None else "*",
            }
            if key.budget_usd is not None:
                row["budget_usd"] = f"{key.budget_usd:g}"
            # Spend is kept per period for every key (``month`` unless it says otherwise).
            row["period"] = key.budget_period
            row["resets_at"] = window(key.budget_period, now).resets_iso() or "never"
            if limits is not None:
                row["spent_usd"] = await _spent(limits, key)
            rows.append(row)
    except errors as exc:
        assert isinstance(store, RedisStoreConfig)
        print(
            f"nexus: keys: Redis not reachable at {redact_url(store.url)}: {type(exc).__name__}",
            file=sys.stderr,
        )
        return 1
    finally:
        if client is not None:
            await client.aclose()
    print(key_table(rows))
    if limits is None:
        print("(spend: the memory store is in the gateway's process; not readable from here)")
    return 0


async def _spent(limits: KeyLimits, key: ApiKey) -> str:
    """What ``key`` spent in its period, as ``nexus keys`` shows it; a value in Redis
    that is not a number (written by hand?) is said, not a traceback."""
    try:
        return f"{await limits.spent(key):.6f}"
    except ValueError:
        print(f"nexus: keys: the spend of {key.name!r} in Redis is not a number", file=sys.stderr)
        return "?"


def _setup_logging(level: str, fmt: str) -> None:
    handler = logging.StreamHandler()
    handler.addFilter(RequestIds())
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(text_formatter())
    logging.basicConfig(level=level, handlers=[handler], force=True)
    # aiohttp logs raw request bytes (parser errors): credentials in them are redacted.
    redaction.install()


BUILT_IN = "built-in default"


def _load(path: str | None) -> tuple[Config, str]:
    if path is not None:
        return load_config(path), path
    if Path(DEFAULT_CONFIG).exists():
        return load_config(DEFAULT_CONFIG), DEFAULT_CONFIG
    log.info("no ./%s here: using the built-in default (mock provider)", DEFAULT_CONFIG)
    return Config(), BUILT_IN


def _serve(config: Config, source: str) -> int:
    open_files_for(config.server.max_connections)
    workers = config.server.workers
    count = cpu_count() if workers == "auto" else workers
    if count == 1:
        return _serve_one(config, source)
    check_buildable(config, source)  # once here: in each worker it would be a restart loop
    try:
        if isinstance(config.store, RedisStoreConfig):
            asyncio.run(reach(config.store))
        return Supervisor(config, source, count, _serve_one).run()
    except OSError as exc:  # the port (taken, or a host not of this machine), or Redis
        return _cannot_serve(config, exc)


def _cannot_serve(config: Config, exc: OSError, worker: int | None = None) -> int:
    """One line for a port the gateway cannot have (or a store it cannot reach), and exit
    code 1 (a worker's for the store: :data:`~nexus.supervisor.STORE_UNREACHABLE`)."""
    from .cache.redis import RedisUnavailable

    if isinstance(exc, RedisUnavailable):  # its message names the URL without credentials
        _say(f"cannot start: {exc}", worker)
        return 1 if worker is None else STORE_UNREACHABLE
    # asyncio's bind error repeats the address in its strerror: the errno's text alone;
    # a name that does not resolve has its resolver's text (its errno is no OS error's).
    if isinstance(exc, socket.gaierror):
        why = exc.strerror or str(exc)
    else:
        why = os.strerror(exc.errno) if exc.errno else str(exc) or type(exc).__name__
    _say(f"cannot serve on {config.server.host}:{config.server.port}: {why}", worker)
    return 1


def _say(line: str, worker: int | None) -> None:
    """Why it cannot serve: on stderr, or a worker's log line (a JSON log takes no other)."""
    if worker is None:
        print(f"nexus: {line}", file=sys.stderr)
    else:
        log.error("worker %d: %s", worker, line)


def _serve_one(
    config: Config, source: str, worker: int | None = None, ready: Callable[[], None] | None = None
) -> int:
    """One gateway process: the whole server, or worker ``worker`` of several."""
    install_loop(config.server.uvloop, f"{source}: [server] uvloop")
    # Each token leaves a few short-lived containers: at the default threshold (700) the
    # collector took ~20% of the CPU at saturation (bench/README.md). This process only.
    gc.set_threshold(GC_THRESHOLD, 20, 20)
    try:
        asyncio.run(_run(config, source, worker, ready))
    except OSError as exc:
        return _cannot_serve(config, exc, worker)
    except ConfigError as exc:  # (the supervisor checked, but not what only a worker sees)
        _say(f"config error: {in_file(str(exc), source)}", worker)
        return CONFIG_ERROR
    return 0


async def _run(
    config: Config,
    source: str,
    worker: int | None = None,
    ready: Callable[[], None] | None = None,
) -> None:
    from .server.access import METRICS
    from .server.app import create_app
    from .server.connection import ConnectionRegistry, ConnectionSite
    from .server.shutdown import stop as stop_server
    from .server.state import RUNTIME

    if worker is not None:
        for handler in logging.getLogger().handlers:
            handler.addFilter(WorkerTag(worker))
    # Its request handlers' access logger is the app's own (nexus.server.rejections): one
    # nexus.access line per request, and aiohttp's own access lines are not written.
    app = create_app(config, config_source=source)
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        # What a handler still running once the streams ended may take (each of two
        # steps): the drain (nexus.server.shutdown) has waited for the streams already.
        shutdown_timeout=0.5,
    )
    await runner.setup()
    site: ConnectionSite | None = None
    stop = asyncio.Event()
    try:
        registry = ConnectionRegistry(
            header_timeout_s=config.server.header_timeout_s,
            keepalive_timeout_s=config.server.keepalive_timeout_s,
            max_connections=config.server.max_connections,
            write_timeout_s=config.server.write_timeout_s,
        )
        metrics = app.get(METRICS)
        if metrics is not None:
            registry.on_refused.append(metrics.connections_refused.inc)
        site = ConnectionSite(
            runner,
            config.server.host,
            config.server.port,
            registry=registry,
            backlog=config.server.backlog,
            reuse_port=worker is not None,
        )
        await site.start()
        # What starting made (modules, config, the app) lives as long as the process: out
        # of the collector's reach, a full collection under load walks only what serving
        # made (its garbage collected first: frozen, it would stay).
        gc.collect()
        gc.freeze()
        loop = asyncio.get_running_loop()
        # SIGHUP too (its terminal closed, or `kill -HUP` meaning "reload" elsewhere):
        # its default would end the process at once, streams cut and spend uncharged.
        runtime = runner.app[RUNTIME]

        def on_signal(hurry: bool) -> None:
            if hurry and not runtime.hurry.is_set():  # no more drain delay nor grace
                log.warning("stopping now: the drain delay and the grace are cut short")
                runtime.hurry.set()
            stop.set()

        # A worker's second stop is its supervisor's to tell (a group's signal comes twice).
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, lambda: on_signal(worker is None and stop.is_set()))
        if worker is not None:
            loop.add_signal_handler(HURRY_SIGNAL, on_signal, True)
        loop_name = type(loop).__module__.split(".")[0]
        if ready is not None:
            ready()
        if worker is not None:
            log.info("worker %d (pid %d) ready, event loop: %s", worker, os.getpid(), loop_name)
        else:
            log.info("event loop: %s", loop_name)
            for address in site.addresses:
                host, port = address[0], address[1]
                shown = f"[{host}]" if ":" in host else host
                log.info("Nexus serving on http://%s:%d (config: %s)", shown, port, source)
        await stop.wait()
    finally:
        if site is not None and stop.is_set():
            # The grace runs while every connection is still read: then aiohttp's cleanup.
            await stop_server(runner, site.close_listener())
        else:  # it never served (the port, say)
            await runner.cleanup()
    log.info("stopped")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
