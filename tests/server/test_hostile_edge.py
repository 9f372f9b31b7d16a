"""The HTTP edge of a real ``nexus serve`` against browsers and hostile bodies.

Pages of other sites (``Origin``) and DNS-rebound ``Host`` names are refused before a
route runs, the WebSocket handshake included; compressed bodies are inflated after the
key, in pieces, under ``[limits] max_body_bytes`` (a gzip bomb costs neither memory nor
the event loop); other codings get 415; a deflate bomb on the realtime socket is refused
uninflated unless compression is on, and then inflates no further than the message limit;
JSON nested too deep gets 400, and an error frame on the realtime socket, which stays
usable.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import itertools
import os
import socket
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest
import websockets
from websockets.datastructures import Headers

from nexus_process import start_nexus, stop_nexus

KEY = "nx-edge-test-key"
ORIGIN = "https://app.example"
MOCK = '[providers.mock]\nkind = "mock"\n'


@dataclass
class Server:
    url: str
    port: int
    pid: int


def _serve(tmp_path: Path, name: str, text: str) -> Iterator[Server]:
    config = tmp_path / f"{name}.toml"
    config.write_text(text + MOCK)
    proc, match = start_nexus(config, tmp_path / f"{name}.log")
    url = match[1]
    try:
        yield Server(url, int(url.rsplit(":", 1)[1]), proc.pid)
    finally:
        stop_nexus(proc)


@pytest.fixture(scope="module")
def keyless(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from _serve(tmp_path_factory.mktemp("keyless"), "keyless", "")


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    digest = hashlib.sha256(KEY.encode()).hexdigest()
    text = (
        f'[[auth.keys]]\nname = "edge"\nsha256 = "{digest}"\n[cors]\nallow_origins = ["{ORIGIN}"]\n'
    )
    yield from _serve(tmp_path_factory.mktemp("keyed"), "keyed", text)


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes
    closed: bool
    """The server closed the connection after the answer."""

    def json(self) -> Any:
        return orjson.loads(self.body)


async def request(
    server: Server,
    method: str,
    path: str,
    body: bytes | Iterator[bytes] = b"",
    headers: dict[str, str] | None = None,
    *,
    length: int | None = None,
    keep_alive: bool = False,
) -> Answer:
    """One HTTP/1.1 request on its own connection, written by hand: any ``Host`` or
    ``Content-Encoding``, and a body sent in pieces while the answer is read, as curl
    does (a server that answers early and closes does not fail the test). With
    ``keep_alive``, whether the server closed the connection after its answer."""
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setblocking(False)
    await loop.sock_connect(sock, ("127.0.0.1", server.port))
    head = {"Host": f"127.0.0.1:{server.port}"} | (headers or {})
    head["Connection"] = "keep-alive" if keep_alive else "close"
    pieces: Iterator[bytes] = iter([body]) if isinstance(body, bytes) else body
    if isinstance(body, bytes):
        length = len(body)
    if length is not None:
        head["Content-Length"] = str(length)
    lines = [f"{method} {path} HTTP/1.1"] + [f"{k}: {v}" for k, v in head.items()]
    await loop.sock_sendall(sock, ("\r\n".join(lines) + "\r\n\r\n").encode())

    async def send() -> None:
        try:
            for piece in pieces:
                await loop.sock_sendall(sock, piece)
        except OSError:
            pass  # the server answered and closed: what is tested is its answer

    sender = asyncio.create_task(send())
    received = b""
    try:
        while b"\r\n\r\n" not in received:
            data = await loop.sock_recv(sock, 65536)
            assert data, received
            received += data
        head_bytes, _, rest = received.partition(b"\r\n\r\n")
        status_line, *header_lines = head_bytes.decode().split("\r\n")
        got = {}
        for line in header_lines:
            name, _, value = line.partition(":")
            got[name.strip().lower()] = value.strip()
        size = int(got.get("content-length", "0"))
        while len(rest) < size:
            data = await loop.sock_recv(sock, 65536)
            assert data, rest
            rest += data
        closed = False
        if keep_alive:
            try:
                closed = await asyncio.wait_for(loop.sock_recv(sock, 1), 1) == b""
            except ConnectionResetError:
                closed = True  # closed with the rest of the body unread: a reset
            except TimeoutError:
                closed = False
        return Answer(int(status_line.split()[1]), got, rest[:size], closed)
    finally:
        sender.cancel()
        await asyncio.gather(sender, return_exceptions=True)
        sock.close()


def chat(content: str = "hello edge", **extra: Any) -> dict[str, Any]:
    return {"model": "mock/echo", "messages": [{"role": "user", "content": content}]} | extra


JSON = {"Content-Type": "application/json"}
BEARER = {"Authorization": f"Bearer {KEY}"}


def peak_rss_kb(pid: int) -> int:
    """The process's resident memory at its highest so far (VmHWM), in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


def gzip_bomb(inflated_mib: int = 1024) -> Iterator[bytes]:
    """gzip data of ``inflated_mib`` MiB of zeros, about 1 KiB per MiB, made without
    compressing a gigabyte: after a full flush the compressor starts afresh, so each
    MiB of zeros compresses to the same bytes (no trailer: it is never reached)."""
    zeros = bytes(1 << 20)
    deflate = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    yield deflate.compress(zeros) + deflate.flush(zlib.Z_FULL_FLUSH)
    block = deflate.compress(zeros) + deflate.flush(zlib.Z_FULL_FLUSH)
    for _ in range(inflated_mib - 1):
        yield block


def bomb_length(inflated_mib: int = 1024) -> int:
    return sum(len(piece) for piece in gzip_bomb(inflated_mib))


class HealthProbe:
    """``GET /healthz`` over and over while something else runs: the worst latency."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.latencies: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> HealthProbe:
        self._task = asyncio.create_task(self._probe())
        await asyncio.sleep(0.05)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)

    async def _probe(self) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.server.port)
        try:
            while True:
                started = time.monotonic()
                writer.write(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                self.latencies.append(time.monotonic() - started)
                await asyncio.sleep(0.01)
        finally:
            writer.close()

    @property
    def worst(self) -> float:
        return max(self.latencies)


# --- pages of other sites -------------------------------------------------------------


async def test_a_page_of_another_site_cannot_post(keyless: Server) -> None:
    body = orjson.dumps(chat())
    for origin in ("https://evil.example", "null", f"http://127.0.0.1:{keyless.port + 1}"):
        answer = await request(
            keyless,
            "POST",
            "/v1/chat/completions",
            body,
            {"Content-Type": "text/plain", "Origin": origin},
        )
        assert answer.status == 403, origin
        assert answer.json()["error"]["code"] == "origin_not_allowed"
    # In the endpoint's own shape.
    answer = await request(
        keyless, "POST", "/v1/messages", body, {"Origin": "https://evil.example"} | JSON
    )
    assert answer.status == 403
    assert answer.json()["type"] == "error"
    assert answer.json()["error"]["type"] == "permission_error"
    # The gateway's own pages (the web console) and clients that send no Origin.
    for headers in ({"Origin": f"http://127.0.0.1:{keyless.port}"}, {}):
        answer = await request(keyless, "POST", "/v1/chat/completions", body, headers | JSON)
        assert answer.status == 200, answer.body


async def test_a_page_of_another_site_cannot_open_the_realtime_socket(keyless: Server) -> None:
    url = keyless.url.replace("http", "ws") + "/v1/realtime"
    with pytest.raises(websockets.InvalidStatus) as refused:
        await websockets.connect(url, origin="https://evil.example")  # type: ignore[arg-type]
    assert refused.value.response.status_code == 403
    assert b"origin_not_allowed" in refused.value.response.body
    own = f"http://127.0.0.1:{keyless.port}"
    async with websockets.connect(url, origin=own) as ws:  # type: ignore[arg-type]
        await ws.send(orjson.dumps({"type": "start", "request": chat("own page")}).decode())
        frames = [orjson.loads(await ws.recv())]
        while frames[-1].get("type") not in ("done", "error"):
            frames.append(orjson.loads(await ws.recv()))
        assert frames[-1]["type"] == "done"


async def test_listed_origins_are_served_with_cors_headers(keyed: Server) -> None:
    body = orjson.dumps(chat())
    answer = await request(
        keyed, "POST", "/v1/chat/completions", body, {"Origin": ORIGIN} | JSON | BEARER
    )
    assert answer.status == 200
    assert answer.headers["access-control-allow-origin"] == ORIGIN
    answer = await request(
        keyed, "POST", "/v1/chat/completions", body, {"Origin": "https://evil.example"} | BEARER
    )
    assert answer.status == 403
    url = keyed.url.replace("http", "ws") + "/v1/realtime"
    async with websockets.connect(
        url,
        origin=ORIGIN,  # type: ignore[arg-type]
        additional_headers=Headers(BEARER),
    ) as ws:
        await ws.send(orjson.dumps({"type": "abort"}).decode())
        assert orjson.loads(await ws.recv())["error"]["code"] == "nothing_to_abort"


# --- DNS rebinding --------------------------------------------------------------------


async def test_a_rebound_host_name_is_refused_without_keys(keyless: Server, keyed: Server) -> None:
    body = orjson.dumps(chat())
    port = keyless.port
    for host in (f"evil.example:{port}", "evil.example", f"10.1.2.3:{port}", f"0.0.0.0:{port}"):
        answer = await request(keyless, "POST", "/v1/chat/completions", body, {"Host": host})
        assert answer.status == 403, host
        assert answer.json()["error"]["code"] == "host_not_allowed"
    # Same-origin as far as the browser knows, and still refused: the Host gives it away.
    rebound = {"Host": f"evil.example:{port}", "Origin": f"http://evil.example:{port}"}
    answer = await request(keyless, "POST", "/v1/chat/completions", body, rebound)
    assert answer.json()["error"]["code"] == "host_not_allowed"
    for host in (f"localhost:{port}", f"127.0.0.2:{port}", f"[::1]:{port}", "app.localhost"):
        answer = await request(keyless, "POST", "/v1/chat/completions", body, {"Host": host})
        assert answer.status == 200, host
    # Probes may name the machine any way they like: liveness only.
    answer = await request(keyless, "GET", "/healthz", headers={"Host": f"10.1.2.3:{port}"})
    assert answer.status == 200
    # With keys, a page has no key to send: any name is served.
    answer = await request(
        keyed, "POST", "/v1/chat/completions", body, {"Host": "gateway.example"} | BEARER
    )
    assert answer.status == 200


# --- compressed bodies ----------------------------------------------------------------


async def test_a_gzip_bomb_is_refused_after_the_limit_without_memory_or_stall(
    keyed: Server,
) -> None:
    before = peak_rss_kb(keyed.pid)
    headers = {"Content-Encoding": "gzip"} | JSON | BEARER
    async with HealthProbe(keyed) as probe:
        started = time.monotonic()
        # The first 512 MiB's worth of the 1 GiB: a body whose rest is still to come.
        answer = await request(
            keyed,
            "POST",
            "/v1/chat/completions",
            itertools.islice(gzip_bomb(), 512),
            headers,
            length=bomb_length(),
            keep_alive=True,
        )
        elapsed = time.monotonic() - started
    assert answer.status == 413
    assert answer.json()["error"]["code"] == "request_too_large"
    assert answer.closed  # not kept open to read (and inflate) the rest
    grown_mb = (peak_rss_kb(keyed.pid) - before) / 1024
    print(
        f"peak RSS +{grown_mb:.1f} MB, /healthz worst {probe.worst * 1000:.1f} ms, {elapsed:.2f} s"
    )
    assert grown_mb < 64, grown_mb
    assert probe.latencies and probe.worst < 0.1, probe.latencies
    assert elapsed < 5


async def test_a_gzip_bomb_without_a_key_is_not_inflated(keyed: Server) -> None:
    before = peak_rss_kb(keyed.pid)
    headers = {"Content-Encoding": "gzip"} | JSON
    started = time.monotonic()
    answer = await request(
        keyed,
        "POST",
        "/v1/chat/completions",
        itertools.islice(gzip_bomb(), 512),
        headers,
        length=bomb_length(),
        keep_alive=True,
    )
    assert answer.status == 401
    assert answer.closed
    assert time.monotonic() - started < 3  # closed, not held for a lingering read (10 s)
    assert (peak_rss_kb(keyed.pid) - before) / 1024 < 8


async def test_corrupt_and_unsupported_compressed_bodies(keyed: Server) -> None:
    good = zlib.compress(orjson.dumps(chat("deflated")))
    answer = await request(
        keyed,
        "POST",
        "/v1/chat/completions",
        good,
        {"Content-Encoding": "deflate"} | JSON | BEARER,
    )
    assert answer.status == 200, answer.body
    corrupt = b"\x1f\x8b\x08\x00" + bytes(range(256)) * 4
    cases = [
        ("gzip", corrupt, 400, "invalid_request"),
        ("gzip", zlib.compress(b"{}")[:-6], 400, "invalid_request"),  # not gzip at all
        ("br", b"\x0b\x02\x80{}\x03", 415, "unsupported_media_type"),
        ("zstd", b"(\xb5/\xfd", 415, "unsupported_media_type"),
        ("compress", b"x", 415, "unsupported_media_type"),
        ("gzip, gzip", corrupt, 415, "unsupported_media_type"),
    ]
    for coding, body, status, code in cases:
        for path in ("/v1/chat/completions", "/v1/responses", "/v1/messages"):
            headers = {"Content-Encoding": coding} | JSON | BEARER
            answer = await request(keyed, "POST", path, body, headers)
            assert answer.status == status, (coding, path, answer.body)
            error = answer.json()["error"]
            if path == "/v1/messages":
                assert answer.json()["type"] == "error"
                assert error["type"] == "invalid_request_error"
            else:
                assert error["code"] == code


# --- compressed WebSocket messages ----------------------------------------------------


@pytest.fixture(scope="module")
def deflating(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A gateway that accepts permessage-deflate, with a 1 MiB message limit."""
    text = "[realtime]\ncompression = true\nmax_message_bytes = 1048576\n"
    yield from _serve(tmp_path_factory.mktemp("deflating"), "deflating", text)


def deflated_zeros(mib: int) -> bytes:
    """A permessage-deflate payload (raw deflate, its trailing ``00 00 ff ff`` cut: RFC
    7692 7.2.1) that inflates to ``mib`` MiB of zeros, about a thousandth of that sent."""
    deflate = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    data = deflate.compress(bytes(mib << 20)) + deflate.flush(zlib.Z_SYNC_FLUSH)
    assert data.endswith(b"\x00\x00\xff\xff")
    return data[:-4]


def masked_frame(first_byte: int, payload: bytes) -> bytes:
    """A client's frame: FIN, RSV and opcode in ``first_byte``, the payload masked."""
    mask = os.urandom(4)
    size = len(payload)
    if size < 126:
        head = bytes([first_byte, 0x80 | size])
    elif size < 1 << 16:
        head = bytes([first_byte, 0x80 | 126]) + size.to_bytes(2, "big")
    else:
        head = bytes([first_byte, 0x80 | 127]) + size.to_bytes(8, "big")
    key = int.from_bytes((mask * (size // 4 + 1))[:size], "big")
    masked = (int.from_bytes(payload, "big") ^ key).to_bytes(size, "big")
    return head + mask + masked


async def close_code_after(server: Server, frame: bytes, *, negotiated: bool) -> int:
    """Open ``/v1/realtime`` with a raw socket offering permessage-deflate (accepted, or
    not, as ``negotiated`` says), send ``frame``, and return the code of the close frame
    the gateway answers with."""
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    try:
        key = base64.b64encode(os.urandom(16)).decode()
        writer.write(
            (
                "GET /v1/realtime HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
                f"Connection: Upgrade\r\nAuthorization: Bearer {KEY}\r\n"
                f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n"
                "Sec-WebSocket-Extensions: permessage-deflate\r\n\r\n"
            ).encode()
        )
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 101"), head
        assert (b"permessage-deflate" in head.lower()) == negotiated, head
        writer.write(frame)
        while True:
            first, second = await asyncio.wait_for(reader.readexactly(2), 5)
            size = second & 0x7F
            if size == 126:
                size = int.from_bytes(await reader.readexactly(2), "big")
            elif size == 127:
                size = int.from_bytes(await reader.readexactly(8), "big")
            payload = await reader.readexactly(size)
            if first & 0x0F == 0x8:
                return int.from_bytes(payload[:2], "big")
    finally:
        writer.close()


async def test_a_deflate_bomb_on_the_socket_is_refused_uninflated_by_default(
    keyed: Server,
) -> None:
    # The gateway does not accept the client's offer of compression, so a frame sent
    # compressed anyway (RSV1) is a protocol error, closed without inflating a byte:
    # 16 KiB that would have held the event loop while they grew to 16 MiB.
    bomb = masked_frame(0xC1, deflated_zeros(16))  # FIN, RSV1, text
    assert len(bomb) < 20_000
    async with HealthProbe(keyed) as probe:
        assert await close_code_after(keyed, bomb, negotiated=False) == 1002
    assert probe.latencies and probe.worst < 0.1, probe.latencies


async def test_with_compression_on_a_message_inflating_past_the_limit_closes_1009(
    deflating: Server,
) -> None:
    # aiohttp stops inflating at the limit (1 MiB here), whatever the message would grow to.
    bomb = masked_frame(0xC1, deflated_zeros(64))
    async with HealthProbe(deflating) as probe:
        assert await close_code_after(deflating, bomb, negotiated=True) == 1009
    assert probe.latencies and probe.worst < 0.1, probe.latencies


# --- JSON nested too deep -------------------------------------------------------------


def deep_start(depth: int) -> str:
    """A ``start`` frame whose request is ``depth`` deep (past what orjson can write)."""
    request = orjson.dumps(chat()).decode()
    deep = "[" * (depth - 1) + "]" * (depth - 1)
    return '{"type":"start","request":' + request[:-1] + ',"metadata":' + deep + "}}"


def deep_bytes(depth: int) -> bytes:
    return b'{"model":"mock/echo","x":' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}"


async def test_json_nested_too_deep_is_a_400_on_every_endpoint(keyless: Server) -> None:
    for path in ("/v1/chat/completions", "/v1/responses", "/v1/messages"):
        for depth in (100, 300, 1100, 5000):
            answer = await request(keyless, "POST", path, deep_bytes(depth), JSON)
            assert answer.status == 400, (path, answer.body)
            if path == "/v1/messages":
                assert answer.json()["error"]["type"] == "invalid_request_error"
            elif depth < 1024:
                assert answer.json()["error"]["code"] == "invalid_request"
                assert answer.json()["error"]["param"] == "x"
            else:  # past orjson's own limit: not JSON it can parse
                assert answer.json()["error"]["code"] == "invalid_json"


async def test_json_nested_too_deep_on_the_socket_is_an_error_frame(keyless: Server) -> None:
    url = keyless.url.replace("http", "ws") + "/v1/realtime"
    async with websockets.connect(url) as ws:
        for depth in (100, 300, 2000):
            await ws.send(deep_start(depth))
            frame = orjson.loads(await ws.recv())
            assert frame["type"] == "error"
            if depth < 1024:
                assert frame["error"]["code"] == "invalid_request"
                assert frame["error"]["param"] == "request.metadata"
            else:  # past orjson's own limit: not JSON it can parse
                assert frame["error"]["code"] == "invalid_envelope"
        await ws.send(orjson.dumps({"type": "start", "request": chat("still here")}).decode())
        frames = [orjson.loads(await ws.recv())]
        while frames[-1].get("type") not in ("done", "error"):
            frames.append(orjson.loads(await ws.recv()))
        assert frames[-1]["type"] == "done"
