"""A valid API key inside malformed requests never reaches the log, ``/metrics`` or a
response body: a real ``nexus serve`` with a key, text and JSON logs, aiohttp's C parser
and its pure-Python one, raw sockets."""

from __future__ import annotations

import base64
import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import orjson
import pytest

from nexus.auth import hash_key, new_key
from nexus_process import start_nexus, stop_nexus
from support import METRICS_TOKEN, METRICS_TOKEN_ENV

KEY = new_key()
K = KEY.encode()
WS = (
    b"GET /v1/realtime HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
    b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: " + base64.b64encode(b"k" * 16) + b"\r\n"
)
CHAT = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
GET = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n"

MALFORMED = {
    "authorization-7f": GET + b"Authorization: Bearer " + K + b"\x7f\r\n\r\n",
    "authorization-00": GET + b"Authorization: Bearer " + K + b"\x00\r\n\r\n",
    "x-api-key-7f": GET + b"x-api-key: " + K + b"\x7f\r\n\r\n",
    "x-api-key-00": GET + b"x-api-key: " + K + b"\x00\r\n\r\n",
    "cookie": GET + b"Cookie: key=" + K + b"\x7f\r\n\r\n",
    "proxy-authorization": GET + b"Proxy-Authorization: Bearer " + K + b"\x00\r\n\r\n",
    "header-too-long": GET + b"Authorization: Bearer " + K + b"A" * 9000 + b"\r\n\r\n",
    "line-too-long-after": GET
    + b"Authorization: Bearer "
    + K
    + b"\r\nX: "
    + b"A" * 9000
    + b"\r\n\r\n",
    "request-line": b"GET /v1/models?key=" + K + b"\x7f HTTP/1.1\r\nHost: x\r\n\r\n",
    "request-line-space": b"GET /Bearer " + K + b" HTTP/1.1\r\nHost: x\r\n\r\n",
    "request-line-too-long": b"GET /" + K + b"A" * 9000 + b" HTTP/1.1\r\n\r\n",
    "subprotocol": WS + b"Sec-WebSocket-Protocol: nexus.v1, nexus-key." + K + b"\x7f\r\n\r\n",
    "obs-fold": GET + b"Authorization: Bearer\r\n " + K + b"\r\n\r\n",
    "obs-fold-tab": GET + b"X-Api-Key: x\r\n\t" + K + b"\r\n\r\n",
    "duplicate-content-length": CHAT
    + b"Authorization: Bearer "
    + K
    + b"\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
    "te-and-cl": CHAT
    + b"Authorization: Bearer "
    + K
    + b"\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n0\r\n\r\n",
    "bad-chunk": CHAT + b"Authorization: Bearer " + K + b"\r\nTransfer-Encoding: chunked\r\n\r\nzz"
    b"" + K + b"\r\n",
    "space-before-colon": GET + b"Authorization : Bearer " + K + b"\r\n\r\n",
    "no-colon": GET + b"Authorization Bearer " + K + b"\r\n\r\n",
    "bad-name": GET + b"Auth\x01orization: Bearer " + K + b"\r\n\r\n",
    "bare-lf": b"GET /v1/models HTTP/1.1\nAuthorization: Bearer " + K + b"\x7f\n\n",
    "bare-cr": GET + b"Authorization: Bearer " + K + b"\rX\r\n\r\n",
    "bad-method": b"G\x01T /v1/models HTTP/1.1\r\nAuthorization: Bearer " + K + b"\r\n\r\n",
    "pipelined": GET
    + b"Authorization: Bearer "
    + K
    + b"\r\n\r\n"
    + GET
    + b"x-api-key: "
    + K
    + b"\x7f\r\n\r\n",
    "upgrade-tail": WS + b"Authorization: Bearer " + K + b"\r\n\r\n\x81\x05hello",
}


@dataclass
class Server:
    address: tuple[str, int]
    log: Path


@pytest.fixture(
    scope="module",
    params=[("text", "c"), ("json", "c"), ("json", "python")],
    ids=["text", "json", "json-python-parser"],
)
def server(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Server]:
    fmt, parser = request.param
    tmp = tmp_path_factory.mktemp(f"secrets-{fmt}-{parser}")
    config = tmp / "config.toml"
    config.write_text(
        "[server]\nheader_timeout_s = 2\n"
        f'[logging]\nformat = "{fmt}"\n'
        f'[metrics]\ntoken_env = "{METRICS_TOKEN_ENV}"\n'
        f'[[auth.keys]]\nname = "app"\nsha256 = "{hash_key(KEY)}"\n'
        '[providers.mock]\nkind = "mock"\n'
    )
    log = tmp / "nexus.log"
    saved = os.environ.get("AIOHTTP_NO_EXTENSIONS")
    if parser == "python":
        os.environ["AIOHTTP_NO_EXTENSIONS"] = "1"
    try:
        with pytest.MonkeyPatch.context() as env:
            env.setenv(METRICS_TOKEN_ENV, METRICS_TOKEN)
            proc, match = start_nexus(config, log, "--log-level", "DEBUG")
    finally:
        if saved is None:
            os.environ.pop("AIOHTTP_NO_EXTENSIONS", None)
    host, port = match.group(1).removeprefix("http://").rsplit(":", 1)
    try:
        yield Server((host, int(port)), log)
    finally:
        stop_nexus(proc)


def exchange(address: tuple[str, int], raw: bytes) -> bytes:
    """Send ``raw``; everything that comes back until the server closes (or 3 s pass)."""
    with socket.create_connection(address, timeout=3) as sock:
        with contextlib.suppress(OSError):  # closed while we wrote: what it sent still counts
            sock.sendall(raw)
        out = b""
        try:
            while chunk := sock.recv(65536):
                out += chunk
        except OSError:
            pass
    return out


def test_the_key_is_never_logged_nor_echoed(server: Server) -> None:
    bodies = {name: exchange(server.address, raw) for name, raw in MALFORMED.items()}
    metrics = (
        b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
        b"Authorization: Bearer " + METRICS_TOKEN.encode() + b"\r\n\r\n"
    )
    bodies["metrics"] = exchange(server.address, metrics)
    assert bodies["metrics"].startswith(b"HTTP/1.1 200")
    for name, body in bodies.items():
        assert K not in body, (name, body)
    log = server.log.read_text(errors="replace")
    assert KEY not in log
    assert KEY[3:] not in log  # not even the key without its prefix
    # The malformed ones got a JSON 400 (except the pipelined valid request's 200 first).
    answered = [b for n, b in bodies.items() if n not in ("metrics", "upgrade-tail")]
    for body in answered:
        if not body:  # the pure-Python parser may take a shape the C one refuses
            continue
        last = body[body.rfind(b"HTTP/1.") :]
        status = int(last.split(b" ", 2)[1])
        if status == 400:
            error = orjson.loads(last.partition(b"\r\n\r\n")[2])["error"]
            assert error["code"] == "invalid_request"
            assert error["message"].startswith("Malformed HTTP request: ")
    assert "rejected:invalid_header" in log  # their access lines


def test_the_access_log_records_the_parser_errors_in_its_format(server: Server) -> None:
    exchange(server.address, MALFORMED["authorization-7f"])
    deadline = time.monotonic() + 5  # (the line comes once the answer is out)
    while not (lines := rejected_lines(server.log)) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert lines
    if lines[-1].startswith("{"):
        record = orjson.loads(lines[-1])
        assert record["logger"] == "nexus.access"
        assert record["outcome"] == "rejected:invalid_header"
        assert record["status"] == 400
        assert record["key"] is None
        assert "error" not in record


def rejected_lines(log: Path) -> list[str]:
    return [line for line in log.read_text().splitlines() if "rejected:invalid_header" in line]


def test_only_the_gateway_reports_it(server: Server) -> None:
    # aiohttp's own "Error handling request" line (with the raw bytes) is not written.
    exchange(server.address, MALFORMED["cookie"])
    assert "Error handling request" not in server.log.read_text()


def test_redaction_catches_what_aiohttp_logs_itself(tmp_path: Path) -> None:
    """The filter `nexus serve` installs, on aiohttp's own report of a parser error."""
    script = tmp_path / "probe.py"
    script.write_text(
        "import logging, sys\n"
        "from aiohttp.http_exceptions import BadHttpMessage\n"
        "from nexus.cli import _setup_logging\n"
        "_setup_logging('INFO', sys.argv[1])\n"
        "try:\n"
        f"    raise BadHttpMessage('Invalid header value char:\\n\\n  b\\' {KEY}\\'\\n  ^')\n"
        "except BadHttpMessage as exc:\n"
        "    logging.getLogger('aiohttp.server').exception('Error handling', exc_info=exc)\n"
        f"logging.getLogger('aiohttp.server').info('x-api-key: %s', {KEY!r})\n"
    )
    for fmt in ("text", "json"):
        out = subprocess.run(
            [sys.executable, str(script), fmt], capture_output=True, text=True, check=True
        ).stderr
        assert "BadHttpMessage" in out
        assert KEY not in out and KEY[3:] not in out
