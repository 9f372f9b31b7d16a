"""What a pushed batch puts on the wire, read off a raw socket: HEAD and HTTP/1.0 clients."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson

from support import MakeClient, chat


async def _raw(client: Any, head: bytes, body: bytes = b"") -> bytes:
    reader, writer = await asyncio.open_connection(client.host, client.port)
    writer.write(head + body)
    await writer.drain()
    data = b""
    try:
        async with asyncio.timeout(5):
            while chunk := await reader.read(65536):
                data += chunk
    except TimeoutError:
        data += b"<<TIMEOUT>>"
    writer.close()
    await writer.wait_closed()
    return data


def _post(body: bytes, version: bytes = b"1.1") -> bytes:
    return (
        b"POST /v1/chat/completions HTTP/" + version + b"\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\nConnection: close\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body)
    )


async def test_a_pushed_stream_is_framed_as_its_headers_say(make_client: MakeClient) -> None:
    client = await make_client()
    body = orjson.dumps(chat(stream=True, mock={"content": "a b c d e f", "delay_ms": 20}))
    data = await _raw(client, _post(body), body)
    head, _, rest = data.partition(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in head.lower()
    assert rest.endswith(b"0\r\n\r\n")


async def test_an_http_1_0_client_gets_a_body_it_can_read(make_client: MakeClient) -> None:
    client = await make_client()
    body = orjson.dumps(chat(stream=True, mock={"content": "a b c d e f", "delay_ms": 20}))
    data = await _raw(client, _post(body, b"1.0"), body)
    head, _, rest = data.partition(b"\r\n\r\n")
    assert b"chunked" not in head.lower()
    assert head.startswith(b"HTTP/1.0 200 ")
    assert rest.startswith(b"retry: ")
    assert rest.endswith(b"data: [DONE]\n\n")


async def test_a_head_request_on_a_live_stream_gets_no_body(make_client: MakeClient) -> None:
    client = await make_client()
    body = chat(stream=True, mock={"content": "a " * 30, "delay_ms": 30})
    async with client.post(
        "/v1/chat/completions", json=body, headers={"X-Nexus-Resumable": "true"}
    ) as response:
        stream_id = response.headers["X-Nexus-Stream-Id"]
        await response.content.readany()
        head = (
            b"HEAD /v1/streams/%s HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
            % stream_id.encode()
        )
        data = await _raw(client, head)
        await response.read()
    _, _, rest = data.partition(b"\r\n\r\n")
    assert rest == b""
