"""A body the HTTP parser refuses after the route began reading it (a good chunk, then a
chunk-size line that is not one) is a prompt ``400 invalid_request`` on the request's own
access line, wherever aiohttp tells the request's payload.

aiohttp's pure-Python parser sets its error on the payload: the route's read raised it, and
it became a ``500`` with a traceback at ERROR quoting the client's bytes. aiohttp's C parser
(the default) drops the payload without a word (``_http_parser.pyx``: ``self._payload =
None; raise ex``) and its request handler queues the error as the connection's next
message, answered once the route is done: the route cannot know, and its read times out
(``[server] body_timeout_s``, a ``408``), as docs/http-api.md says.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import orjson
import pytest
from aiohttp import StreamReader, http_parser, web
from aiohttp.http_exceptions import TransferEncodingError
from aiohttp.test_utils import make_mocked_request

from nexus.config import parse_config
from nexus.encoders.registry import default_registry
from nexus.errors import InvalidRequest
from nexus.server.app import create_app
from nexus.server.routes.common import read_body
from nexus.server.state import exchange
from nexus_process import start_nexus, stop_nexus
from support import MakeClient

SECRET = b"zz-not-a-chunk-size"
"""The bad chunk-size line: none of it may reach the answer or the log."""
HEAD = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
    b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
)


async def send_a_body_gone_bad(host: str, port: int) -> tuple[float, bytes]:
    """A good chunk, and once the route reads, a bad chunk-size line: how long the answer
    took after it, and the answer."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(HEAD + b'5\r\n{"mod\r\n')
        await writer.drain()
        await asyncio.sleep(0.2)  # the route is reading the body
        sent = time.monotonic()
        writer.write(SECRET + b"\r\n")
        answer = await asyncio.wait_for(reader.read(), 10)
        return time.monotonic() - sent, answer
    finally:
        writer.close()


@pytest.fixture(scope="module")
def python_parser_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """``nexus serve`` on aiohttp's pure-Python parser (``AIOHTTP_NO_EXTENSIONS``)."""
    tmp = tmp_path_factory.mktemp("malformed")
    config = tmp / "config.toml"
    config.write_text('[server]\nbody_timeout_s = 5\n[providers.mock]\nkind = "mock"\n')
    log = tmp / "nexus.log"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("AIOHTTP_NO_EXTENSIONS", "1")
        proc, match = start_nexus(config, log)
    try:
        yield match.group(1), log
    finally:
        stop_nexus(proc, gently=False)


async def test_a_body_the_parser_refuses_mid_read_is_a_prompt_400(
    python_parser_gateway: tuple[str, Path],
) -> None:
    url, log = python_parser_gateway
    host, port = url.removeprefix("http://").split(":")
    took, answer = await send_a_body_gone_bad(host, int(port))
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 "), answer
    assert took < 2  # not [server] body_timeout_s (5 s) later
    assert b"X-Content-Type-Options: nosniff" in head and b"Connection: close" in head
    error = orjson.loads(body)["error"]
    assert error["code"] == "invalid_request"
    assert error["message"] == "Malformed HTTP request: invalid chunked body."
    assert SECRET not in answer
    request_id = error["request_id"]
    for _ in range(100):  # the access line, once the answer is out
        text = log.read_text(errors="replace")
        if (line := re.search(rf"nexus\.access.*{request_id}.*", text)) is not None:
            break
        await asyncio.sleep(0.05)
    assert line is not None, text
    assert "status=400 outcome=error:invalid_request" in line.group(0)
    assert 'reason="invalid chunked body"' in line.group(0)
    assert SECRET.decode() not in text and "Traceback" not in text


async def test_aiohttps_payload_error_around_the_parsers_is_a_400_too() -> None:
    """Once nobody waits on the payload, the pure-Python parser's error there is aiohttp's
    ``RequestPayloadError`` around it, whose message quotes the bytes: the parser's own
    description is used, not it."""
    app = create_app(parse_config({}), registry=default_registry.copy())
    payload = StreamReader(mock.Mock(), 2**16, loop=asyncio.get_running_loop())
    cause = TransferEncodingError(SECRET.decode())
    wrapped = web.RequestPayloadError(str(cause))
    wrapped.__cause__ = cause
    payload.set_exception(wrapped)
    request = make_mocked_request(
        "POST", "/v1/chat/completions", {"Transfer-Encoding": "chunked"}, app=app, payload=payload
    )
    with pytest.raises(InvalidRequest) as refused:
        await read_body(request)
    assert str(refused.value) == "Malformed HTTP request: invalid chunked body."
    assert exchange(request).reason == "invalid chunked body"


@pytest.mark.skipif(
    http_parser.HttpRequestParser is http_parser.HttpRequestParserPy,
    reason="aiohttp's C parser is not built here",
)
async def test_under_aiohttps_c_parser_the_route_is_never_told(make_client: MakeClient) -> None:
    """The limit docs/http-api.md states: aiohttp's C parser tells the payload nothing,
    so the route's read waits for ``[server] body_timeout_s``. Should this fail, aiohttp
    now tells it: the answer is the prompt 400 above, and the docs are to say so."""
    client = await make_client({"server": {"body_timeout_s": 0.5}})
    took, answer = await send_a_body_gone_bad(client.server.host, client.server.port)
    assert answer.startswith(b"HTTP/1.1 408 "), answer
    assert took >= 0.25  # (0.5 s from the route's first read, 0.2 s before the bad line)
