"""The connection layer of a real ``nexus serve``, through raw sockets: slow and idle
clients are closed, long streams and WebSockets are not, the connection cap answers
503, and an unmasked WebSocket frame is closed with 1002."""

from __future__ import annotations

import base64
import contextlib
import os
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from nexus_process import start_nexus, stop_nexus

HEADER_S = 0.5
KEEPALIVE_S = 1.0
BODY_S = 0.5


@contextlib.contextmanager
def serve(tmp_path: Path, server: str, *args: str) -> Iterator[tuple[str, int]]:
    """``nexus serve`` with ``server`` as its [server] table; its (host, port)."""
    config = tmp_path / "config.toml"
    config.write_text(f'[server]\n{server}\n[providers.mock]\nkind = "mock"\n')
    proc, match = start_nexus(config, tmp_path / "nexus.log", *args)
    host, port = match.group(1).removeprefix("http://").rsplit(":", 1)
    try:
        yield host, int(port)
    finally:
        stop_nexus(proc)
        log = (tmp_path / "nexus.log").read_text()
        assert "Traceback" not in log, log


@pytest.fixture(scope="module")
def timed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    settings = (
        f"header_timeout_s = {HEADER_S}\nkeepalive_timeout_s = {KEEPALIVE_S}\n"
        f"body_timeout_s = {BODY_S}"
    )
    with serve(tmp_path_factory.mktemp("timed"), settings) as address:
        yield address


_opened: list[socket.socket] = []


@pytest.fixture(autouse=True)
def _close_sockets() -> Iterator[None]:
    yield
    while _opened:
        _opened.pop().close()


def connect(address: tuple[str, int]) -> socket.socket:
    """A client socket, closed after the test."""
    sock = socket.create_connection(address, timeout=5)
    _opened.append(sock)
    return sock


def closed_after(sock: socket.socket, limit: float = 5.0) -> float:
    """Seconds until the server closes ``sock`` (reading and dropping what comes)."""
    started = time.monotonic()
    sock.settimeout(limit)
    while sock.recv(65536):
        pass
    return time.monotonic() - started


def response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response with a Content-Length."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    while len(body) < int(headers["content-length"]):
        chunk = sock.recv(65536)
        assert chunk
        body += chunk
    return int(lines[0].split()[1]), headers, body


HEALTHZ = b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n"


def test_a_connection_that_sends_nothing_is_closed(timed: tuple[str, int]) -> None:
    sock = connect(timed)
    elapsed = closed_after(sock)
    assert HEADER_S * 0.9 <= elapsed < HEADER_S + 1.0


def test_a_slow_request_head_is_closed(timed: tuple[str, int]) -> None:
    sock = connect(timed)
    started = time.monotonic()
    sock.settimeout(0.1)
    with pytest.raises(OSError):  # reset or EOF while it still trickles bytes
        for byte in b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nX-Slow: " + b"a" * 200:
            sock.send(bytes([byte]))
            try:
                if sock.recv(1) == b"":
                    raise ConnectionResetError("closed")
            except TimeoutError:
                pass
            assert time.monotonic() - started < HEADER_S + 1.0, "still open"
    assert time.monotonic() - started >= HEADER_S * 0.9


def test_an_idle_keepalive_connection_is_closed(timed: tuple[str, int]) -> None:
    sock = connect(timed)
    for _ in range(2):  # keep-alive works: a second request on the connection
        sock.sendall(HEALTHZ)
        assert response(sock)[0] == 200
        time.sleep(HEADER_S * 1.2)  # past the head timeout: idle is the longer keep-alive one
    elapsed = closed_after(sock) + HEADER_S * 1.2
    assert KEEPALIVE_S * 0.9 <= elapsed < KEEPALIVE_S + 1.0


def chat_head(length: int) -> bytes:
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % length
    )


CHAT_BODY = orjson.dumps({"model": "mock/echo", "messages": [{"role": "user", "content": "hi"}]})


def test_a_stalled_request_body_gets_408_and_is_closed(timed: tuple[str, int]) -> None:
    """Headers, part of the body, then nothing: 408 request_timeout after body_timeout_s,
    as JSON, and the connection closed (not held for the rest of the body)."""
    sock = connect(timed)
    sock.sendall(chat_head(len(CHAT_BODY)) + CHAT_BODY[:10])
    started = time.monotonic()
    sock.settimeout(5)
    status, headers, body = response(sock)
    elapsed = time.monotonic() - started
    assert status == 408, body
    assert orjson.loads(body)["error"]["code"] == "request_timeout"
    assert headers.get("connection", "").lower() == "close"
    assert BODY_S * 0.9 <= elapsed < BODY_S + 1.0
    assert closed_after(sock) < 1.0


def test_a_slow_but_steady_request_body_is_served(timed: tuple[str, int]) -> None:
    """The body timeout is between bytes: a body trickling for three times it is read."""
    sock = connect(timed)
    sock.sendall(chat_head(len(CHAT_BODY)))
    pieces = [CHAT_BODY[i : i + 8] for i in range(0, len(CHAT_BODY), 8)]
    pause = BODY_S * 3 / len(pieces)
    assert pause < BODY_S / 2
    for piece in pieces:
        time.sleep(pause)
        sock.sendall(piece)
    status, _, body = response(sock)
    assert status == 200, body
    assert orjson.loads(body)["choices"][0]["message"]["content"] == "hi"


def test_many_slow_clients_are_all_closed(timed: tuple[str, int]) -> None:
    """50 idle, 50 slow-head and 50 slow-body sockets: none is open a second past its
    timeout (they never complete, whatever they trickle)."""
    idle = [connect(timed) for _ in range(50)]
    heads = [connect(timed) for _ in range(50)]
    bodies = [connect(timed) for _ in range(50)]
    for sock in heads:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: loc")
    for sock in bodies:
        sock.sendall(chat_head(len(CHAT_BODY)) + CHAT_BODY[:5])
    deadline = time.monotonic() + max(HEADER_S, BODY_S) + 1.5
    open_ = {*idle, *heads, *bodies}
    while open_ and time.monotonic() < deadline:
        for sock in list(open_):
            sock.setblocking(False)
            try:
                while sock.recv(65536):
                    pass
                open_.discard(sock)  # EOF: closed by the server
            except BlockingIOError:
                pass
            except OSError:
                open_.discard(sock)  # reset: closed by the server
        time.sleep(0.05)
    assert not open_, f"{len(open_)} of 150 slow sockets still open"


def test_a_long_stream_is_not_cut(timed: tuple[str, int]) -> None:
    body = orjson.dumps(
        {
            "model": "mock/echo",
            "stream": True,
            "messages": [{"role": "user", "content": "word " * 8}],
            "mock": {"delay_ms": 250},  # 2 s: past both timeouts
        }
    )
    sock = connect(timed)
    sock.sendall(chat_head(len(body)) + body)
    started = time.monotonic()
    sock.settimeout(5)
    data = b""
    while b"data: [DONE]" not in data:
        chunk = sock.recv(65536)
        assert chunk, data
        data += chunk
    assert time.monotonic() - started > HEADER_S + KEEPALIVE_S
    assert data.count(b"word") == 8


def ws_handshake(sock: socket.socket) -> None:
    key = base64.b64encode(os.urandom(16))
    sock.sendall(
        b"GET /v1/realtime HTTP/1.1\r\nHost: localhost\r\nUpgrade: websocket\r\n"
        b"Connection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
        b"Sec-WebSocket-Key: " + key + b"\r\n\r\n"
    )
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        assert chunk
        data += chunk
    assert data.startswith(b"HTTP/1.1 101"), data
    assert data.endswith(b"\r\n\r\n"), data  # nothing after the 101 yet


def masked_frame(opcode: int, payload: bytes) -> bytes:
    mask = os.urandom(4)
    body = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    assert len(payload) < 126
    return bytes((0x80 | opcode, 0x80 | len(payload))) + mask + body


def read_frame(sock: socket.socket) -> tuple[int, bytes]:
    def exactly(n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = sock.recv(n - len(out))
            assert chunk, "closed before a whole frame"
            out += chunk
        return out

    first, second = exactly(2)
    length = second & 0x7F
    if length == 126:
        length = struct.unpack("!H", exactly(2))[0]
    elif length == 127:
        length = struct.unpack("!Q", exactly(8))[0]
    return first & 0x0F, exactly(length)


def test_a_websocket_is_not_cut(timed: tuple[str, int]) -> None:
    sock = connect(timed)
    ws_handshake(sock)
    time.sleep(HEADER_S + KEEPALIVE_S + 0.3)
    start = {
        "type": "start",
        "request": {"model": "mock/echo", "messages": [{"role": "user", "content": "hi"}]},
    }
    sock.sendall(masked_frame(1, orjson.dumps(start)))
    frames = []
    while not frames or frames[-1]["type"] not in ("done", "error"):
        opcode, payload = read_frame(sock)
        assert opcode == 1, (opcode, payload)
        frames.append(orjson.loads(payload))
    assert frames[-1] == {"type": "done"}


@pytest.mark.parametrize("together", [False, True], ids=["after", "with-handshake"])
def test_an_unmasked_client_frame_closes_with_1002(timed: tuple[str, int], together: bool) -> None:
    sock = connect(timed)
    unmasked = b"\x81\x05hello"  # FIN, text, no mask bit, 5 bytes
    if together:  # in the same packet as the handshake: aiohttp buffers it as the upgrade's tail
        key = base64.b64encode(os.urandom(16))
        sock.sendall(
            b"GET /v1/realtime HTTP/1.1\r\nHost: localhost\r\nUpgrade: websocket\r\n"
            b"Connection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
            b"Sec-WebSocket-Key: " + key + b"\r\n\r\n" + unmasked
        )
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(1)
            assert chunk
            data += chunk
        assert data.startswith(b"HTTP/1.1 101"), data
    else:
        ws_handshake(sock)
        sock.sendall(masked_frame(9, b"ping"))  # a masked frame first: fine
        assert read_frame(sock) == (10, b"ping")
        sock.sendall(unmasked)
    opcode, payload = read_frame(sock)
    assert opcode == 8
    assert struct.unpack("!H", payload[:2])[0] == 1002
    assert closed_after(sock, 2.0) < 2.0


@pytest.fixture(scope="module", params=["uvloop", "asyncio"])
def capped(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[tuple[str, int]]:
    settings = "max_connections = 4\nheader_timeout_s = 10"
    with serve(tmp_path_factory.mktemp("capped"), settings, "--loop", request.param) as address:
        yield address


def refusals(address: tuple[str, int]) -> float:
    """``nexus_connections_refused_total``, scraped (a keyless gateway, from this machine)."""
    sock = connect(address)
    sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
    status, _, body = response(sock)
    sock.close()
    assert status == 200
    (line,) = [x for x in body.decode().splitlines() if x.startswith("nexus_connections_refused")]
    return float(line.split()[-1])


def test_the_connection_past_the_cap_gets_503(capped: tuple[str, int]) -> None:
    before = refusals(capped)
    time.sleep(0.2)  # its connection closed
    held = [connect(capped) for _ in range(4)]
    time.sleep(0.2)  # accepted
    extra = connect(capped)
    extra.sendall(HEALTHZ)
    status, headers, body = response(extra)
    assert status == 503
    assert headers["retry-after"] == "1"
    assert headers["connection"] == "close"
    assert headers["content-type"] == "application/json"
    error = orjson.loads(body)["error"]
    assert error["code"] == "too_many_connections"
    assert error["request_id"] == headers["x-request-id"] == headers["request-id"]
    assert closed_after(extra, 3.0) < 3.0
    for sock in held:  # the ones under the cap work
        sock.sendall(HEALTHZ)
        assert response(sock)[0] == 200
    # A slot frees when a connection closes.
    held.pop().close()
    time.sleep(0.2)
    again = connect(capped)
    again.sendall(HEALTHZ)
    assert response(again)[0] == 200
    late = connect(capped)  # and the cap holds again
    late.sendall(HEALTHZ)
    assert response(late)[0] == 503
    for sock in [*held, again, late, extra]:
        sock.close()
    time.sleep(0.2)
    assert refusals(capped) - before == 2  # counted, for /metrics


def test_a_rejected_connection_that_sends_nothing_is_answered_and_closed(
    capped: tuple[str, int],
) -> None:
    held = [connect(capped) for _ in range(4)]
    time.sleep(0.2)
    extra = connect(capped)  # it never sends its request
    status, _, _ = response(extra)
    assert status == 503
    assert closed_after(extra, 3.0) < 3.0
    for sock in held:
        sock.close()
    time.sleep(0.2)


def test_workers_apply_the_timeouts(tmp_path: Path) -> None:
    with serve(tmp_path, f"header_timeout_s = {HEADER_S}", "--workers", "2") as address:
        socks = [connect(address) for _ in range(4)]  # spread across the workers
        for sock in socks:
            assert closed_after(sock) < HEADER_S + 1.5


@pytest.mark.parametrize(
    ("soft", "hard", "cap", "after", "warned"),
    [
        (1024, 20000, 20000, 20000, False),  # raised to the hard limit
        (1024, 4096, 20000, 4096, True),  # still below the cap: a warning
        (1024, 20000, 100, 1024, False),  # enough already
    ],
)
def test_the_open_file_limit_is_raised_for_the_cap(
    tmp_path: Path, soft: int, hard: int, cap: int, after: int, warned: bool
) -> None:
    script = tmp_path / "limits.py"
    script.write_text(
        "import logging, resource\n"
        "logging.basicConfig()\n"
        f"resource.setrlimit(resource.RLIMIT_NOFILE, ({soft}, {hard}))\n"
        "from nexus.serve_checks import open_files_for\n"
        f"open_files_for({cap})\n"
        "print(resource.getrlimit(resource.RLIMIT_NOFILE)[0])\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    if done.returncode and "not allowed" in done.stderr:  # a hard limit below the case's
        pytest.skip(done.stderr)
    assert int(done.stdout) == after
    assert ("max_connections is" in done.stderr) is warned
