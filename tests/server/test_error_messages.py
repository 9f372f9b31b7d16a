"""Errors that say what is wrong: the path as sent, aiohttp's reason for a refused
WebSocket handshake, a 400 (not a 500 and a traceback) for a resume point in digits that
are not ASCII; and a refusal before any ``100 Continue``."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from nexus.auth import hash_key
from support import MakeClient


async def test_a_path_is_quoted_as_sent(make_client: MakeClient) -> None:
    client = await make_client()
    resp = await client.post("/v1%2Fchat%2Fcompletions", json={})
    assert resp.status == 404
    assert (await resp.json())["error"]["message"] == "No route for POST /v1%2Fchat%2Fcompletions."


async def test_a_refused_websocket_handshake_says_why(make_client: MakeClient) -> None:
    client = await make_client()
    resp = await client.get("/v1/realtime")
    assert resp.status == 400
    message = (await resp.json())["error"]["message"]
    assert "Upgrade" in message and message != "Bad Request"


@pytest.mark.parametrize("after", ["\u00b2", "\u2460", "\U0001d7d0", "-1", "1.0"])
async def test_a_resume_point_is_ascii_digits(make_client: MakeClient, after: str) -> None:
    client = await make_client()
    created = await client.post(
        "/v1/responses",
        json={"model": "mock/echo", "input": "hi", "background": True},
    )
    response_id = (await created.json())["id"]
    resp = await client.get(
        f"/v1/responses/{response_id}", params={"stream": "true", "starting_after": after}
    )
    assert resp.status == 400
    assert (await resp.json())["error"]["param"] == "starting_after"


async def test_100_continue_waits_for_the_requests_headers_to_pass(make_client: MakeClient) -> None:
    """aiohttp answered ``100 Continue`` before any check: a request its headers refuse
    (no key, too large, another page's) was asked for its upload all the same."""
    key = "nx-continue-0123456789abcdef"
    client = await make_client({"auth": {"keys": [{"name": "k", "sha256": hash_key(key)}]}})
    body = orjson.dumps({"model": "mock/echo", "messages": [{"role": "user", "content": "hi"}]})

    async def first_line(headers: str, send_body: bool) -> list[bytes]:
        reader, writer = await asyncio.open_connection(client.server.host, client.server.port)
        head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n{headers}"
        head += f"Expect: 100-continue\r\nContent-Length: {len(body)}\r\n\r\n"
        writer.write(head.encode())
        lines = [await asyncio.wait_for(reader.readline(), 5)]
        if send_body:
            await reader.readline()  # the interim response's blank line
            writer.write(body)
            lines.append(await asyncio.wait_for(reader.readline(), 5))
        writer.close()
        return lines

    assert await first_line("", False) == [b"HTTP/1.1 401 Unauthorized\r\n"]
    assert await first_line(f"Authorization: Bearer {key}\r\n", True) == [
        b"HTTP/1.1 100 Continue\r\n",
        b"HTTP/1.1 200 OK\r\n",
    ]
