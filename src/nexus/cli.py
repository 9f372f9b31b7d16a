"""The ``nexus`` command: ``nexus serve [--config PATH] [--host H] [--port P]``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from pathlib import Path

from aiohttp import web

from .config import Config, load_config
from .errors import ConfigError

log = logging.getLogger("nexus")

DEFAULT_CONFIG = "config.toml"


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
    serve.add_argument("--log-level", default="INFO", help="logging level (default: INFO)")
    args = parser.parse_args(argv)

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config, source = _load(args.config)
        server = config.server
        updates = {}
        if args.host is not None:
            updates["host"] = args.host
        if args.port is not None:
            if not 0 <= args.port <= 65535:
                raise ConfigError(f"--port: {args.port} is not a port number (0-65535)")
            updates["port"] = args.port
        if updates:
            config = config.model_copy(update={"server": server.model_copy(update=updates)})
        return _serve(config, source)
    except ConfigError as exc:
        print(f"nexus: config error: {exc}", file=sys.stderr)
        return 2


def _load(path: str | None) -> tuple[Config, str]:
    if path is not None:
        return load_config(path), path
    if Path(DEFAULT_CONFIG).exists():
        return load_config(DEFAULT_CONFIG), DEFAULT_CONFIG
    log.info("no ./%s here: using the built-in default (mock provider)", DEFAULT_CONFIG)
    return Config(), "built-in default"


def _serve(config: Config, source: str) -> int:
    if config.server.uvloop:
        try:
            import uvloop  # type: ignore[import-not-found, unused-ignore]
        except ImportError:
            raise ConfigError(
                f"{source}: [server] uvloop: uvloop is not installed "
                "(pip install 'nexus-gateway[uvloop]')"
            ) from None
        uvloop.install()
    try:
        asyncio.run(_run(config, source))
    except OSError as exc:
        print(
            f"nexus: cannot serve on {config.server.host}:{config.server.port}: {exc.strerror}",
            file=sys.stderr,
        )
        return 1
    return 0


async def _run(config: Config, source: str) -> None:
    from .server.app import create_app

    app = create_app(config, config_source=source)
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        shutdown_timeout=config.server.shutdown_grace_s + 5,
    )
    await runner.setup()
    try:
        site = web.TCPSite(runner, config.server.host, config.server.port)
        await site.start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        log.info("event loop: %s", type(loop).__module__.split(".")[0])
        for address in runner.addresses:
            host, port = address[0], address[1]
            shown = f"[{host}]" if ":" in host else host
            log.info("Nexus serving on http://%s:%d (config: %s)", shown, port, source)
        await stop.wait()
        log.info("stopping: no new connections; streams get %.1fs", config.server.shutdown_grace_s)
    finally:
        await runner.cleanup()
    log.info("stopped")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
