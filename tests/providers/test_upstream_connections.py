"""The upstream client (``nexus.providers.connections``) against real local servers: what
a client owes an upstream and the gateway, each test named for what it keeps from breaking.

``RawUpstream`` writes HTTP/1.1 byte for byte (an interim 100, a head past a bound, a
close-delimited body, a chunk cut short: what aiohttp's server will not send) and counts
the connections it accepts; tests/upstreams.py's ``FakeUpstream`` serves the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import trustme
from aiohttp import web

from nexus.config import OpenAIProviderConfig
from nexus.errors import ConfigError, UpstreamError
from nexus.events import Delta, StreamEvent
from nexus.providers import OpenAIProvider, build_provider, connections
from nexus.request import ChatRequest
from upstreams import DONE, FakeUpstream, Reply, openai_chunk

FRAMES = [openai_chunk(content="ok"), openai_chunk(finish_reason="stop"), DONE]
Answer = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[bool]]
"""Writes one response; true: the connection stays open for the next request."""


def response(body: bytes, framing: str = "chunked") -> bytes:
    """An event stream's 200, its body framed by length, chunks, or the connection's close."""
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
    if framing == "length":
        return head + b"Content-Length: %d\r\n\r\n" % len(body) + body
    if framing == "close":
        return head + b"Connection: close\r\n\r\n" + body
    chunk = b"%x\r\n%s\r\n" % (len(body), body)
    return head + b"Transfer-Encoding: chunked\r\n\r\n" + chunk + b"0\r\n\r\n"


def send(data: bytes, close: bool = False) -> Answer:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(data)
        await writer.drain()
        return not close

    return answer


class RawUpstream:
    """A TCP server on 127.0.0.1 answering each request with the next ``Answer``."""

    def __init__(self, *answers: Answer) -> None:
        self.answers = deque(answers)
        self.accepted = 0  # connections
        self.left = 0  # connections the client closed
        self.requests: list[bytes] = []
        self._writers: set[asyncio.StreamWriter] = set()
        self.url = ""

    async def __aenter__(self) -> RawUpstream:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}/v1"
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._server.close()
        for writer in self._writers:
            writer.close()
        await self._server.wait_closed()
        await asyncio.sleep(0)  # the transports' close

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        self._writers.add(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                self.requests.append(head + await reader.readexactly(length))
                if not await self.answers.popleft()(reader, writer):
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            self.left += 1
        finally:
            writer.close()
            self._writers.discard(writer)


async def until(done: Callable[[], bool], timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not done():
            await asyncio.sleep(0.005)


@contextlib.asynccontextmanager
async def openai(url: str, key: str | None = None, **options: Any) -> AsyncIterator[OpenAIProvider]:
    provider = OpenAIProvider(
        "up", OpenAIProviderConfig(kind="openai", base_url=url, **options), key
    )
    await provider.start()
    try:
        yield provider
    finally:
        await provider.close()


def batches(provider: OpenAIProvider) -> Any:
    request = {"model": "up/m", "messages": [{"role": "user", "content": "Hi"}]}
    return provider.batches(ChatRequest.model_validate(request), "m")


async def stream(provider: OpenAIProvider) -> list[StreamEvent]:
    """Every event of one stream, read to its end."""
    events: list[StreamEvent] = []
    async with asyncio.timeout(5):
        async for batch in batches(provider):
            events += batch
    return events


# --- TLS --------------------------------------------------------------------------------


class TLSUpstream(FakeUpstream):
    """FakeUpstream over HTTPS, its certificate ``cert``, its URL by the name localhost."""

    def __init__(self, cert: trustme.LeafCert, *replies: Reply) -> None:
        super().__init__(*replies)
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        cert.configure_cert(self.context)

    @property
    def url(self) -> str:
        return f"https://localhost:{self.port}/v1"

    async def start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0, ssl_context=self.context).start()
        self.port = self._runner.addresses[0][1]


@pytest.fixture
def ca(tmp_path: Path) -> tuple[trustme.CA, str]:
    """A CA, and its certificate in a PEM file for ``ca_file``."""
    authority = trustme.CA()
    path = tmp_path / "ca.pem"
    authority.cert_pem.write_to_path(str(path))
    return authority, str(path)


async def test_a_https_upstream_streams_with_its_name_checked(ca: tuple[trustme.CA, str]) -> None:
    authority, ca_file = ca
    upstream = TLSUpstream(authority.issue_cert("localhost"), Reply.stream(FRAMES))
    async with upstream as up, openai(up.url, ca_file=ca_file) as provider:
        events = await stream(provider)
    assert events[0] == Delta("ok")
    assert up.requests[0].headers["Host"] == f"localhost:{up.port}"


@pytest.mark.parametrize("who", ["another name", "an unknown CA", "the system's store"])
async def test_a_certificate_not_for_the_host_is_refused(
    ca: tuple[trustme.CA, str], who: str
) -> None:
    """Without the name's check (server_hostname) or the trust store, any man in the
    middle would read the key; without ``ca_file`` a private CA is not trusted."""
    authority, ca_file = ca
    issuer = trustme.CA() if who == "an unknown CA" else authority
    cert = issuer.issue_cert("upstream.example" if who == "another name" else "localhost")
    options = {} if who == "the system's store" else {"ca_file": ca_file}
    async with TLSUpstream(cert, Reply.stream(FRAMES)) as up, openai(up.url, **options) as provider:
        with pytest.raises(UpstreamError) as info:
            await stream(provider)
    assert info.value.code == "upstream_connect_error"
    assert "TLS" in info.value.message
    assert up.requests == []


@pytest.mark.parametrize("content", [None, b"not a certificate"])
def test_a_ca_file_that_cannot_be_loaded_stops_the_start(
    tmp_path: Path, content: bytes | None
) -> None:
    path = tmp_path / "ca.pem"
    if content is not None:
        path.write_bytes(content)
    config = OpenAIProviderConfig(kind="openai", base_url="https://up.example", ca_file=str(path))
    with pytest.raises(ConfigError, match=r"\[providers.up\] ca_file: cannot load"):
        build_provider("up", config)


# --- keep-alive -------------------------------------------------------------------------


async def test_streams_one_after_the_other_share_one_connection() -> None:
    body = b"".join(FRAMES)
    upstream = RawUpstream(send(response(body)), send(response(body, "length")))
    async with upstream as up, openai(up.url) as provider:
        assert (await stream(provider))[0] == Delta("ok")
        assert (await stream(provider))[0] == Delta("ok")
    assert (up.accepted, len(up.requests)) == (1, 2)


async def test_a_connection_idle_past_keepalive_is_closed_not_reused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An upstream closes an idle connection after a while; a request written on one it
    has closed fails."""
    monkeypatch.setattr(connections, "KEEPALIVE_S", 0.05)
    body = b"".join(FRAMES)
    upstream = RawUpstream(send(response(body)), send(response(body)))
    async with upstream as up, openai(up.url) as provider:
        await stream(provider)
        await asyncio.sleep(0.1)
        await stream(provider)
        await until(lambda: up.left == 1)  # the stale one closed by the client
    assert up.accepted == 2


# --- a response as it may come ----------------------------------------------------------


def interim_then(final: bytes) -> Answer:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.05)  # a read of its own: the client sees it alone
        writer.write(final)
        await writer.drain()
        return True

    return answer


async def test_an_interim_100_continue_is_skipped_for_the_response_after_it() -> None:
    """Taken for the response, a 100 would make the stream 2xx before its status came: a
    429 after it never seen, the stream waiting for events that never come."""
    limited = b"HTTP/1.1 429 Too Many Requests\r\nContent-Length: 2\r\n\r\n{}"
    upstream = RawUpstream(interim_then(response(b"".join(FRAMES))), interim_then(limited))
    async with upstream as up, openai(up.url) as provider:
        assert (await stream(provider))[0] == Delta("ok")
        with pytest.raises(UpstreamError) as info:
            await stream(provider)
    assert info.value.code == "upstream_rate_limited"


async def test_a_body_delimited_by_the_close_streams_to_its_end() -> None:
    upstream = RawUpstream(send(response(b"".join(FRAMES), "close"), close=True))
    async with upstream as up, openai(up.url) as provider:
        assert (await stream(provider))[0] == Delta("ok")


async def test_a_close_delimited_body_without_its_done_is_a_disconnect() -> None:
    """The close ends such a body whole (HTTP cannot tell it was cut): the stream's
    missing terminator does."""
    upstream = RawUpstream(send(response(FRAMES[0], "close"), close=True))
    async with upstream as up, openai(up.url) as provider:
        with pytest.raises(UpstreamError) as info:
            await stream(provider)
    assert info.value.code == "upstream_disconnect"
    assert "without [DONE]" in info.value.message  # not "closed the connection"


async def test_a_chunk_cut_short_is_a_disconnect_after_the_events_before_it() -> None:
    cut = response(FRAMES[0])[: -len(b"0\r\n\r\n")] + b"100\r\ndata: {"
    async with RawUpstream(send(cut, close=True)) as up, openai(up.url) as provider:
        reading = batches(provider)
        assert await asyncio.wait_for(reading.__anext__(), 5) == [Delta("ok")]
        with pytest.raises(UpstreamError) as info:
            await asyncio.wait_for(reading.__anext__(), 5)
    assert info.value.code == "upstream_disconnect"
    assert "closed the connection between chunks" in info.value.message


# --- bounds -----------------------------------------------------------------------------


def endless(start: bytes, written: list[int]) -> Answer:
    """``start``, then up to 16 MiB of a line that never ends, 64 KiB every 10 ms (paced so
    that what the kernel's socket buffers take after the client left stays small)."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(start)
        with contextlib.suppress(ConnectionError):
            for _ in range(256):
                if reader.at_eof():
                    break
                writer.write(b"a" * 65536)
                await writer.drain()
                written[0] += 65536
                await asyncio.sleep(0.01)
        await reader.read()  # until the client leaves (then counted in ``left``)
        return True

    return answer


OK = b"HTTP/1.1 200 OK\r\n"
BIG = OK + b"".join(b"X-H%d: %s\r\n" % (n, b"v" * 1024) for n in range(100)) + b"\r\n"
MANY = OK + b"".join(b"X-H%d: v\r\n" % n for n in range(200)) + b"\r\n"


@pytest.mark.parametrize(
    ("head", "endless_line"),
    [
        pytest.param(BIG, False, id="past MAX_HEAD_BYTES"),
        pytest.param(MANY, False, id="past MAX_HEADERS"),
        pytest.param(
            OK + b"X-Big: ",
            True,
            id="one endless header line",
        ),
        pytest.param(
            b"HTTP/1.1 200 ",
            True,
            id="one endless status line",
        ),
    ],
)
async def test_a_head_past_its_bounds_is_a_protocol_error_at_once(
    head: bytes, endless_line: bool
) -> None:
    """A hostile upstream's head must not grow the gateway's memory before its first
    event: it is refused as soon as it passes MAX_HEAD_BYTES or MAX_HEADERS (not at
    first_byte_timeout_s), and its connection dropped."""
    written = [0]
    answer = endless(head, written) if endless_line else send(head)
    async with RawUpstream(answer) as up, openai(up.url, first_byte_timeout_s=3.0) as provider:
        with pytest.raises(UpstreamError) as info:
            await asyncio.wait_for(stream(provider), 2.0)
        assert info.value.code == "upstream_protocol_error"
        await until(lambda: up.left == 1)
    assert written[0] < 1024 * 1024  # read no further than the bound (and a read or two)


async def test_bytes_after_a_whole_response_are_no_second_response() -> None:
    """A response ends where its framing says: a 408 that a server sends as it closes an
    idle connection, read with the 200's end, is no answer to this request (it made
    the 200's stream a 408 whose text was the stream); the connection is not reused."""
    body = b"".join(FRAMES)
    extra = b"HTTP/1.1 408 Request Timeout\r\nContent-Length: 0\r\n\r\n"
    upstream = RawUpstream(send(response(body, "length") + extra), send(response(body)))
    async with upstream as up, openai(up.url) as provider:
        assert (await stream(provider))[0] == Delta("ok")
        assert (await stream(provider))[0] == Delta("ok")
    assert up.accepted == 2


# --- header injection -------------------------------------------------------------------

EVIL_KEY = "sk-injected-0123\r\nX-Evil: 1"


def test_a_key_with_a_line_break_stops_the_start_unquoted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A key read from the environment could add a header of its own (or a request): the
    provider is refused when it is built, before any request, not at every request (which
    would fail each one, with no fallback: the next target of an alias gets the same key)."""
    monkeypatch.setenv("UP_KEY", EVIL_KEY)
    config = OpenAIProviderConfig(
        kind="openai", base_url="https://up.example", api_key_env="UP_KEY"
    )
    with pytest.raises(ConfigError, match=r"\[providers.up\] the header 'Authorization'") as info:
        build_provider("up", config)
    assert "sk-injected" not in str(info.value) and "X-Evil" not in str(info.value)


# --- the pool ---------------------------------------------------------------------------


async def test_a_full_pool_hands_its_connection_to_the_next_in_line() -> None:
    """max_connections = 1: the second request waits for the first stream's end, then
    reuses its connection (no second one opened)."""
    gate = asyncio.Event()
    upstream = FakeUpstream(Reply.stream(FRAMES, gate=gate), Reply.stream(FRAMES))
    async with upstream as up, openai(up.url, max_connections=1) as provider:
        first = batches(provider)
        assert await asyncio.wait_for(first.__anext__(), 5) == [Delta("ok")]
        second = asyncio.create_task(stream(provider))
        await asyncio.sleep(0.1)
        assert not second.done() and len(up.requests) == 1  # waiting in line
        gate.set()
        async for _ in first:
            pass
        assert (await second)[0] == Delta("ok")
    assert len(up.requests) == 2 and up.requests[0].peer == up.requests[1].peer


@pytest.mark.parametrize("when", ["while waiting", "as it is handed the connection"])
async def test_a_request_that_gives_up_in_line_leaves_the_count_right(when: str) -> None:
    """A cancelled wait must not keep a place: the third request still gets the one
    connection, and the pool ends with none in use."""
    gate = asyncio.Event()
    replies = [Reply.stream(FRAMES, gate=gate), Reply.stream(FRAMES)]
    async with FakeUpstream(*replies) as up, openai(up.url, max_connections=1) as provider:
        first = batches(provider)
        assert await asyncio.wait_for(first.__anext__(), 5) == [Delta("ok")]
        second = asyncio.create_task(stream(provider))
        await asyncio.sleep(0.05)
        third = asyncio.create_task(stream(provider))
        await asyncio.sleep(0.05)
        if when == "while waiting":
            second.cancel()
            await asyncio.sleep(0.05)
        gate.set()
        async for _ in first:
            pass  # its end frees the connection: handed to the second in line
        if when != "while waiting":
            second.cancel()  # before it runs: the place it was handed is passed on
        assert (await asyncio.wait_for(third, 5))[0] == Delta("ok")
        assert second.cancelled()
        assert provider._pool is not None and provider._pool.busy == 0
    assert len(up.requests) == 2 and up.requests[0].peer == up.requests[1].peer
