"""The upstream client (``nexus.providers.connections``, ``http1``) at its edges under attack
(a hostile or broken upstream, a flood of cancellations), against real local sockets; each
test named for what it keeps from breaking, the helpers test_upstream_connections'."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import socket
import ssl
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import test_upstream_connections
import trustme
from test_upstream_connections import (
    FRAMES,
    RawUpstream,
    batches,
    endless,
    openai,
    response,
    send,
    stream,
    until,
)

from nexus.config import OpenAIProviderConfig
from nexus.errors import ConfigError, UpstreamError
from nexus.events import Delta
from nexus.providers import build_provider, connections
from upstreams import FakeUpstream, Reply, openai_chunk

ca = test_upstream_connections.ca  # the fixture: a CA, and its certificate's file


def closed_under_the_loop() -> list[int]:
    """The fds the loop watches for a live transport whose socket is not open under that
    number any more (closed under it: the next socket opened gets the number)."""
    stale = []
    for fd, transport in list(getattr(asyncio.get_running_loop(), "_transports", {}).items()):
        if transport is not None and not transport.is_closing():
            with contextlib.suppress(OSError):
                if transport.get_extra_info("socket").fileno() == fd and os.fstat(fd):
                    continue
            stale.append(fd)
    return stale


async def drain(reading: Any) -> None:
    """A stream read to its end, closed however it ends (as the run's source.close())."""
    try:
        async for _ in reading:
            pass
    finally:
        await reading.aclose()


async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await reader.read()


@contextlib.asynccontextmanager
async def tls_server(
    authority: trustme.CA, serve: Callable[..., Awaitable[None]] = hold
) -> AsyncIterator[str]:
    """A TLS server for ``localhost`` running ``serve`` on each connection; its URL."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    authority.issue_cert("localhost").configure_cert(context)
    writers: set[asyncio.StreamWriter] = set()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.add(writer)
        try:
            with contextlib.suppress(OSError, asyncio.IncompleteReadError):
                await serve(reader, writer)
        finally:
            writers.discard(writer)
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=context)
    try:
        yield f"https://localhost:{server.sockets[0].getsockname()[1]}/v1"
    finally:
        server.close()
        for writer in list(writers):
            writer.close()
        await until(lambda: not writers, 2)


# --- 1. a cancelled connect ---------------------------------------------------------------


async def test_a_connect_cancelled_as_its_tls_handshake_ends_closes_no_socket_under_the_loop(
    ca: tuple[trustme.CA, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cancelled in the turn the handshake ends (its client left), the connect closed the
    socket its TLS transport still owned: the loop went on watching the number, and the
    next socket given it (an upstream's: RuntimeError; a client's: never read) broke."""
    authority, ca_file = ca
    made = connections.Connection.connection_made

    def leave_as_made(self: Any, transport: asyncio.BaseTransport) -> None:
        made(self, transport)
        victim.cancel()

    async with tls_server(authority) as url:
        pool = connections.ConnectionPool(url, 0, 5.0, ssl.create_default_context(cafile=ca_file))
        monkeypatch.setattr(connections.Connection, "connection_made", leave_as_made)
        victim = asyncio.create_task(pool.acquire())
        with pytest.raises(asyncio.CancelledError):
            await victim
        monkeypatch.setattr(connections.Connection, "connection_made", made)
        assert closed_under_the_loop() == []
        assert pool.busy == 0
        pool.release(await asyncio.wait_for(pool.acquire(), 2), reuse=False)  # the next works
        pool.close()


CHUNKED = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
CHUNK = b"%x\r\n%s\r\n" % (len(FRAMES[0]), FRAMES[0])
END = b"".join(FRAMES[1:])


async def test_hundreds_of_cancellations_at_every_phase_leave_the_pool_and_loop_sound(
    ca: tuple[trustme.CA, str],
) -> None:
    """Streams cancelled at random while in line, connecting (TLS), waiting for a head,
    reading an error or a body, or draining: none ends in RuntimeError or ValueError
    (internal_error), no place stays taken, no socket is closed under the loop."""
    authority, ca_file = ca
    rng = random.Random(7)

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async def send(data: bytes, pause: float = 0.0) -> None:
            await asyncio.sleep(rng.random() * pause)
            if writer.is_closing():
                raise ConnectionResetError  # the client left
            writer.write(data)

        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            await reader.readexactly(int(head.lower().split(b"content-length: ")[1].split()[0]))
            kind = rng.choice(["ok", "slowhead", "slowerror", "slowbody", "lateend"])
            if kind == "slowerror":
                await send(b"HTTP/1.1 503 No\r\nContent-Length: 100\r\n\r\n" + b"e" * 50)
                await send(b"e" * 50, 0.05)
                continue
            await send(CHUNKED, 0.05 if kind == "slowhead" else 0)
            for _ in range(3):
                await send(CHUNK, 0.02 if kind == "slowbody" else 0)
            await send(b"%x\r\n%s\r\n" % (len(END), END))
            await send(b"0\r\n\r\n", 0.08 if kind == "lateend" else 0)  # around the 50 ms drain

    outcomes: dict[str, int] = {}
    options = {"max_connections": 20, "first_byte_timeout_s": 1, "idle_timeout_s": 1}
    async with tls_server(authority, serve) as url, openai(url, ca_file=ca_file, **options) as p:
        loop = asyncio.get_running_loop()
        for _ in range(4):
            tasks = [asyncio.create_task(drain(batches(p))) for _ in range(80)]
            for i, task in enumerate(tasks):
                if i % 8:  # (every eighth runs to its end, however slow the host)
                    loop.call_later(rng.random() * 0.12, task.cancel)
            for result in await asyncio.gather(*tasks, return_exceptions=True):
                kind = type(result).__name__ if isinstance(result, BaseException) else "ok"
                outcomes[kind] = outcomes.get(kind, 0) + 1
        assert p._pool is not None and p._pool.busy == 0
        assert closed_under_the_loop() == []
    assert "RuntimeError" not in outcomes and "ValueError" not in outcomes, outcomes
    assert outcomes.get("CancelledError", 0) > 100 and outcomes.get("ok", 0) > 0, outcomes


# --- 2. a wait in line given up, or ended by the pool's close -----------------------------


@pytest.mark.parametrize("end", ["given up as a stream ends", "the pool closing"])
async def test_a_wait_in_line_ends_cancelled_or_closed_never_in_a_valueerror(end: str) -> None:
    """Its waiter was removed from the line though no longer in it (skipped as cancelled,
    or the line taken by close()): ValueError, an internal_error, took the place of both."""
    async with RawUpstream() as up:
        pool = connections.ConnectionPool(up.url, 1, 5.0)
        held = await pool.acquire()
        waiting = asyncio.create_task(pool.acquire())
        await asyncio.sleep(0)
        closing = end == "the pool closing"
        if closing:
            pool.close()
        else:
            waiting.cancel()  # its client left, or its pool_timeout_s fired, in the tick ...
        pool.release(held, reuse=False)  # ... a stream ended: a cancelled wait is skipped
        with pytest.raises(connections.UpstreamClosed if closing else asyncio.CancelledError):
            await waiting  # (UpstreamClosed is http1's now, and connections' still)
        assert pool.busy == 0
        pool.close()


# --- 3. after a chunked body: trailers, a line that never ends ----------------------------


@contextlib.asynccontextmanager
async def threaded(answer: Callable[[socket.socket], None]) -> AsyncIterator[str]:
    """A blocking server in a thread answering one request (it writes while the loop is
    held: the client then gets what it wrote in one read)."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        connection, _ = listener.accept()
        with connection, contextlib.suppress(OSError):
            while b"\r\n\r\n" not in connection.recv(65536):
                pass  # the request
            answer(connection)
            connection.settimeout(5)
            while connection.recv(65536):
                pass  # until the client leaves

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}/v1"
    finally:
        listener.close()
        await until(lambda: not thread.is_alive())  # the client left


async def test_a_trailer_in_a_long_last_read_is_ignored_not_counted_as_a_head() -> None:
    """Trailers were counted as a head again: a last read of more than 64 KiB holding one
    failed the stream (its [DONE] dropped) as 'the response head passed 65536 bytes'."""
    rest = openai_chunk(content="x" * 40) * 450 + b"".join(FRAMES[1:])
    assert 65536 < len(rest) < 128 * 1024

    def answer(connection: socket.socket) -> None:
        connection.sendall(response(FRAMES[0])[: -len(b"0\r\n\r\n")])
        time.sleep(0.1)
        connection.sendall(b"%x\r\n%s\r\n0\r\nX-Checksum: abc\r\n\r\n" % (len(rest), rest))

    async with threaded(answer) as url, openai(url) as provider:
        reading = batches(provider)
        assert await asyncio.wait_for(reading.__anext__(), 2) == [Delta("ok")]
        time.sleep(0.3)  # the loop held: the rest of the body, and the trailer, in one read
        events = [event async for batch in reading for event in batch]
    assert len(events) == 451 and events[0] == Delta("x" * 40)


@pytest.mark.parametrize(
    "line",
    [
        pytest.param(b"0\r\nX-Trailer: ", id="a trailer, after the last chunk"),
        pytest.param(b"1;x=", id="a chunk's extension"),
    ],
)
async def test_a_line_that_never_ends_after_the_head_is_a_protocol_error_at_once(
    line: bytes,
) -> None:
    """No body byte, the head long whole: the line grew the gateway's memory at line rate
    (httptools holds it until its end) until idle_timeout_s, then was a timeout."""
    written = [0]
    start = response(FRAMES[0])[: -len(b"0\r\n\r\n")] + line
    upstream = RawUpstream(endless(start, written))
    async with upstream as up, openai(up.url, first_byte_timeout_s=3, idle_timeout_s=3) as p:
        reading = batches(p)
        assert await asyncio.wait_for(reading.__anext__(), 2) == [Delta("ok")]
        with pytest.raises(UpstreamError) as info:
            await asyncio.wait_for(reading.__anext__(), 1.5)
        assert info.value.code == "upstream_protocol_error"
        await reading.aclose()
        await until(lambda: up.left == 1)
    assert written[0] < 1024 * 1024


# --- 4. and 5. connect timeouts and the pool's deadline -----------------------------------


async def test_a_tls_handshake_never_answered_is_upstream_timeout_not_pool_exhaustion() -> None:
    """connect_timeout_s passing in a connect (an upstream that takes the TCP connection
    and never reads it, as a blackholed one) is the upstream's timeout: 'all N connections
    stayed busy' (503, Retry-After) said the gateway's pool was full though none was."""
    with socket.create_server(("127.0.0.1", 0), backlog=8) as listener:  # never accepts
        url = f"https://localhost:{listener.getsockname()[1]}/v1"
        async with openai(url, connect_timeout_s=0.3) as provider:
            started = time.monotonic()
            with pytest.raises(UpstreamError) as info:
                await stream(provider)
            assert time.monotonic() - started < 1.5
            assert provider._pool is not None and provider._pool.busy == 0
    assert info.value.code == "upstream_timeout"


async def test_the_pool_deadline_ends_with_the_wait_not_cutting_the_connect_after_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Waited 0.3 s of a 0.6 s pool_timeout_s, then 0.5 s to connect (connect_timeout_s
    5): the pool's deadline ended with the wait, the connect has its own."""
    real = connections.aiohappyeyeballs.start_connection
    connects: list[float] = []

    async def slow_after_the_first(*args: Any, **kwargs: Any) -> socket.socket:
        connects.append(time.monotonic())
        if len(connects) > 1:
            await asyncio.sleep(0.5)  # a far upstream, a slow handshake
        return await real(*args, **kwargs)

    monkeypatch.setattr(connections.aiohappyeyeballs, "start_connection", slow_after_the_first)
    upstream = FakeUpstream(Reply.stream(FRAMES, gate=asyncio.Event()), Reply.stream(FRAMES))
    options = {"max_connections": 1, "pool_timeout_s": 0.6, "connect_timeout_s": 5}
    async with upstream as up, openai(up.url, **options) as provider:
        waits: list[float] = []
        provider.on_pool_wait.append(waits.append)
        first = batches(provider)
        assert await asyncio.wait_for(first.__anext__(), 2) == [Delta("ok")]
        second = asyncio.create_task(stream(provider))
        await asyncio.sleep(0.3)
        await first.aclose()  # its connection dropped: the second opens a new one
        assert (await second)[0] == Delta("ok")
    assert len(connects) == 2 and 0.2 < waits[1] < 0.6


# --- 6. DNS -------------------------------------------------------------------------------


async def test_a_burst_of_first_requests_shares_one_dns_lookup(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each new connection looked the host up in a thread of its own: a burst at startup
    queued hundreds of lookups, eating every request's connect_timeout_s."""
    loop = asyncio.get_running_loop()
    real = loop.getaddrinfo
    lookups: list[str] = []

    async def slow_lookup(host: str, *args: Any, **kwargs: Any) -> Any:
        lookups.append(host)
        await asyncio.sleep(0.05)  # a resolver taking its time
        return await real(host, *args, **kwargs)

    monkeypatch.setattr(loop, "getaddrinfo", slow_lookup)
    async with FakeUpstream(default=Reply.stream(FRAMES)) as up, openai(up.url) as provider:
        results = await asyncio.gather(*(stream(provider) for _ in range(20)))
    assert all(events[0] == Delta("ok") for events in results)
    assert lookups == ["127.0.0.1"]


# --- 7. the provider closed under its streams ---------------------------------------------


async def test_closing_the_provider_ends_its_streams_at_once_as_disconnects() -> None:
    """pool.close() closed the connections of streams in flight without telling them: each
    waited for its first_byte_timeout_s or idle_timeout_s, then was a timeout."""
    held = Reply.stream(FRAMES, gate=asyncio.Event())  # after its first chunk
    upstream = FakeUpstream(held, Reply.stream(FRAMES, headers_delay=30))
    options = {"first_byte_timeout_s": 3, "idle_timeout_s": 3}
    async with upstream as up, openai(up.url, **options) as provider:
        mid = batches(provider)
        assert await asyncio.wait_for(mid.__anext__(), 2) == [Delta("ok")]
        reading = asyncio.create_task(drain(mid))
        heading = asyncio.create_task(stream(provider))  # waits for its head
        await until(lambda: len(up.requests) == 2)
        await asyncio.sleep(0.05)
        await provider.close()
        for task in (reading, heading):
            with pytest.raises(UpstreamError) as info:
                await asyncio.wait_for(task, 1)
            assert info.value.code == "upstream_disconnect"


async def test_a_connect_under_way_when_the_provider_closes_goes_with_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A request still connecting (DNS, TCP, TLS) was not yet among the pool's connections:
    closed under it, it went on, sent its request and streamed on after the shutdown."""
    real = connections.aiohappyeyeballs.start_connection

    async def slow(*args: Any, **kwargs: Any) -> socket.socket:
        await asyncio.sleep(0.3)
        return await real(*args, **kwargs)

    monkeypatch.setattr(connections.aiohappyeyeballs, "start_connection", slow)
    async with FakeUpstream(Reply.stream(FRAMES)) as up, openai(up.url) as provider:
        connecting = asyncio.create_task(stream(provider))
        await asyncio.sleep(0.1)
        await provider.close()
        with pytest.raises(UpstreamError) as info:
            await asyncio.wait_for(connecting, 1)
        assert info.value.code == "upstream_disconnect"
        await asyncio.sleep(0.1)
        assert up.requests == []


# --- 8. the request line's target ---------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "target"),
    [
        pytest.param(
            "/openai/deployments/d?api-version=2024-06-01",
            "/openai/deployments/d/chat/completions?api-version=2024-06-01",
            id="the query last",
        ),
        pytest.param("/a%2Fb/caf\u00e9", "/a%2Fb/caf%C3%A9/chat/completions", id="percent-encoded"),
    ],
)
async def test_the_request_target_is_the_base_paths_then_the_query_percent_encoded(
    path: str, target: str
) -> None:
    """An Azure-style base_url's ``?api-version=`` went in the middle of the path; a
    non-ASCII path went out raw (not HTTP)."""
    upstream = RawUpstream(send(response(b"".join(FRAMES))))
    async with upstream as up, openai(up.url.removesuffix("/v1") + path) as provider:
        assert (await stream(provider))[0] == Delta("ok")
    assert up.requests[0].split(b"\r\n")[0] == f"POST {target} HTTP/1.1".encode()


def test_a_base_url_with_credentials_stops_the_start_unquoted() -> None:
    """``user:pw@`` in base_url was never sent (aiohttp sent it as Basic auth): a key put
    there went nowhere, silently; it belongs in api_key_env."""
    config = OpenAIProviderConfig(kind="openai", base_url="https://user:s3cr3t@up.example/v1")
    with pytest.raises(ConfigError, match=r"\[providers.up\] base_url: credentials") as info:
        build_provider("up", config)
    assert "s3cr3t" not in str(info.value)
