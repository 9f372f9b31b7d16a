"""Errors that say what is wrong: the path as sent, aiohttp's reason for a refused
WebSocket handshake, and a 400 (not a 500 and a traceback) for a resume point in
digits that are not ASCII."""

from __future__ import annotations

import pytest

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
