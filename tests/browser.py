"""Real-browser helpers: headless Chromium through Playwright, and a proxy that cuts a stream.

Chromium is Debian's (``apt-get install chromium``), launched by path: nothing
downloads a browser. Without it or the ``playwright`` package the browser tests
are skipped, or fail when ``CI=true``.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import re
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from playwright.async_api import Browser

__all__ = ["CHROMIUM", "CuttingProxy", "chromium", "require"]

CHROMIUM = "/usr/bin/chromium"
# Without the background-networking flags Chromium keeps dialling Google's hosts,
# which this closed network refuses.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
_WS_EXTENSIONS = re.compile(rb"\r\nSec-WebSocket-Extensions:[^\r]*", re.IGNORECASE)


def require() -> None:
    """Skip the calling test module without Playwright or Chromium; fail it instead under CI."""
    if importlib.util.find_spec("playwright") is None:
        reason = "the playwright package is not installed (pip install playwright)"
    elif not os.access(CHROMIUM, os.X_OK):
        reason = f"{CHROMIUM} is missing (apt-get install chromium)"
    else:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"browser tests cannot run: {reason}", pytrace=False)
    pytest.skip(f"browser tests skipped: {reason}", allow_module_level=True)


@contextlib.asynccontextmanager
async def chromium() -> AsyncIterator[Browser]:
    """Headless Chromium; Playwright starts it on a fresh, temporary user data dir."""
    from playwright.async_api import async_playwright

    async with async_playwright() as pw:
        launched = await pw.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS
        )
        try:
            yield launched
        finally:
            await launched.close()


class CuttingProxy:
    """A TCP proxy to ``127.0.0.1:upstream_port`` that breaks one response mid-frame.

    The first connection that carries a request starting with ``request_prefix``
    (e.g. ``b"GET /v1/streams/"``) is armed: once ``after`` occurrences of
    ``marker`` have come back in its response, the proxy passes half of the
    last one and resets both sides, as a network failure would. Every other
    connection, and every later one, passes untouched, but for one thing: the
    proxy drops ``Sec-WebSocket-Extensions`` from upgrade requests, so that
    WebSocket frames are not compressed and the marker can be seen in them.
    While ``down``, it stands for a gateway that is down: every connection is reset at
    once (:meth:`go_down` also resets those open).
    """

    def __init__(self, upstream_port: int, request_prefix: bytes, marker: bytes, after: int):
        self.upstream_port = upstream_port
        self.request_prefix = request_prefix
        self.marker = marker
        self.after = after
        self.cut = asyncio.Event()
        self.port = 0
        self._armed = False
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self.down = False

    def go_down(self) -> None:
        self.down = True
        for writer in list(self._writers):
            writer.transport.abort()

    async def __aenter__(self) -> CuttingProxy:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._server is not None
        self._server.close()
        for writer in list(self._writers):
            writer.transport.abort()
        if self._handlers:
            await asyncio.wait(list(self._handlers))
        await self._server.wait_closed()

    async def _handle(
        self, client_in: asyncio.StreamReader, client_out: asyncio.StreamWriter
    ) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        self._writers.add(client_out)
        server_out: asyncio.StreamWriter | None = None
        try:
            if self.down:
                client_out.transport.abort()
                raise ConnectionResetError("the gateway is down")
            server_in, server_out = await asyncio.open_connection("127.0.0.1", self.upstream_port)
            self._writers.add(server_out)
            armed = asyncio.Event()  # this connection carries the request to cut
            pipes = [
                asyncio.ensure_future(self._upstream(client_in, server_out, armed)),
                asyncio.ensure_future(self._downstream(server_in, client_out, server_out, armed)),
            ]
            await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
            for pipe in pipes:
                pipe.cancel()
            for result in await asyncio.gather(*pipes, return_exceptions=True):
                if isinstance(result, Exception) and not isinstance(result, ConnectionError):
                    raise result
        except ConnectionError:
            pass
        finally:
            for writer in (client_out, server_out):
                if writer is not None:
                    writer.close()
                    self._writers.discard(writer)
            self._handlers.discard(task)

    async def _upstream(
        self,
        client_in: asyncio.StreamReader,
        server_out: asyncio.StreamWriter,
        armed: asyncio.Event,
    ) -> None:
        while data := await client_in.read(65536):
            if not self._armed and data.startswith(self.request_prefix):
                self._armed = True
                armed.set()
            head, blank, body = data.partition(b"\r\n\r\n")
            if blank and b"upgrade: websocket" in head.lower():
                data = _WS_EXTENSIONS.sub(b"", head) + blank + body
            server_out.write(data)
            await server_out.drain()

    async def _downstream(
        self,
        server_in: asyncio.StreamReader,
        client_out: asyncio.StreamWriter,
        server_out: asyncio.StreamWriter,
        armed: asyncio.Event,
    ) -> None:
        response = bytearray()  # of the armed request
        while data := await server_in.read(65536):
            if armed.is_set() and not self.cut.is_set():
                start = len(response)
                response.extend(data)
                if response.count(self.marker) >= self.after:
                    at = -1
                    for _ in range(self.after):
                        at = response.index(self.marker, at + 1)
                    # Half of the last marker goes through: the cut falls inside a frame.
                    client_out.write(data[: max(at + len(self.marker) // 2 - start, 0)])
                    await client_out.drain()
                    self.cut.set()
                    client_out.transport.abort()
                    server_out.transport.abort()
                    return
            client_out.write(data)
            await client_out.drain()
