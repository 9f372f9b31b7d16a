"""A minimal aiohttp reverse proxy that copies bytes without parsing them.

The floor for any gateway built on aiohttp: the request body streams through to the
upstream, each piece of the response body is written on as it arrives
(``iter_any()`` -> ``StreamResponse.write``), nothing is decoded, logged or counted.
Only hop-by-hop headers are dropped (RFC 9110 §7.6.1). A client that leaves cancels
the handler (``handler_cancellation``), which closes the upstream connection.

It runs on uvloop where uvloop is installed, as ``nexus serve`` does by default
(``--loop asyncio`` for asyncio's own): the floor should have the gateway's loop.

Run: ``python -m bench.rawproxy --upstream http://127.0.0.1:P [--port Q]``;
prints ``event loop: <name>`` and ``READY <port>`` when listening.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal

import aiohttp
from aiohttp import web

from .procfs import new_loop, raise_nofile

__all__ = ["create_app", "main"]

_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
    }
)
SESSION = web.AppKey("session", aiohttp.ClientSession)
UPSTREAM = web.AppKey("upstream", str)


async def proxy(request: web.Request) -> web.StreamResponse:
    headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
    async with request.app[SESSION].request(
        request.method,
        request.app[UPSTREAM] + request.rel_url.raw_path_qs,
        headers=headers,
        data=request.content if request.body_exists else None,
        allow_redirects=False,
    ) as upstream:
        response = web.StreamResponse(
            status=upstream.status,
            headers={
                k: v
                for k, v in upstream.headers.items()
                if k.lower() not in _HOP and k.lower() != "content-length"
            },
        )
        await response.prepare(request)
        async for piece in upstream.content.iter_any():
            await response.write(piece)
        await response.write_eof()
        return response


async def _session(app: web.Application):  # type: ignore[no-untyped-def]
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(
        connector=connector, timeout=timeout, auto_decompress=False
    ) as session:
        app[SESSION] = session
        yield


def create_app(upstream: str) -> web.Application:
    app = web.Application()
    app[UPSTREAM] = upstream.rstrip("/")
    app.cleanup_ctx.append(_session)
    app.router.add_route("*", "/{tail:.*}", proxy)
    return app


async def serve(upstream: str, host: str, port: int) -> None:
    runner = web.AppRunner(create_app(upstream), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0][1]
    print(f"READY {bound}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", required=True, help="base URL, e.g. http://127.0.0.1:9000")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--loop", choices=("auto", "asyncio"), default="auto")
    args = parser.parse_args()
    raise_nofile()
    factory = new_loop if args.loop == "auto" else asyncio.new_event_loop
    with contextlib.suppress(KeyboardInterrupt), asyncio.Runner(loop_factory=factory) as runner:
        print(f"event loop: {type(runner.get_loop()).__module__.split('.')[0]}", flush=True)
        runner.run(serve(args.upstream, args.host, args.port))


if __name__ == "__main__":
    main()
